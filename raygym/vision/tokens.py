"""Image tokens and M-RoPE positions of a Qwen2-VL-family prompt (pure).

A prompt names each image with one ``<|image_pad|>`` token; :func:`expand_image_pads` widens it to one token
per merged patch (``t * h * w / merge**2`` for a grid ``(t, h, w)`` of 14-pixel patches), which is what the
model, the engines and the trainer all see. :func:`mrope_positions` gives every token its three rotary
positions (temporal, height, width): text tokens share one position that grows by one; an image's tokens
lie on their grid, starting after the text before them; the text after an image starts one past the largest
position so far. Past the prompt, every token's three positions are its index plus :func:`mrope_positions`'
``delta`` (Qwen2-VL's ``rope_deltas``), which is how a decoder continues without the image.

>>> ids = expand_image_pads([5, 9, 6], image_token=9, grids=[(1, 4, 4)], merge=2)
>>> ids
[5, 9, 9, 9, 9, 6]
>>> positions, delta = mrope_positions(ids, image_token=9, grids=[(1, 4, 4)], merge=2)
>>> positions
[[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
>>> delta
-2
"""

from __future__ import annotations

from collections.abc import Sequence

Grid = tuple[int, int, int]


def tokens_per_image(grid: Sequence[int], merge: int) -> int:
    """Image tokens of one image of patch grid ``(t, h, w)``.

    >>> tokens_per_image((1, 4, 6), 2)
    6
    """
    t, h, w = (int(x) for x in grid)
    return t * (h // merge) * (w // merge)


def expand_image_pads(ids: Sequence[int], *, image_token: int, grids: Sequence[Sequence[int]], merge: int) -> list[int]:
    """``ids`` with its k-th image pad token repeated :func:`tokens_per_image` times for ``grids[k]``.

    ValueError when the prompt has not exactly one pad per image.
    """
    pads = sum(1 for t in ids if t == image_token)
    if pads != len(grids):
        raise ValueError(f"the prompt has {pads} image placeholder(s) and the sample {len(grids)} image(s); "
                         "write one placeholder per image")
    out: list[int] = []
    images = iter(grids)
    for token in ids:
        out.extend([token] * tokens_per_image(next(images), merge) if token == image_token else [token])
    return out


def count_images(ids: Sequence[int], *, image_token: int, grids: Sequence[Sequence[int]], merge: int) -> int:
    """How many of ``grids`` the expanded ``ids`` hold whole (a prompt cut short keeps only whole images).

    ValueError when the image tokens do not end on an image's boundary.
    """
    remaining = sum(1 for t in ids if t == image_token)
    whole = 0
    for grid in grids:
        need = tokens_per_image(grid, merge)
        if remaining < need:
            break
        remaining -= need
        whole += 1
    if remaining:
        raise ValueError(f"{remaining} image token(s) left over after {whole} whole image(s)")
    return whole


def mrope_positions(ids: Sequence[int], *, image_token: int, grids: Sequence[Sequence[int]],
                    merge: int) -> tuple[list[list[int]], int]:
    """The three position rows (temporal, height, width) of the expanded ``ids``, and the decode delta.

    Images are matched to runs of image tokens in order, ``tokens_per_image`` tokens each; a still image's
    temporal positions all equal its start (Qwen2.5-VL scales time by seconds per grid, zero for images). Image
    tokens after the last image (a response that sampled the token) are text.

    >>> mrope_positions([9, 9, 9, 9, 5, 9], image_token=9, grids=[(1, 4, 4)], merge=2)[0][0]
    [0, 0, 0, 0, 2, 3]
    """
    rows: list[list[int]] = [[], [], []]
    next_pos = 0
    images = list(grids)
    used = 0
    i = 0
    while i < len(ids):
        if ids[i] != image_token or used == len(images):  # past the last image, an image token is a sampled token
            for row in rows:
                row.append(next_pos)
            next_pos += 1
            i += 1
            continue
        t, h, w = (int(x) for x in images[used])
        used += 1
        gh, gw = h // merge, w // merge
        for _ in range(t):
            for hi in range(gh):
                for wi in range(gw):
                    rows[0].append(next_pos)  # still images: time does not advance
                    rows[1].append(next_pos + hi)
                    rows[2].append(next_pos + wi)
        i += t * gh * gw
        next_pos += max(1, gh, gw)
    longest = max((max(row) for row in rows if row), default=-1)
    return rows, longest + 1 - len(ids)
