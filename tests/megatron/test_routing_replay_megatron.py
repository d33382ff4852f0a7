"""Routing replay on the Megatron backend (CPU mode, gloo) agrees with the torch backend's: the same batch with the
same replayed routes gives the same log-probs at tensor parallel 2 and at expert parallel 2, and a train step under
replay at expert parallel 2 (with activation recomputation, which replays again in backward) runs with every
replayed choice counted. (Megatron trains MoE with tensor parallelism only under sequence parallelism, whose
norms need Transformer Engine: a GPU layout, not run here.)

Each layout runs in fresh processes (replay_worker.py) because Megatron's parallel state is process-global.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import megatron_skip_reason, run_ranks

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.timeout(900),
    pytest.mark.skipif(megatron_skip_reason() is not None, reason=str(megatron_skip_reason())),
]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny MoE (4 experts, top-2, a dense first layer), a batch, routes the model would not choose, and the
    torch backend's log-probs with and without them."""
    sys.path.insert(0, str(HERE.parent / "trainer"))
    from test_routing_replay import own_routes, shifted
    from tp_worker import sample_batch
    from trainer_setup import save_tiny_model, settings_for

    from raygym.trainer import TrainBatch
    from raygym.trainer.torch_backend import TorchBackend

    root = tmp_path_factory.mktemp("megatron-replay")
    model = save_tiny_model("moe", root)
    batch = sample_batch(40, seed=1)
    forced = TrainBatch(**{**vars(batch), "routed_experts": shifted(own_routes(model, batch))})
    torch_backend = TorchBackend(settings_for(model, use_rollout_routing_replay=True))
    torch_backend.init()
    path = root / "case.pt"
    torch.save({"batch": batch, "forced": forced, "free_log_probs": torch_backend.compute_log_probs(batch).log_probs,
                "forced_log_probs": torch_backend.compute_log_probs(forced).log_probs}, path)
    return model, path


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_megatron_replays_what_the_torch_backend_replays(case, tmp_path, layout):
    model, path = case
    prefix = tmp_path / "replay"
    args = ["--model", model, "--case", str(path), "--out", str(prefix)]
    args += [a for k, v in layout.items() for a in (f"--{k}", str(v))] + (["--train"] if "ep" in layout else [])
    run_ranks(args, world=2, script=HERE / "replay_worker.py", timeout=600)
    for rank in range(2):
        res = json.loads((tmp_path / f"replay.rank{rank}.json").read_text())
        assert res["facts"].get("tp_size", 1) == layout.get("tp", 1)
        assert res["facts"]["ep_size"] == layout.get("ep", 1)
        assert res["forced_vs_free"] > 1e-3  # the routes matter
        assert res["free_diff"] < 1e-4 and res["forced_diff"] < 1e-4, res
        if "ep" not in layout:
            continue
        metrics = res["train_metrics"]
        assert metrics["train/routing_replay_tokens"] > 0
        assert metrics["train/routing_replay_differ_decision_frac"] == 1.0  # every forced choice was another's
        assert metrics["train/grad_norm"] > 0
