"""Images as raygym carries them: decoded from what datasets and clients hold, sent as PNG data URLs.

An image in a dataset row, a ``/generate`` request's ``image_data`` or an OpenAI content part may be a path
or fsspec URL, ``data:image/...;base64,...``, bare base64, raw bytes, or a Hugging Face datasets image
(``{"bytes": ..., "path": ...}``). :func:`decode_image` reads any of them into an RGB ``PIL.Image``;
:func:`encode_image` writes the one form raygym passes between its parts (a PNG data URL: self-contained,
JSON-safe, what SGLang's ``image_data`` takes).

>>> from PIL import Image
>>> url = encode_image(Image.new("RGB", (3, 2), (255, 0, 0)))
>>> url[:22], decode_image(url).size, decode_image(url).getpixel((0, 0))
('data:image/png;base64,', (3, 2), (255, 0, 0))
>>> decode_image("no-such-file.png")
Traceback (most recent call last):
...
raygym.vision.images.ImageError: 'no-such-file.png': no file at that path or URL, and not base64 image data
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

DATA_URL_PREFIX = "data:image/png;base64,"


class ImageError(ValueError):
    """An image that cannot be read: the message says which and why."""


def _short(ref: Any) -> str:
    text = repr(ref)
    return text if len(text) <= 80 else text[:77] + "..."


def _open(data: bytes, what: str) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ImageError(f"{what}: not a readable image ({type(exc).__name__}: {exc})") from exc
    return image.convert("RGB")


def read_image_bytes(ref: str | bytes | Mapping[str, Any]) -> bytes:
    """The encoded bytes ``ref`` names, without decoding them (ImageError when there are none)."""
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if isinstance(ref, Mapping):
        if ref.get("bytes"):
            return bytes(ref["bytes"])
        if ref.get("path"):
            return read_image_bytes(str(ref["path"]))
        raise ImageError(f"{_short(ref)}: an image dict needs 'bytes' or 'path'")
    if not isinstance(ref, str):
        raise ImageError(f"{_short(ref)}: an image is a path, URL, base64 text or bytes, not {type(ref).__name__}")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if ";base64" not in head:
            raise ImageError(f"{_short(ref)}: a data URL must be base64 ('data:image/png;base64,...')")
        return _b64(payload, ref)
    if "://" in ref or ref.startswith("/") or ref.endswith((".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp")):
        import fsspec

        try:
            with fsspec.open(ref, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, PermissionError, OSError) as exc:
            if ref.startswith("/") or "://" in ref:
                raise ImageError(f"{_short(ref)}: no file at that path or URL ({type(exc).__name__})") from exc
    try:
        return _b64(ref, ref)
    except ImageError:
        raise ImageError(f"{_short(ref)}: no file at that path or URL, and not base64 image data") from None


def _b64(payload: str, ref: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{_short(ref)}: not valid base64 ({exc})") from exc


def decode_image(ref: str | bytes | Mapping[str, Any]) -> Image.Image:
    """The RGB image ``ref`` holds or names (ImageError saying why when it cannot be read)."""
    return _open(read_image_bytes(ref), _short(ref))


def encode_image(image: Image.Image) -> str:
    """``image`` as a PNG data URL, the form raygym sends between its parts."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return DATA_URL_PREFIX + base64.b64encode(buffer.getvalue()).decode()


def open_image(data: bytes, what: str, *, max_pixels: int | None = None) -> Image.Image:
    """The RGB image the encoded ``data`` holds, refused (ImageError naming ``what``) when it is not a readable
    image or, with ``max_pixels``, when it decodes to more pixels than that. The size is read from the header
    before any pixel is decoded, and PIL's own decompression-bomb guard becomes the same ImageError.

    >>> import io
    >>> from PIL import Image
    >>> buffer = io.BytesIO(); Image.new("RGB", (40, 30)).save(buffer, format="PNG")
    >>> open_image(buffer.getvalue(), "a.png").size
    (40, 30)
    >>> open_image(buffer.getvalue(), "a.png", max_pixels=1000)
    Traceback (most recent call last):
    ...
    raygym.vision.images.ImageError: a.png: 40x30 pixels (1200) is more than the 1000 pixels an image may have
    """
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(f"{what}: {width}x{height} pixels ({width * height}) is more than the {max_pixels} "
                                 "pixels an image may have")
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"{what}: too many pixels to decode ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file raises OSError, ValueError, struct.error, ...
        raise ImageError(f"{what}: not a readable image ({type(exc).__name__}: {exc})") from None
