"""``multimodal_keys``, slime's recipe field: which dataset column holds which modality (pure).

raygym reads images only; the field maps ``"image"`` to the column that holds each row's images.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from raygym.errors import ConfigError

SUPPORTED_MODALITIES = ("image",)  # multimodal_keys' modalities raygym reads
MULTIMODAL_EXAMPLE = '\'{"image": "images"}\''


def parse_multimodal_keys(value: Mapping[str, Any] | str | None) -> dict[str, str]:
    """``multimodal_keys`` as ``{modality: column}``: a dict or JSON text; ``None``/``''`` is ``{}``.

    ConfigError naming the value and the fix for anything but a map of ``"image"`` to a column name.

    >>> parse_multimodal_keys({"image": "img"}), parse_multimodal_keys("")
    ({'image': 'img'}, {})
    >>> parse_multimodal_keys({"video": "clips"})
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: multimodal_keys={'video': 'clips'}: modality 'video' is not supported (raygym reads images only); map only "image" to the column that holds the images, e.g. '{"image": "images"}'
    """
    if value is None or value == "":
        return {}
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"multimodal_keys={value!r}: not valid JSON ({exc.msg}); write a JSON object mapping "
                              f"a modality to its dataset column, e.g. {MULTIMODAL_EXAMPLE}") from None
    if not isinstance(parsed, Mapping):
        raise ConfigError(f"multimodal_keys={value!r}: must be a JSON object mapping a modality to its dataset "
                          f"column, e.g. {MULTIMODAL_EXAMPLE}")
    out: dict[str, str] = {}
    for modality, column in parsed.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ConfigError(f"multimodal_keys={value!r}: modality {modality!r} is not supported (raygym reads "
                              "images only); map only \"image\" to the column that holds the images, e.g. "
                              f"{MULTIMODAL_EXAMPLE}")
        if not isinstance(column, str) or not column:
            raise ConfigError(f"multimodal_keys={value!r}: the column of {modality!r} must be a column name (text), "
                              f"not {column!r}; e.g. {MULTIMODAL_EXAMPLE}")
        out[str(modality)] = column
    return out
