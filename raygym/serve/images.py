"""Images in chat requests to ``raygym serve`` (a vision-language checkpoint, e.g. ``builtin:tiny-qwen2.5-vl``).

An OpenAI image content part, ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, is
served only as a **data URL**: the server never fetches an image (an ``http(s)://``, ``file://`` or bare path
URL is a 400), so it cannot be used to reach hosts or files the client cannot. Each image is decoded within
raygym's dataset limits (:data:`~raygym.vision.dataset.MAX_IMAGES_PER_SAMPLE` a request,
:data:`~raygym.vision.dataset.MAX_IMAGE_BYTES` encoded bytes and :data:`~raygym.vision.dataset.MAX_IMAGE_PIXELS`
pixels an image), then the prompt is built as the training run builds one
(:class:`raygym.vision.dataset.ImagePrompts`): each image part becomes one placeholder
(``<|vision_start|><|image_pad|><|vision_end|>``) in order, the chat template renders the messages, and each
image's pad is widened to the tokens the checkpoint's image processor gives it. The engine gets those
``input_ids`` and the images re-encoded as PNG data URLs (``image_data``, the one form raygym passes on).

>>> parse_data_url("data:image/png;base64,iVBORw0KGgo=", "image 0")
b'\\x89PNG\\r\\n\\x1a\\n'
>>> parse_data_url("https://example.com/cat.png", "image 0")
Traceback (most recent call last):
...
raygym.serve.images.ImageRefused: image 0: only data URLs are served (data:image/png;base64,...); this server does not fetch images from http(s), file or other URLs
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError
from raygym.serve.protocol import ImagePart
from raygym.vision.dataset import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_SAMPLE,
    ImagePrompts,
    load_image_processor,
)
from raygym.vision.images import ImageError, open_image
from raygym.vision.qwen_vl import IMAGE_PAD, is_vision_checkpoint

if TYPE_CHECKING:
    from PIL import Image

    from raygym.serve.protocol import ChatMessage


class ImageRefused(ValueError):
    """An image part (or a request's images) the server will not use: the message says which and why."""


def parse_data_url(url: str, where: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded bytes of the base64 data URL ``url`` (``data:image/<type>;base64,<payload>``), at most
    ``max_bytes`` (checked before decoding). Anything else, including every URL that would have to be fetched,
    is refused: nothing is read from a network or a file."""
    if url[:5].lower() != "data:":
        raise ImageRefused(f"{where}: only data URLs are served (data:image/png;base64,...); this server does not "
                           "fetch images from http(s), file or other URLs")
    head, comma, payload = url[5:].partition(",")
    params = [p.strip().lower() for p in head.split(";")]
    if not comma or "base64" not in params[1:] or not params[0].startswith("image/"):
        raise ImageRefused(f"{where}: a data URL of an image must read data:image/<type>;base64,<data> "
                           f"(got {head[:60]!r})")
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise ImageRefused(f"{where}: about {len(payload) * 3 // 4} bytes is more than the {max_bytes} bytes an "
                           "image may have")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefused(f"{where}: the data URL is not valid base64 ({exc})") from None
    if len(data) > max_bytes:
        raise ImageRefused(f"{where}: {len(data)} bytes is more than the {max_bytes} bytes an image may have")
    return data


def decode_part(url: str, where: str) -> Image.Image:
    """The RGB image of one image part's data URL, within the byte and pixel limits (:class:`ImageRefused`)."""
    data = parse_data_url(url, where)
    try:
        return open_image(data, where, max_pixels=MAX_IMAGE_PIXELS)
    except ImageError as exc:
        raise ImageRefused(str(exc)) from None


@dataclass(frozen=True)
class ChatImagePrompt:
    """A chat request's prompt with its images: widened ``tokens`` and the images as PNG data URLs."""

    tokens: list[int]
    images: list[str]


class ChatImages:
    """Builds the prompts of chat requests with images for a vision-language model.

    Args:
        tokenizer: the model's tokenizer (it has ``<|image_pad|>``).
        image_processor: the checkpoint's image processor (``processor(images=[...])["image_grid_thw"]``,
            ``merge_size``), or its directory.
    """

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.prompts = ImagePrompts("image_url", tokenizer, image_processor)

    @classmethod
    def for_checkpoint(cls, model_dir: str, tokenizer: Any, model_name: str | None = None) -> ChatImages | None:
        """The images of the checkpoint at ``model_dir``; None for a text-only one (no ``vision_config``)."""
        if not is_vision_checkpoint(model_dir):
            return None
        return cls(tokenizer, load_image_processor(model_dir, model_name))

    def decode(self, messages: Sequence[ChatMessage]) -> list[Image.Image]:
        """Every image part of ``messages``, in order, decoded and checked (:class:`ImageRefused` naming the part);
        text that holds the image token itself is refused too (each image is an image part)."""
        where = [(i, j, part) for i, m in enumerate(messages) if isinstance(m.content, list)
                 for j, part in enumerate(m.content) if isinstance(part, ImagePart)]
        if len(where) > MAX_IMAGES_PER_SAMPLE:
            raise ImageRefused(f"{len(where)} images, more than the {MAX_IMAGES_PER_SAMPLE} a request may have")
        for i, m in enumerate(messages):
            if IMAGE_PAD in m.text():
                raise ImageRefused(f"messages[{i}]: the text holds {IMAGE_PAD}; send each image as an image_url "
                                   "content part, not as its token")
        return [decode_part(part.url, f"messages[{i}].content[{j}].image_url") for i, j, part in where]

    def build(self, messages: Sequence[ChatMessage], render: Any) -> ChatImagePrompt:
        """Decode the images, put one placeholder per image part, render (``render``: messages -> text), tokenize
        and widen each image's pad (CPU work: run it off the event loop)."""
        images = self.decode(messages)
        chat = [{"role": m.role,
                 "content": [part.model_dump() for part in m.content] if isinstance(m.content, list) else m.text(),
                 **({"name": m.name} if m.name else {})} for m in messages]
        try:
            built = self.prompts.build(chat, images, render, self.tokenizer, "messages")
        except ConfigError as exc:
            raise ImageRefused(str(exc)) from None
        return ChatImagePrompt(built.tokens, built.images)


__all__ = ["ChatImagePrompt", "ChatImages", "ImageRefused", "decode_part", "parse_data_url"]
