"""The server's KV cache layer grows in place and holds exactly what transformers' DynamicLayer would."""

from __future__ import annotations

import torch

from raygym.engines.raygym_server.kv_cache import _growing_layer_class, _mergeable, fill_order, new_kv_cache


def kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_updates_grow_in_place_and_equal_concatenation():
    layer = _growing_layer_class()()
    k0, v0 = kv(3, 5, 0)  # a prefill
    keys, _ = layer.update(k0, v0)
    expected_k, expected_v = k0, v0
    for step in range(40):  # decode steps, past the first buffer's headroom
        k, v = kv(3, 1, step + 1)
        keys, values = layer.update(k, v)
        expected_k, expected_v = torch.cat([expected_k, k], -2), torch.cat([expected_v, v], -2)
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert layer.get_seq_length() == 45
    first = keys.data_ptr()
    keys, _ = layer.update(*kv(3, 1, 99))
    assert keys.data_ptr() == first  # written into the buffer, not copied


def test_batch_selection_stays_in_the_buffer_and_replaced_keys_start_a_new_one():
    layer = _growing_layer_class()()
    layer.update(*kv(3, 4, 0))
    before = layer.keys.clone()
    buffer = layer.keys.data_ptr()
    layer.batch_select_indices(torch.tensor([0, 2]))  # rows that finished leave the batch
    k, v = kv(2, 1, 1)
    keys, _ = layer.update(k, v)
    assert torch.equal(keys, torch.cat([before[[0, 2]], k], -2))
    assert keys.data_ptr() == buffer  # compacted in place: no new buffer, no second copy
    layer.keys = torch.cat([layer.keys, layer.keys])  # what the continuous-batching merge does
    layer.values = torch.cat([layer.values, layer.values])
    k, v = kv(4, 1, 2)
    keys, values = layer.update(k, v)
    assert keys.shape == (4, 2, 6, 4) and torch.equal(keys[:, :, -1:], k) and torch.equal(values[:, :, -1:], v)


def test_a_used_cache_can_still_be_merged():
    cache = new_kv_cache()
    for layer_idx in range(2):
        cache.update(*kv(2, 3, layer_idx), layer_idx)
    assert _mergeable(cache)


def test_compaction_in_fill_order_holds_what_a_plain_selection_holds():
    from transformers.cache_utils import DynamicLayer

    growing, plain = _growing_layer_class()(), DynamicLayer()
    k0, v0 = kv(8, 6, 0)
    growing.update(k0, v0)
    plain.update(k0.clone(), v0.clone())
    for step, finished in enumerate([{1, 6}, {0}, {3, 4}, set()]):
        keep = [i for i in range(growing.keys.shape[0]) if i not in finished]
        order = fill_order(keep)
        assert sorted(order) == keep
        index = torch.tensor(order)
        growing.batch_select_indices(index)
        plain.batch_select_indices(index)
        k, v = kv(len(keep), 1, step + 1)
        keys, values = growing.update(k, v)
        expected_k, expected_v = plain.update(k, v)
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert growing.keys.shape[0] == 3
