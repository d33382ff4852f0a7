"""raygym.vision.tokens against transformers' own Qwen2.5-VL ``get_rope_index``: the same three position rows and
decode delta for prompts with several images of different grids between text."""

from __future__ import annotations

import pytest
import torch

from raygym.builtin.tiny_vlm import build_tiny_vlm
from raygym.vision.qwen_vl import VISION_END, VISION_START, image_token_id
from raygym.vision.tokens import expand_image_pads, mrope_positions


@pytest.mark.parametrize("grids", [[(1, 4, 4)], [(1, 4, 6), (1, 4, 4), (1, 6, 2)], [(1, 8, 2), (1, 2, 8)]])
def test_positions_and_delta_are_transformers_own(grids):
    model, tok = build_tiny_vlm(0)
    pad, start, end = image_token_id(tok), tok.convert_tokens_to_ids(VISION_START), tok.convert_tokens_to_ids(VISION_END)
    prompt = [5, 6]
    for k in range(len(grids)):
        prompt += [start, pad, end, 7 + k]
    ids = expand_image_pads(prompt + [8, 9], image_token=pad, grids=grids, merge=2)
    mine, delta = mrope_positions(ids, image_token=pad, grids=grids, merge=2)
    x = torch.tensor([ids])
    theirs, deltas = model.model.get_rope_index(x, (x == pad).int(), torch.tensor(grids),
                                                attention_mask=torch.ones_like(x))
    assert theirs[:, 0].tolist() == mine and deltas.flatten().tolist() == [delta]
