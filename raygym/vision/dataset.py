"""Images in prompt datasets: the recipe's ``multimodal_keys``, a row's image column, and the prompt tokens of a
sample with images.

``multimodal_keys`` maps a modality to the dataset column that holds it, as slime reads it:
``{"image": "images"}`` (a dict or JSON text; :func:`parse_multimodal_keys`, which the Recipe's validation
runs, lives with the config's rules and is re-exported here). Only ``"image"`` is supported. A row's image
column holds one image reference or a list of them: a path or fsspec URL (a relative path is relative to the
data file's directory), a data URL, bare base64, raw bytes, or a Hugging Face datasets image
``{"bytes", "path"}``; a parquet column may hold JSON text of such a list. ``None`` or ``[]`` is a row
without images.

The prompt names each image with :data:`~raygym.builtin.tiny_vlm.IMAGE_PLACEHOLDER`
(``<|vision_start|><|image_pad|><|vision_end|>``), the k-th placeholder standing for the k-th image; a prompt
without any gets one per image in front (of its first user message, for chat prompts). Chat messages may
write their content as OpenAI-style parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` /
``{"type": "image_url", ...}`` / ``{"type": "input_image", ...}``: each image part becomes a placeholder (the
image itself still comes from the image column). After templating and tokenizing, each image's one pad token
is widened to the number of tokens the checkpoint's image processor gives that image
(:func:`raygym.vision.tokens.expand_image_pads`), which is what the engines and the trainer see.

Limits, per sample and image (each a refused image, never a crash):

- :data:`MAX_IMAGES_PER_SAMPLE` images a sample;
- :data:`MAX_IMAGE_BYTES` encoded bytes an image (checked before a file is read);
- :data:`MAX_IMAGE_PIXELS` decoded pixels an image (checked from the header, before decoding; PIL's
  decompression-bomb guard is turned into the same error).

>>> parse_multimodal_keys('{"image": "images"}')
{'image': 'images'}
>>> image_refs('["a.png", "b.png"]', "row 0")
['a.png', 'b.png']
>>> with_placeholders("How many?", 2, "row 0")
'<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>How many?'
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError
from raygym.vision.images import ImageError, encode_image, open_image, read_image_bytes
from raygym.vision.keys import SUPPORTED_MODALITIES, parse_multimodal_keys  # noqa: F401 (re-exported)
from raygym.vision.qwen_vl import IMAGE_PAD, IMAGE_PLACEHOLDER, is_vision_checkpoint
from raygym.vision.tokens import expand_image_pads, tokens_per_image

if TYPE_CHECKING:
    from PIL import Image

MAX_IMAGES_PER_SAMPLE = 8  # images one sample may carry
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # 20 MiB: encoded bytes of one image
MAX_IMAGE_PIXELS = 40_000_000  # 40 megapixels: decoded pixels of one image
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
TEXT_PART_TYPES = ("text", "input_text")


def image_column(multimodal_keys: Mapping[str, Any] | str | None) -> str | None:
    """The dataset column of images ``multimodal_keys`` names, or None when it names none.

    >>> image_column('{"image": "pics"}'), image_column(None)
    ('pics', None)
    """
    return parse_multimodal_keys(multimodal_keys).get("image")


def data_dir(url: str) -> str:
    """The directory of the data file at ``url`` (a path or fsspec URL): where its relative image paths lie.

    >>> data_dir("memory://sets/rows.jsonl"), data_dir("/data/rows.jsonl")
    ('memory://sets', '/data')
    """
    if "://" in url and not url.startswith("file://"):
        return url.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(url.removeprefix("file://")))


def _join(base: str, ref: str) -> str:
    return base.rstrip("/") + "/" + ref if "://" in base else os.path.join(base, ref)


def _is_url_or_absolute(ref: str) -> bool:
    return "://" in ref or ref.startswith(("/", "~", "data:"))


def _exists(url: str) -> bool:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        return bool(fs.isfile(path))
    except (OSError, ValueError):
        return False


def resolve_image_ref(ref: Any, base_dir: str | None) -> Any:
    """``ref`` with a relative path made relative to ``base_dir`` (the data file's directory); anything else
    (URLs, absolute paths, data URLs, base64, bytes) unchanged. A relative name is a path when it ends in an
    image suffix or names an existing file there; otherwise it is left for base64.

    >>> resolve_image_ref("imgs/a.png", "memory://d"), resolve_image_ref("/x/a.png", "memory://d")
    ('memory://d/imgs/a.png', '/x/a.png')
    """
    if isinstance(ref, Mapping):
        if not ref.get("bytes") and isinstance(ref.get("path"), str):
            return {**ref, "path": resolve_image_ref(ref["path"], base_dir)}
        return ref
    if not isinstance(ref, str) or not base_dir or _is_url_or_absolute(ref):
        return ref
    joined = _join(base_dir, ref)
    if ref.lower().endswith(IMAGE_SUFFIXES) or (len(ref) <= 255 and _exists(joined)):
        return joined
    return ref


def _short(ref: Any) -> str:
    text = repr(ref)
    return text if len(text) <= 80 else text[:77] + "..."


def image_bytes(ref: Any, base_dir: str | None = None, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded bytes of one image reference (see the module docstring), no more than ``max_bytes``: a file's
    size is checked before it is read. ImageError saying which and why."""
    if isinstance(ref, Mapping) and not ref.get("bytes") and isinstance(ref.get("path"), str):
        return image_bytes(ref["path"], base_dir, max_bytes=max_bytes)  # an HF datasets image stored by path
    ref = resolve_image_ref(ref, base_dir)
    if isinstance(ref, str) and not ref.startswith("data:") and (
            _is_url_or_absolute(ref) or ref.lower().endswith(IMAGE_SUFFIXES)):
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(os.path.expanduser(ref))
            size = fs.size(path)
            if size is not None and size > max_bytes:
                raise ImageError(f"{_short(ref)}: {size} bytes is more than the {max_bytes} bytes an image may have")
            with fs.open(path, "rb") as fh:
                data = fh.read()
        except ImageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a filesystem's own errors too (HTTP status, permissions, ...)
            raise ImageError(f"{_short(ref)}: no file at that path or URL, or it cannot be read "
                             f"({type(exc).__name__}: {exc})") from None
    else:
        data = read_image_bytes(ref)
    if len(data) > max_bytes:
        raise ImageError(f"{_short(ref)}: {len(data)} bytes is more than the {max_bytes} bytes an image may have")
    return data


def load_image(ref: Any, base_dir: str | None = None) -> Image.Image:
    """One image reference decoded to RGB within the limits (ImageError saying which and why)."""
    data = image_bytes(ref, base_dir)
    return open_image(data, _short(ref), max_pixels=MAX_IMAGE_PIXELS)


def image_refs(value: Any, where: str) -> list[Any]:
    """The image references a row's image column holds (``[]`` for None), at most :data:`MAX_IMAGES_PER_SAMPLE`.
    ImageError naming ``where`` otherwise.

    >>> image_refs(None, "row 0"), image_refs("a.png", "row 0"), image_refs(b"...", "row 0")
    ([], ['a.png'], [b'...'])
    """
    if value is None:
        return []
    if isinstance(value, str) and value.lstrip().startswith("["):  # parquet: JSON text of a list
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ImageError(f"{where}: looks like JSON text of a list of images but is not valid JSON "
                             f"({exc.msg})") from None
    if isinstance(value, (str, bytes, bytearray, Mapping)):
        refs = [value]
    elif isinstance(value, (list, tuple)):
        refs = list(value)
    else:
        raise ImageError(f"{where}: holds a {type(value).__name__}; an image column holds an image (a path, URL, "
                         "data URL, base64 text, bytes or {'bytes', 'path'}) or a list of them")
    if len(refs) > MAX_IMAGES_PER_SAMPLE:
        raise ImageError(f"{where}: {len(refs)} images, more than the {MAX_IMAGES_PER_SAMPLE} a sample may have")
    return refs


def load_row_images(value: Any, where: str, base_dir: str | None = None) -> list[Image.Image]:
    """Every image of a row's image column, decoded and checked; ImageError naming ``where``, the image's
    number and the reason."""
    images = []
    for k, ref in enumerate(image_refs(value, where)):
        try:
            images.append(load_image(ref, base_dir))
        except ImageError as exc:
            raise ImageError(f"{where}, image {k}: {exc}") from None
    return images


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in IMAGE_PART_TYPES:
        return IMAGE_PLACEHOLDER
    if kind in TEXT_PART_TYPES:
        return str(part.get("text", ""))
    raise ConfigError(f"{where}: a message content part {_short(part)} is neither text nor an image; write parts as "
                      "{'type': 'text', 'text': ...} or {'type': 'image'}")


def flatten_image_parts(prompt: Any, where: str = "prompt") -> Any:
    """A chat prompt with every list-of-parts content turned into text, a placeholder where each image part
    was; a text prompt unchanged.

    >>> flatten_image_parts([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    [{'role': 'user', 'content': '<|vision_start|><|image_pad|><|vision_end|>hi'}]
    """
    if not isinstance(prompt, list):
        return prompt
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            message = {**message, "content": "".join(_part_text(p, where) for p in content)}
        out.append(message)
    return out


def count_placeholders(prompt: Any) -> int:
    """How many images the prompt names: its ``<|image_pad|>`` tokens (and image parts of chat messages).

    >>> count_placeholders("a <|vision_start|><|image_pad|><|vision_end|> b"), count_placeholders("plain")
    (1, 0)
    """
    flat = flatten_image_parts(prompt)
    if isinstance(flat, str):
        return flat.count(IMAGE_PAD)
    return sum(str(m.get("content", "")).count(IMAGE_PAD) for m in flat if isinstance(m, Mapping))


def with_placeholders(prompt: Any, n_images: int, where: str) -> Any:
    """``prompt`` (image parts flattened) naming its ``n_images`` images: unchanged when it has one placeholder
    per image, with one per image prepended when it has none; ConfigError naming ``where`` otherwise."""
    flat = flatten_image_parts(prompt, where)
    found = count_placeholders(flat)
    if found == n_images:
        return flat
    if found:
        raise ConfigError(f"{where}: the prompt has {found} image placeholder(s) but the row has {n_images} image(s); "
                          f"write one {IMAGE_PLACEHOLDER} per image, in image order, or none (then one per image "
                          "is put in front)")
    if isinstance(flat, str):
        return IMAGE_PLACEHOLDER * n_images + flat
    messages = [dict(m) if isinstance(m, Mapping) else m for m in flat]
    target = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"),
                  next((m for m in messages if isinstance(m, dict)), None))
    if target is None:
        raise ConfigError(f"{where}: a chat prompt with images needs a message to put them in")
    target["content"] = IMAGE_PLACEHOLDER * n_images + str(target.get("content") or "")
    return messages


