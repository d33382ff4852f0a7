"""Images on raygym's vLLM adapter: raygym's widened prompts in vLLM's form, and vLLM's Qwen2-VL processor without
torchvision.

raygym's ``/generate`` contract (:class:`raygym.engine_api.protocol.GenerateRequest`): ``input_ids`` arrive
widened, each image ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` with N its merged patches
(:func:`raygym.vision.tokens.expand_image_pads`), and ``image_data`` holds the prompt's images. vLLM (0.32) takes
``TokensPrompt(prompt_token_ids=..., multi_modal_data={"image": [PIL images]})`` with ONE pad per image: its
multimodal processor always applies the model's prompt updates, and Qwen2-VL's (``PromptReplacement`` of
``[<|image_pad|>]`` by N pads, ``vllm/model_executor/models/qwen2_vl.py``) would widen an already widened run
again. So :meth:`VllmVision.prompt` checks the pad count against the images (N from the checkpoint's image
processor, as vLLM computes it) and collapses each image's run to one pad (:func:`collapse_image_pads`); vLLM
widens it back to the same ids, which the adapter checks against the request's before it answers, so
``prompt_tokens`` and every log-prob are of the request's own tokens.

torchvision: vLLM 0.32's Qwen2-VL family needs it with transformers 5 in two places. Its model module imports
``smart_resize`` from transformers' ``image_processing_qwen2_vl`` (transformers 5's torchvision image processor),
and the ``Qwen2_5_VLProcessor`` it builds loads a video processor (transformers' needs torchvision). vLLM's CPU
build runs a CPU torch, beside which the torchvision wheels pip can get (CUDA builds) do not load (``operator
torchvision::nms does not exist``; CPU builds are on PyTorch's own index only), and raygym's install script removes
them. Images need neither: :func:`install_torchvision_stand_ins` gives that module name the PIL flavour (the same
``smart_resize``, the image processor such a checkpoint loads anyway) and the processor an
:class:`ImagesOnlyVideoProcessor` (videos are refused; the adapter launches vLLM with ``limit_mm_per_prompt``
``{"video": 0}``, :func:`vision_engine_args`), in the adapter and in every process vLLM spawns
(:data:`STAND_INS_ENV`), and vLLM inspects the model class in the adapter's process (:func:`inspect_in_process`).
Nothing of it happens where torchvision imports, nor for a text-only checkpoint. A tokenizer without
``<|video_pad|>`` (the builtin tiny Qwen2.5-VL's) gets a copy naming its video token
(:func:`tokenizer_with_video_token`): vLLM looks that token up for every request with images.

>>> collapse_image_pads([5, 8, 9, 9, 9, 9, 7, 6], image_token=9, per_image=[4])
[5, 8, 9, 7, 6]
>>> collapse_image_pads([9, 9, 9, 9, 9, 9], image_token=9, per_image=[4, 2])
[9, 9]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from raygym.vision.qwen_vl import checkpoint_config

# The model families whose prompt updates widen one pad per image (as raygym's server, which runs these).
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class ImageInputError(ValueError):
    """Images a request cannot be served with (HTTP 400 with this message)."""


def collapse_image_pads(ids: Sequence[int], *, image_token: int, per_image: Sequence[int]) -> list[int]:
    """``ids`` with the k-th image's ``per_image[k]`` consecutive pad tokens made one (the inverse of
    :func:`raygym.vision.tokens.expand_image_pads`). ImageInputError when the pads are not exactly one unbroken
    run of each image's count, in order.

    >>> collapse_image_pads([9, 9, 5, 9, 9], image_token=9, per_image=[4])
    Traceback (most recent call last):
    ...
    raygym.engines.vllm.vision.ImageInputError: the prompt's image tokens (<|image_pad|>, id 9) are not one unbroken run of 4 per image, in order: image 0's run at token 0 ends after 2
    """
    have, need = sum(1 for t in ids if t == image_token), sum(per_image)
    if have != need:
        raise ImageInputError(
            f"the prompt has {have} image token(s) (<|image_pad|>, id {image_token}) but its {len(per_image)} "
            f"image(s) need {need} ({' + '.join(map(str, per_image)) or '0'}: one per merged patch of each image); "
            "expand each image's pad with raygym.vision.tokens.expand_image_pads")
    out: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            out.append(ids[i])
            i += 1
            continue
        n = per_image[k]
        run = next((j for j in range(i, i + n) if j >= len(ids) or ids[j] != image_token), i + n) - i
        if run != n:
            counts = ", ".join(map(str, per_image))
            raise ImageInputError(f"the prompt's image tokens (<|image_pad|>, id {image_token}) are not one unbroken "
                                  f"run of {counts} per image, in order: image {k}'s run at token {i} ends after {run}")
        out.append(image_token)
        i += n
        k += 1
    return out


class VllmVision:
    """What the adapter knows of a vision-language checkpoint: its image token, merge size and image processor
    (``unsupported``: why it takes no images, for a vision-language model of another family)."""

    def __init__(self, *, image_token_id: int, merge_size: int, image_processor: Any, model_path: str,
                 unsupported: str | None = None) -> None:
        self.image_token_id = int(image_token_id)
        self.merge_size = int(merge_size)
        self.image_processor = image_processor
        self.model_path = model_path
        self.unsupported = unsupported

    @classmethod
    def from_checkpoint(cls, model_path: str) -> VllmVision | None:
        """The checkpoint's support (None for a text-only one: its config has no ``vision_config``)."""
        config = checkpoint_config(model_path)
        if config is None or "vision_config" not in config:
            return None
        kind, token = config.get("model_type"), config.get("image_token_id")
        merge = int(config["vision_config"].get("spatial_merge_size", 2))
        if kind not in SUPPORTED_MODEL_TYPES or token is None:
            return cls(image_token_id=-1, merge_size=merge, image_processor=None, model_path=model_path,
                       unsupported=f"the model {model_path} (model_type {kind!r}) is a vision-language model raygym's "
                                   f"vLLM adapter does not run images for; it runs those of model_type "
                                   f"{list(SUPPORTED_MODEL_TYPES)}")
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            return cls(image_token_id=int(token), merge_size=merge, image_processor=None, model_path=model_path,
                       unsupported=f"{model_path}: no image processor could be loaded ({type(exc).__name__}: {exc})")
        return cls(image_token_id=int(token), merge_size=merge, image_processor=processor, model_path=model_path)

    def tokens_per_image(self, image: Any) -> int:
        """Image tokens of one PIL image: its merged patches after the processor's resize (vLLM's count)."""
        width, height = image.size
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // self.merge_size ** 2

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[Any]]:
        """``(prompt ids in vLLM's form, PIL images)`` of a widened prompt and its ``images`` (data URLs, paths, ...);
        without images, a prompt that holds image tokens is refused (their pixels would be missing)."""
        if not images:
            have = sum(1 for t in ids if t == self.image_token_id)
            if have:
                raise ImageInputError(f"the prompt has {have} image token(s) (<|image_pad|>, id {self.image_token_id}) "
                                      "but no image_data; send its images in image_data")
            return list(ids), []
        if self.unsupported is not None:
            raise ImageInputError(f"image_data: {self.unsupported}")
        pil = [decode(image, k) for k, image in enumerate(images)]
        per_image = [self.tokens_per_image(image) for image in pil]
        return collapse_image_pads(ids, image_token=self.image_token_id, per_image=per_image), pil


