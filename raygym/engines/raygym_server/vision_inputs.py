"""Images for raygym's server: a prompt's pixels and M-RoPE positions, and the prefill batch built from them.

A vision-language model (a checkpoint whose config has ``vision_config``, e.g. Qwen2.5-VL) takes a prompt's
images as ``pixel_values`` and ``image_grid_thw`` from the checkpoint's image processor, and every prompt token
three rotary positions (temporal, height, width; :func:`raygym.vision.tokens.mrope_positions`). The prompt
arrives already expanded: each image is ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` with
N = :func:`raygym.vision.tokens.tokens_per_image`. :class:`VisionSupport` turns a prompt and its images into
:class:`ImageInputs` once per request (refusing a prompt whose pad count does not match its images).

Past the prompt every token is text, and its three positions are its index plus the prompt's ``delta``. The
engine keeps, per row, the (text) position of the row's last token with the delta already added, so decoding,
rows leaving and rows joining (continuous batching) carry each row's delta without any other bookkeeping
(:func:`build_prefill`). HF's own ``rope_deltas`` (state on the model, one batch at a time) is never used:
prefills with images get explicit ``(3, B, L)`` position ids, decode steps 2-D ones (HF repeats them three
times). A batch without images is prefilled exactly as for a text-only model.

A generated token is text, even an ``<|image_pad|>`` a model happens to sample: decoding embeds it as a token.
A prefill of a row's prompt and tokens so far (a retracted or recomputed row) must embed it the same way,
while HF's forward would put image features at every pad of ``input_ids`` (and refuse the count); so a
prefill with images passes ``inputs_embeds`` with the images' features at the prompt's pads only
(:func:`raygym.vision.model_inputs.embed_with_images`), exactly HF's own ``masked_scatter``.

>>> p = build_prefill([[5, 6, 7], [8]], [None, None], pad_token_id=0, device=torch.device("cpu"))
>>> p.input_ids.tolist(), p.mask.tolist(), p.positions.tolist(), p.model_kwargs
([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]], {})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from raygym.vision.tokens import mrope_positions, tokens_per_image

ImageRef = Any  # a path, URL, base64 text, data URL, bytes, HF datasets dict, or a PIL image


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """One prompt's images as the model takes them, and the prompt's M-RoPE positions.

    ``positions``: three rows (temporal, height, width) over the prompt; ``delta``: what every later token adds
    to its index (Qwen2-VL's ``rope_deltas``; at most 0: an image of h x w tokens advances positions by max(h, w)).
    """

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: torch.Tensor  # [images, 3], long
    positions: list[list[int]] = field(repr=False)
    delta: int
    image_token_id: int

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def row_positions(self, length: int) -> list[list[int]]:
        """The three position rows of the prompt followed by ``length - len(prompt)`` generated (text) tokens."""
        prompt = len(self.positions[0])
        tail = [prompt + k + self.delta for k in range(length - prompt)]
        return [row + tail for row in self.positions]


# The model families whose images this module places (features at the pads, M-RoPE positions); Qwen3-VL also
# feeds its vision tower's intermediate features into the language model's first layers (not done here).
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class VisionSupport:
    """What raygym's server knows of a vision-language model: its image token, merge size, image processor
    (``unsupported``: why it cannot take images, for a vision-language model of another family)."""

    def __init__(self, *, image_token_id: int, merge_size: int, image_processor: Any, model_name: str,
                 unsupported: str | None = None) -> None:
        self.image_token_id = int(image_token_id)
        self.merge_size = int(merge_size)
        self.image_processor = image_processor
        self.model_name = model_name
        self.unsupported = unsupported

    @classmethod
    def from_model(cls, model: torch.nn.Module, image_processor: Any) -> VisionSupport | None:
        """The support of ``model`` (None for a text-only model: its config has no ``vision_config``)."""
        config: dict[str, Any] = model.config.to_dict()  # type: ignore[union-attr,operator]  # transformers' config as data
        vision = config.get("vision_config")
        if vision is None:
            return None
        kind, token = config.get("model_type"), config.get("image_token_id")
        unsupported = None
        if kind not in SUPPORTED_MODEL_TYPES or token is None:
            unsupported = (f"the model {model_name(model)} (model_type {kind!r}) is a vision-language model raygym's "
                           f"server does not run images for; it runs those of model_type {list(SUPPORTED_MODEL_TYPES)}")
        return cls(image_token_id=int(token if token is not None else -1),
                   merge_size=int(vision.get("spatial_merge_size", 2)), image_processor=image_processor,
                   model_name=model_name(model), unsupported=unsupported)

    def count_image_tokens(self, input_ids: Sequence[int]) -> int:
        """How many ``<|image_pad|>`` tokens ``input_ids`` holds."""
        return sum(1 for t in input_ids if t == self.image_token_id)

    def prepare(self, input_ids: Sequence[int], images: Sequence[ImageRef]) -> ImageInputs:
        """Decode ``images``, run the image processor, check the prompt's pad count and compute its positions.

        ValueError (:class:`raygym.vision.images.ImageError` for an unreadable image) naming what is wrong.
        """
        if not images:
            raise ValueError("prepare() needs at least one image")
        if self.unsupported is not None:
            raise ValueError(f"image_data: {self.unsupported}")
        if self.image_processor is None:
            raise ValueError(f"{self.model_name}: the checkpoint has no image processor (preprocessor_config.json); "
                             "it cannot take images")
        pil = [_as_pil(image, k) for k, image in enumerate(images)]
        try:
            out = self.image_processor(images=pil, return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the image processor refused the image(s): {exc}") from exc
        grids = torch.as_tensor(out["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
        pixels = torch.as_tensor(out["pixel_values"])
        per_image = [tokens_per_image(g, self.merge_size) for g in grids.tolist()]
        have = self.count_image_tokens(input_ids)
        if have != sum(per_image):
            raise ValueError(
                f"the prompt has {have} image token(s) (<|image_pad|>, id {self.image_token_id}) but its "
                f"{len(per_image)} image(s) need {sum(per_image)} ({' + '.join(map(str, per_image))}: one per "
                f"merged patch of each image's grid {grids.tolist()}); expand each image's pad with "
                "raygym.vision.tokens.expand_image_pads")
        positions, delta = mrope_positions(list(input_ids), image_token=self.image_token_id, grids=grids.tolist(),
                                           merge=self.merge_size)
        return ImageInputs(pixel_values=pixels, image_grid_thw=grids, positions=positions, delta=delta,
                           image_token_id=self.image_token_id)

    def check_text_prompt(self, input_ids: Sequence[int]) -> None:
        """ValueError when a prompt sent without images holds image tokens (their pixels would be missing)."""
        have = self.count_image_tokens(input_ids)
        if have:
            raise ValueError(f"the prompt has {have} image token(s) (<|image_pad|>, id {self.image_token_id}) but "
                             "no image_data; send its images in image_data")


def prepare_images(vision: VisionSupport | None, model: str, input_ids: Sequence[int], images: Sequence[ImageRef]
                   ) -> ImageInputs | None:
    """A request's ``images`` for the model ``model`` (``vision``: its support, None for a text-only model):
    None without images (a prompt that holds image tokens is then refused), else :meth:`VisionSupport.prepare`.
    ValueError saying what is wrong (images for a text-only model, an unreadable image, a wrong pad count)."""
    if vision is None:
        if images:
            raise ValueError(f"image_data: the model {model} is a text-only model (its config has no vision_config); "
                             "send no images")
        return None
    if not images:
        vision.check_text_prompt(input_ids)
        return None
    return vision.prepare(input_ids, images)


def model_name(model: torch.nn.Module) -> str:
    """A model's name for messages: its checkpoint path, else its class."""
    return str(model.config.name_or_path or type(model).__name__)  # type: ignore[union-attr]


def _as_pil(image: ImageRef, index: int) -> Any:
    from PIL import Image

    from raygym.vision.images import ImageError, decode_image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    try:
        return decode_image(image)
    except ImageError as exc:
        raise ImageError(f"image {index}: {exc}") from None


class Prefill(NamedTuple):
    """The tensors of one prefill: left-padded ``input_ids`` and ``mask`` [B, L]; ``positions`` [B, L], the
    engine's per-row positions (each row's text positions plus its M-RoPE delta: the last column continues
    decoding); ``model_kwargs``: what else the forward pass takes (images: ``pixel_values``,
    ``image_grid_thw``, ``image_mask`` [B, L] (the prompts' pads, for :func:`raygym.vision.model_inputs.embed_with_images`) and
    ``position_ids`` [3, B, L])."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    model_kwargs: dict[str, torch.Tensor]


def build_prefill(seqs: Sequence[Sequence[int]], images: Sequence[ImageInputs | None], *, pad_token_id: int,
                  device: torch.device) -> Prefill:
    """Left-pad ``seqs`` (prompt + tokens so far) into one batch; rows with ``images`` get their pixels and
    M-RoPE positions (pad positions are 0). Without images the batch is exactly a text model's."""
    assert len(seqs) == len(images)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
        mask[i, width - len(s):] = 1
    if all(im is None for im in images):
        input_ids, mask = input_ids.to(device), mask.to(device)
        return Prefill(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), {})
    rope = torch.zeros((3, len(seqs), width), dtype=torch.long)
    deltas = torch.zeros((len(seqs), 1), dtype=torch.long)
    image_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, im) in enumerate(zip(seqs, images, strict=True)):
        n = len(s)
        if im is None:
            rope[:, i, width - n:] = torch.arange(n)
        else:
            rope[:, i, width - n:] = torch.tensor(im.row_positions(n), dtype=torch.long)
            deltas[i, 0] = im.delta
            prompt = len(im.positions[0])  # the prompt's pads are its images'; later ones are generated text
            image_mask[i, width - n:width - n + prompt] = input_ids[i, width - n:width - n + prompt] == im.image_token_id
    with_images = [im for im in images if im is not None]
    kwargs = {
        "position_ids": rope.to(device),
        "pixel_values": torch.cat([im.pixel_values for im in with_images]).to(device),
        "image_grid_thw": torch.cat([im.image_grid_thw for im in with_images]).to(device),
        "image_mask": image_mask.to(device),
    }
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) + deltas.to(device)
    return Prefill(input_ids, mask, positions, kwargs)


def score_inputs(input_ids: Sequence[int], images: ImageInputs | None, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """The forward-pass arguments of one whole sequence (no padding, no cache) with its images."""
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    if images is None:
        return {"input_ids": ids}
    rope = torch.tensor(images.row_positions(len(input_ids)), dtype=torch.long, device=device)[:, None, :]
    return {"input_ids": ids, "position_ids": rope, "pixel_values": images.pixel_values.to(device),
            "image_grid_thw": images.image_grid_thw.to(device)}
