"""The probe's image item for a vision-language checkpoint (:class:`raygym.weightsync.probe.ImageProbe`).

The image is drawn, not read: four coloured quadrants crossed by a bright diagonal, 56x56 pixels (the smallest
image Qwen2-VL's processors take whole), so every merged patch differs from its neighbours and the tower's every
weight moves the text's log-probs. It is widened to as many pads as the checkpoint's own image processor makes
of it, as the rollouts' images are (:mod:`raygym.vision.dataset`).
"""

from __future__ import annotations

from raygym.vision.images import encode_image
from raygym.vision.qwen_vl import checkpoint_config
from raygym.vision.tokens import tokens_per_image
from raygym.weightsync.probe import ImageProbe, ProbeSpec

SIDE = 56
QUADRANTS = ((200, 40, 40), (40, 180, 60), (50, 60, 210), (230, 210, 40))


def probe_picture():
    """The probe's fixed 56x56 RGB image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE))
    draw = ImageDraw.Draw(image)
    half = SIDE // 2
    for k, colour in enumerate(QUADRANTS):
        x, y = (k % 2) * half, (k // 2) * half
        draw.rectangle([x, y, x + half - 1, y + half - 1], fill=colour)
    draw.line([0, 0, SIDE - 1, SIDE - 1], fill=(255, 255, 255), width=5)
    return image


def image_probe(model_path: str, spec: ProbeSpec | None = None) -> ImageProbe | None:
    """The image item for the local checkpoint at ``model_path``; None for a text model (or one whose config
    names no image placeholder tokens).

    >>> import tempfile
    >>> from raygym.builtin.tiny_vlm import materialize_vlm
    >>> probe = image_probe(materialize_vlm(tempfile.mkdtemp()))
    >>> probe.prefix, len(probe.tokens) - probe.prefix, len(probe.one_pad)
    (5, 49, 51)
    """
    config = checkpoint_config(model_path)
    keys = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    if not config or "vision_config" not in config or any(config.get(key) is None for key in keys):
        return None
    start, pad, end = (int(config[key]) for key in keys)
    from transformers import AutoImageProcessor

    picture = probe_picture()
    grid = AutoImageProcessor.from_pretrained(model_path)(images=[picture])["image_grid_thw"][0]
    pads = tokens_per_image([int(x) for x in grid], int(config["vision_config"].get("spatial_merge_size", 2)))
    text = (spec or ProbeSpec()).sequences()[0]
    widened = (start, *([pad] * pads))
    return ImageProbe(tokens=(*widened, end, *text), prefix=len(widened), one_pad=(start, pad, end, *text),
                      image=encode_image(picture))