def vllm_prompts(vision: VllmVision | None, model_path: str, jobs: Sequence[Any]) -> list[dict[str, Any]]:
    """vLLM's prompt (``TokensPrompt``'s fields) of each of ``jobs``
    (:class:`raygym.engines.serving.generate_route.SampleJob`): the ids as sent for a text prompt, one pad per image
    and ``multi_modal_data`` for one with images (made once per prompt, shared by its samples). ImageInputError
    says why a request cannot be served: images for a text-only model, an unreadable image, a pad count that
    does not match its images, image tokens without images."""
    out: list[dict[str, Any]] = []
    for job in jobs:
        if job.sample > 0 and out:  # a prompt's samples follow its first
            out.append(out[-1])
            continue
        images = list(job.images)
        if vision is None:
            if images:
                raise ImageInputError(f"image_data: the model {model_path} is a text-only model (its config has no "
                                      "vision_config); send no images")
            out.append({"prompt_token_ids": list(job.prompt)})
            continue
        ids, pil = vision.prompt(job.prompt, images)
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": pil}} if pil else {"prompt_token_ids": ids})
    return out


def check_widened(served: Sequence[int] | None, sent: Sequence[int]) -> None:
    """RuntimeError unless vLLM widened a prompt with images back to the ids the request sent (so its
    ``prompt_tokens`` and log-probs are of the request's tokens)."""
    if served is not None and list(served) != list(sent):
        raise RuntimeError(f"vLLM widened the prompt's images to {len(served)} tokens, the request sent {len(sent)}: "
                           "vLLM's image processor sizes the images differently from the checkpoint's "
                           "preprocessor_config.json (mm_processor_kwargs in --engine-args?)")


