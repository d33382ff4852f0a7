"""``builtin:count-shapes``: a visual task whose answer is only in the image.

Each row's image is a 56x56 black canvas with 1 to 4 filled squares, each in its own quadrant, of random
size, place and bright colour; the prompt is the same for every row (``<image>count:``), so a model that does
not look scores at chance (1 in 4 for the digit). The label is the count. With the tiny VLM's 2x2 patch
merge each image token covers one quadrant, so the count is how many tokens show a square.

The reward reads the response's first character: 1.0 for the count, 0.25 for another digit (so a random model
gets signal), 0 otherwise; what follows it is ignored, so a run's pass@1 is its accuracy.

>>> rows = count_shapes_rows(4, seed=0)
>>> [r["label"] for r in rows], rows[0]["prompt"], rows[0]["images"][0][:22]
(['4', '3', '4', '1'], '<|vision_start|><|image_pad|><|vision_end|>count:', 'data:image/png;base64,')
>>> count_shapes_reward("4", "4"), count_shapes_reward("2", "4")
(1.0, 0.25)
"""

from __future__ import annotations

import random
from typing import Any

from raygym.builtin.tiny_vlm import IMAGE_SIDE
from raygym.vision.images import encode_image
from raygym.vision.qwen_vl import IMAGE_PLACEHOLDER

COUNT_SHAPES_TASK = "builtin:count-shapes"
IMAGE_COLUMN = "images"  # the rows' image column: multimodal_keys='{"image": "images"}'
MAX_SHAPES = 4
PROMPT = IMAGE_PLACEHOLDER + "count:"


def draw_shapes(count: int, rng: random.Random):
    """A 56x56 RGB image with ``count`` filled squares, one in each of ``count`` distinct quadrants."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE))
    draw = ImageDraw.Draw(image)
    half = IMAGE_SIDE // 2
    for quadrant in rng.sample(range(4), count):
        side = rng.randint(10, 20)
        x0 = (quadrant % 2) * half + rng.randint(2, half - side - 2)
        y0 = (quadrant // 2) * half + rng.randint(2, half - side - 2)
        colour = tuple(rng.randint(140, 255) for _ in range(3))
        draw.rectangle([x0, y0, x0 + side, y0 + side], fill=colour)
    return image


def count_shapes_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "label", "images"}``, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        count = rng.randint(1, MAX_SHAPES)
        rows.append({"prompt": PROMPT, "label": str(count), IMAGE_COLUMN: [encode_image(draw_shapes(count, rng))]})
    return rows


def count_shapes_reward(response: str, label: str) -> float:
    """The count's reward (see the module docstring).

    >>> count_shapes_reward(" 3", "3"), count_shapes_reward("3x", "3"), count_shapes_reward("x", "3")
    (1.0, 1.0, 0.0)
    """
    text = response.strip()
    if not text or not text[0].isdigit():
        return 0.0
    return 1.0 if text[0] == str(label).strip() else 0.25