def truncate_image_tokens(tokens: Sequence[int], image_token: int, sizes: Sequence[int],
                          max_len: int) -> tuple[list[int], int] | None:
    """The last ``max_len`` of ``tokens`` and how many leading images that drops whole, or None when the cut
    would split an image (``sizes``: each image's token count, in order).

    >>> truncate_image_tokens([1, 9, 9, 2, 3], 9, [2], 2), truncate_image_tokens([1, 9, 9, 2, 3], 9, [2], 3)
    (([2, 3], 1), None)
    """
    cut = len(tokens) - max_len
    if cut <= 0:
        return list(tokens), 0
    removed = sum(1 for t in tokens[:cut] if t == image_token)
    whole = done = 0
    for size in sizes:
        if done + size > removed:
            break
        done += size
        whole += 1
    return (list(tokens[cut:]), whole) if done == removed else None


def checked_image_token(tokenizer: Any, column: str) -> int:
    """The id of ``<|image_pad|>`` in ``tokenizer``; ConfigError when it has no such token (a text model's)."""
    token = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if token is None or token == getattr(tokenizer, "unk_token_id", None) or \
            tokenizer.convert_ids_to_tokens(int(token)) != IMAGE_PAD:
        raise ConfigError(f"multimodal_keys names the image column {column!r}, but the tokenizer has no {IMAGE_PAD} "
                          "token: images need a vision-language checkpoint (Qwen2-VL family); pass --hf-checkpoint "
                          f"with one such as 'builtin:tiny-qwen2.5-vl', or leave multimodal_keys unset")
    return int(token)