def decode(image: Any, index: int) -> Any:
    """The RGB PIL image of one ``image_data`` entry (ImageInputError naming it when it cannot be read)."""
    from raygym.vision.images import ImageError, decode_image

    try:
        return decode_image(image)
    except ImageError as exc:
        raise ImageInputError(f"image_data: image {index}: {exc}") from None


def vision_engine_args(model_path: str, user_args: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments for a vision checkpoint, under the user's (which win): no videos (raygym sends
    images only, and without torchvision no video processor runs; vLLM would otherwise profile video inputs).

    >>> vision_engine_args("/nowhere", {})
    {}
    """
    config = checkpoint_config(model_path)
    if config is None or "vision_config" not in config:
        return dict(user_args)
    return {"limit_mm_per_prompt": {"video": 0}, **user_args}


VIDEO_PAD = "<|video_pad|>"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def tokenizer_with_video_token(model_path: str, directory: str | None = None) -> str | None:
    """A tokenizer directory for vLLM when the vision checkpoint's tokenizer has no ``<|video_pad|>`` token (None
    when it has one, or for a text model). transformers' Qwen2-VL processors name the video token
    ``tokenizer.video_token`` or ``<|video_pad|>``, and vLLM looks its id up in the vocabulary for every request
    with images; raygym's builtin tiny Qwen2.5-VL has no such token (its config's ``video_token_id`` is its image
    pad). The copy (the checkpoint's files but its weights) names the token of the config's ``video_token_id``
    as ``video_token`` in ``tokenizer_config.json``'s ``extra_special_tokens``; every id stays the same
    (``directory``: where, default a new temporary directory)."""
    import json
    import shutil
    from pathlib import Path

    config = checkpoint_config(model_path)
    if config is None or "vision_config" not in config or config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if hasattr(tokenizer, "video_token") or VIDEO_PAD in tokenizer.get_vocab():
        return None
    video_id = config.get("video_token_id", config.get("image_token_id"))
    video = tokenizer.convert_ids_to_tokens(int(video_id)) if video_id is not None else None
    source = Path(model_path)
    if not video or not (source / "tokenizer_config.json").is_file():
        return None
    import tempfile

    target = Path(directory or tempfile.mkdtemp(prefix="raygym-vlm-tokenizer-"))
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != "model.safetensors.index.json":
            shutil.copy2(path, target / path.name)
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    extra = tok_config.get("extra_special_tokens") or {}
    if isinstance(extra, list):  # unnamed special tokens: named, so the dict keeps them special
        extra = {f"extra_special_token_{i}": token for i, token in enumerate(extra)}
    tok_config["extra_special_tokens"] = {**extra, "video_token": video}
    (target / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return str(target)


def install_torchvision_stand_ins() -> bool:
    """Where torchvision does not import, let vLLM's Qwen2-VL family load with transformers 5 (once per process;
    True when installed; nothing changes where torchvision imports):

    - vLLM's ``qwen2_vl`` model module imports ``smart_resize`` from transformers'
      ``models.qwen2_vl.image_processing_qwen2_vl``, which transformers 5 made its torchvision image processor; the
      same function lives in the PIL flavour (``image_processing_pil_qwen2_vl``, what such a checkpoint's
      ``AutoImageProcessor`` loads without torchvision), so that module name is given the PIL flavour's contents;
    - transformers loads each part of a processor through its auto class (``MODALITY_TO_AUTOPROCESSOR_MAPPING`` in
      ``transformers.processing_utils``); without torchvision ``AutoVideoProcessor`` is a stand-in that raises, so
      the video entry is pointed at :class:`StandInAutoVideoProcessor`, and ``transformers.VideoProcessorMixin``
      (the class a processor checks its video part against, exported only with torchvision) is exported.

    Called by the adapter before vLLM reads the model (:func:`prepare_vision`), which then sets
    :data:`STAND_INS_ENV` for vLLM's engine-core and worker processes: on CPU vLLM spawns them, and they import the
    adapter's module (their ``__mp_main__``) and :mod:`raygym.engines.vllm.weights`, which call
    :func:`install_stand_ins_from_env`."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return False
    import transformers
    from transformers import processing_utils, video_processing_utils

    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    names = getattr(mapping, "_MAPPING_NAMES", None)
    if not isinstance(names, dict) or "video_processor" not in names:
        return False  # another transformers: its own error says what is missing
    _alias_pil_image_processing()
    # transformers' processing_utils imports a second instance of the package as its transformers_module
    for module in {id(m): m for m in (transformers, sys.modules.get("transformers"),
                                      getattr(processing_utils, "transformers_module", None)) if m is not None}.values():
        if "VideoProcessorMixin" not in vars(module):
            module.__dict__["VideoProcessorMixin"] = video_processing_utils.VideoProcessorMixin
    mapping._MAPPING_NAMES = {**names, "video_processor": (__name__, "StandInAutoVideoProcessor")}
    return True


