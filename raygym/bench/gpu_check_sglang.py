"""GPU check of weight sync into stock SGLang: launch ``sglang.launch_server`` on one GPU with a small random
Qwen3 (bf16), then three verified syncs per transport (nccl, disk, ipc; and delta over disk), a trainer-side
HF model on the same GPU taking real AdamW steps in between. Every push is verified as on a real run (the
weight version each engine reports, the probe of log-probs against the trainer) and printed as one JSON line
with its sync metrics. A step that fails prints its error and the next ones still run.

    raygym bench gpu_check_sglang [--model-dir D] [--python PY]     (scripts/gpu_check.sh runs it)

Needs SGLang importable by ``--python`` (default: this interpreter); otherwise it says so and exits 0.
Budget: under 3 minutes on one H200 (SGLang start ~60 s without CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback

import torch

T0 = time.time()


def emit(figure: str, **fields) -> None:
    print(json.dumps({"figure": figure, "elapsed_s": round(time.time() - T0, 1), **fields}), flush=True)


def make_model(path: str) -> None:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from raygym.builtin import TINY_MODEL, materialize_model

    tokenizer_dir = materialize_model(TINY_MODEL, tempfile.mkdtemp(prefix="tok-"), seed=0)
    config = Qwen3Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).bfloat16().save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


class Trainer:
    """Trainer rank 0 in this process on the GPU (fp32 masters), with the methods WeightSync calls."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        from raygym.weightsync.sender import RankWeightSync

        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = model.cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.wsync = RankWeightSync(0)

    def step(self) -> None:
        ids = torch.randint(2, 512, (8, 64), device="cuda")
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def init_weight_sync(self, spec):
        return self.wsync.init(spec)

    def push_weights(self, version, force_full=False, refresh_snapshot=True):
        return self.wsync.push(version, ((n, t.detach()) for n, t in self.model.state_dict().items()), force_full,
                               refresh_snapshot)

    def commit_weights(self, version):
        self.wsync.commit(version)

    def discard_weights(self):
        self.wsync.discard()

    def reconnect_weight_sync(self):
        return self.wsync.reconnect()

    def close_weight_sync(self):
        self.wsync.close()

    def probe_log_probs(self, prompts, responses):
        out = []
        with torch.no_grad():
            for p, r in zip(prompts, responses, strict=True):
                logits = self.model(input_ids=torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1 : -1].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device="cuda")[:, None])
                           .squeeze(-1).tolist())
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default=None)
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args()
    if subprocess.run([a.python, "-c", "import sglang"], capture_output=True).returncode != 0:
        emit("sglang_gpu_check", skipped=f"{a.python} cannot import sglang: install raygym[sglang] there")
        return
    if not torch.cuda.is_available():
        emit("sglang_gpu_check", skipped="no CUDA device")
        return
    from raygym.config import Recipe
    from raygym.engine_api.auth import new_engine_api_key, use_engine_api_key
    from raygym.engines.actor import EngineActor
    from raygym.weightsync.coordinator import WeightSync

    use_engine_api_key(new_engine_api_key())
    model_dir = a.model_dir or tempfile.mkdtemp(prefix="qwen3-small-")
    make_model(model_dir)
    disk = tempfile.mkdtemp(prefix="sync-")
    base = dict(rollout_engine="sglang", rollout_engine_python=a.python, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8, eval_interval=None,
                sglang_mem_fraction_static=0.3, sglang_config={"disable_cuda_graph": True},
                update_weight_disk_dir=disk, update_weight_timeout=120.0)
    engine = EngineActor(Recipe(colocate=True, **base), engine_index=0, model_path=model_dir, gpu_ids=[0],
                         host="127.0.0.1", backend="sglang", startup_timeout=300)
    try:
        start = time.time()
        engine.start()
        emit("sglang_started", seconds=round(time.time() - start, 1), info=engine.engine_info())
        trainer = Trainer(model_dir)
        for transport, mode, colocate in (("nccl", "full", False), ("disk", "full", False), ("ipc", "full", True),
                                          ("disk", "delta", False)):
            try:
                recipe = Recipe(colocate=colocate, update_weight_transport=transport, update_weight_mode=mode, **base)
                sync = WeightSync(recipe, [trainer], [engine.url()], engine_kind="sglang",
                                  spec_overrides={"cast_dtype": "bfloat16", "master_address": "127.0.0.1"})
                sync.setup()
                for version in range(1, 4):
                    trainer.step()
                    metrics = sync.push(version + 10 * len(transport))
                    emit("sglang_sync", transport=transport, mode=mode, version=version,
                         metrics={k: v for k, v in metrics.items() if k.startswith("sync/")})
                sync.shutdown()
            except Exception as exc:
                emit("sglang_sync_failed", transport=transport, mode=mode, error=f"{type(exc).__name__}: {exc}",
                     trace=traceback.format_exc()[-2000:])
    finally:
        engine.close()


if __name__ == "__main__":
    main()