@functools.lru_cache(maxsize=4)
def load_image_processor(model_path: str, name: str | None = None) -> Any:
    """The image processor of the checkpoint at ``model_path`` (a local directory or Hub id; resolve builtin names
    and remote URLs first, e.g. with ``raygym.builtin.resolve_model_path``) via
    ``transformers.AutoImageProcessor``. ConfigError naming ``name`` (default: the path) for a text-only one."""
    name = name or model_path
    if os.path.isfile(os.path.join(model_path, "config.json")) and not is_vision_checkpoint(model_path):
        raise text_only_model(name)
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"hf_checkpoint={name!r}: no image processor to load ({type(exc).__name__}: "
                          f"{exc}); multimodal_keys needs a vision-language checkpoint with its "
                          "preprocessor_config.json") from None


def text_only_model(hf_checkpoint: str, multimodal_keys: Any = None) -> ConfigError:
    """The error for ``multimodal_keys`` with a checkpoint that has no vision tower."""
    keys = f"multimodal_keys={multimodal_keys!r}" if multimodal_keys is not None else "multimodal_keys"
    return ConfigError(f"{keys} needs a vision-language checkpoint (its config.json has a vision_config), but "
                       f"hf_checkpoint={hf_checkpoint!r} is a text-only model; pass --hf-checkpoint with a "
                       f"vision-language model such as 'builtin:tiny-qwen2.5-vl' or Qwen/Qwen2.5-VL-3B-Instruct, or leave "
                       "multimodal_keys unset")