STAND_INS_ENV = "RAYGYM_VLLM_TORCHVISION_STAND_INS"


def install_stand_ins_from_env() -> None:
    """:func:`install_torchvision_stand_ins` in a process vLLM started for an adapter that installed them (nothing,
    not even an import, otherwise)."""
    if os.environ.get(STAND_INS_ENV) == "1":
        install_torchvision_stand_ins()


TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def _alias_pil_image_processing() -> None:
    """:data:`TORCHVISION_IMAGE_MODULE` as the PIL flavour's contents (its processor under both names), unless it
    imports."""
    import importlib
    import types

    if TORCHVISION_IMAGE_MODULE in sys.modules:
        return
    try:
        importlib.import_module(TORCHVISION_IMAGE_MODULE)
        return
    except ImportError:
        pass
    pil = importlib.import_module(PIL_IMAGE_MODULE)
    alias = types.ModuleType(TORCHVISION_IMAGE_MODULE, f"{PIL_IMAGE_MODULE} under its torchvision flavour's name "
                                                      "(raygym.engines.vllm.vision: no torchvision in this process)")
    alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    alias.__all__ = ["Qwen2VLImageProcessor"]  # type: ignore[attr-defined]
    sys.modules[TORCHVISION_IMAGE_MODULE] = alias


class StandInAutoVideoProcessor:
    """``AutoVideoProcessor`` where torchvision is missing: every checkpoint's video processor is
    :class:`ImagesOnlyVideoProcessor` (see :func:`install_torchvision_stand_ins`)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        return _stand_in_class().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


_STAND_IN: list[Any] = []


def _stand_in_class() -> Any:
    """:class:`ImagesOnlyVideoProcessor`, made on first use (it subclasses a transformers class)."""
    if not _STAND_IN:
        from transformers.video_processing_utils import VideoProcessorMixin

        class ImagesOnlyVideoProcessor(VideoProcessorMixin):
            """A video processor that refuses videos: what a Qwen2-VL processor holds where torchvision is missing
            (its image half works without it). It keeps the checkpoint's patch and merge sizes."""

            def preprocess(self, videos: Any, **kwargs: Any) -> Any:
                raise ValueError("videos: this process has no torchvision, which transformers' video processor "
                                 "needs; raygym's vLLM adapter takes images only")

        _STAND_IN.append(ImagesOnlyVideoProcessor)
    return _STAND_IN[0]


def __getattr__(name: str) -> Any:
    if name == "ImagesOnlyVideoProcessor":
        return _stand_in_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def inspect_in_process(architectures: Sequence[str]) -> None:
    """Have vLLM inspect these model classes in this process. vLLM inspects a model class in a fresh interpreter
    (``python -m vllm.model_executor.models.registry``), where :func:`install_torchvision_stand_ins` has not run;
    registered as classes (imported here, after it ran) they are inspected where they were imported."""
    from vllm import ModelRegistry

    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if entry is not None and hasattr(entry, "load_model_cls"):
            ModelRegistry.register_model(arch, entry.load_model_cls())


def prepare_vision(model_path: str, engine_args: dict[str, Any]) -> tuple[VllmVision | None, str, dict[str, Any]]:
    """What the adapter sets up before vLLM reads a checkpoint: ``(its image support or None, the tokenizer path
    for vLLM, the engine arguments)``. For a vision checkpoint: the torchvision stand-ins where torchvision is
    missing (:func:`install_torchvision_stand_ins`, with the model classes inspected here,
    :func:`inspect_in_process`), a tokenizer that names the video token (:func:`tokenizer_with_video_token`) and
    no video inputs (:func:`vision_engine_args`)."""
    vision = VllmVision.from_checkpoint(model_path)
    if vision is None or vision.unsupported is not None and vision.image_token_id < 0:
        return vision, model_path, dict(engine_args)
    if install_torchvision_stand_ins():
        os.environ[STAND_INS_ENV] = "1"  # for the processes vLLM spawns
        inspect_in_process((checkpoint_config(model_path) or {}).get("architectures") or [])
    tokenizer = tokenizer_with_video_token(model_path)
    return vision, tokenizer or model_path, vision_engine_args(model_path, engine_args)