def check_row_images(row: Mapping[str, Any], where: str, *, column: str, input_key: str,
                     base_dir: str | None, load: bool = True) -> int:
    """The up-front check of one row's images: the column is there, it holds at most
    :data:`MAX_IMAGES_PER_SAMPLE` images that the prompt names consistently, and (``load``) each one reads and
    decodes within the limits. Returns the number of images; ConfigError naming ``where``, the column, the image
    and the reason."""
    if column not in row:
        raise ConfigError(f"{where}: no column {column!r} for the images of multimodal_keys (the row has: "
                          f"{', '.join(sorted(map(str, row)))}); point multimodal_keys' \"image\" at the image column")
    at = f"{where}: multimodal_keys column {column!r}"
    try:
        refs = image_refs(row[column], at)
        if input_key in row:
            with_placeholders(row[input_key], len(refs), where)
        if load:
            for k, ref in enumerate(refs):
                try:
                    load_image(ref, base_dir)
                except ImageError as exc:
                    raise ImageError(f"{at}, image {k}: {exc}") from None
    except ImageError as exc:
        raise ConfigError(f"{exc}; fix or remove the image (images are paths relative to the data file, URLs, "
                          "data URLs, base64 or bytes)") from None
    return len(refs)


def _grids_of(processor: Any, images: Sequence[Image.Image]) -> list[tuple[int, int, int]]:
    out = processor(images=list(images))
    grids = out["image_grid_thw"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    grids = grids.tolist() if hasattr(grids, "tolist") else grids
    return [(int(t), int(h), int(w)) for t, h, w in grids]


@dataclass(frozen=True)
class ImagePrompt:
    """A sample's prompt with its images: widened ``tokens``, the images as PNG data URLs, each image's token
    count (``sizes``) and the image token id."""

    tokens: list[int]
    images: list[str]
    sizes: list[int]
    image_token: int


class ImagePrompts:
    """Builds the prompt tokens and images of rows whose ``column`` holds images.

    ``image_processor``: the checkpoint's image processor (``processor(images=[...])["image_grid_thw"]`` and
    ``merge_size``), a local path or Hub id to load it from (:func:`load_image_processor`), or any callable taking
    ``images=[PIL images]`` and giving their ``(t, h, w)`` grids (its ``merge_size`` attribute, else 2).
    """

    def __init__(self, column: str, tokenizer: Any, image_processor: Any, base_dir: str | None = None) -> None:
        if image_processor is None:
            raise ConfigError(f"multimodal_keys names the image column {column!r}, but no image processor was given; "
                              "pass the vision-language checkpoint's (image_processor=<model path>)")
        self.column = column
        self.base_dir = base_dir
        self.processor = load_image_processor(image_processor) if isinstance(image_processor, str) else image_processor
        self.merge = int(getattr(self.processor, "merge_size", None) or 2)
        self.image_token = checked_image_token(tokenizer, column)

    def load(self, row: Mapping[str, Any], where: str) -> list[Image.Image]:
        """The row's images (ConfigError when the column is missing, ImageError when one cannot be used)."""
        if self.column not in row:
            raise ConfigError(f"{where}: no column {self.column!r} for the images of multimodal_keys (keys: "
                              f"{sorted(row)}); point multimodal_keys' \"image\" at the image column")
        return load_row_images(row[self.column], f"{where}: multimodal_keys column {self.column!r}", self.base_dir)

    def build(self, prompt: Any, images: Sequence[Image.Image], render: Callable[[Any], str], tokenizer: Any,
              where: str) -> ImagePrompt:
        """Place the placeholders, render (``render``: prompt -> text), tokenize and widen each image's pad."""
        text = render(with_placeholders(prompt, len(images), where))
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        if not images:
            return ImagePrompt(tokens, [], [], self.image_token)
        grids = _grids_of(self.processor, images)
        try:
            tokens = expand_image_pads(tokens, image_token=self.image_token, grids=grids, merge=self.merge)
        except ValueError as exc:
            raise ConfigError(f"{where}: after templating, {exc} (does the chat template keep the "
                              "placeholders?)") from None
        return ImagePrompt(tokens, [encode_image(im) for im in images],
                           [tokens_per_image(g, self.merge) for g in grids], self.image_token)
