"""What the trainer tests share: a random batch over the builtin tokenizer's characters, trainer
settings sized for the tiny model, and the environment of one rank of a local torch.distributed world."""

from __future__ import annotations

import importlib.util
import os
import random
import socket

import pytest
import torch

from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.trainer import TrainBatch, TrainerSettings
from raygym.types import Sample

VOCAB_LOW, VOCAB_HIGH = 2, 40  # real character ids of the builtin tokenizer


def make_batch(seed: int = 0, groups: int = 2, group_size: int = 4) -> TrainBatch:
    """Random prompts/responses with rewards in [0, 1]; one sample per group has untrained middle tokens
    (a multi-turn-like sample: tokens the policy did not produce)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(3, 8))]
        for j in range(group_size):
            response = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(2, 14))]
            mask = [1] * len(response)
            if j == 1 and len(response) >= 4:
                mask[1:3] = [0, 0]
            samples.append(
                Sample(prompt="p", prompt_tokens=prompt, group_index=g, sample_index=j,
                       response_tokens=response, loss_mask=mask, reward=float(rng.random()))
            )
    return TrainBatch.from_samples(samples)


def trainer_settings(path: str, model: dict | None = None, **recipe_fields) -> TrainerSettings:
    """The trainer's view of a validated config: a ``Recipe`` of ``recipe_fields`` (one trainer rank unless
    they say otherwise) and the model at ``path`` (``model``: more ``ModelConfig`` fields)."""
    recipe = Recipe(**{"actor_num_gpus_per_node": 1, **recipe_fields})
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=path, **(model or {})))
    return TrainerSettings.from_config(cfg)


def settings_for(path: str, model: dict | None = None, **overrides) -> TrainerSettings:
    """Settings for the tiny model: 8 samples per optimizer step, micro-batches of at most 48 tokens."""
    base = dict(lr=1e-3, weight_decay=0.0, global_batch_size=8, max_tokens_per_gpu=48,
                use_dynamic_batch_size=True, clip_grad=1.0, seed=7)
    return trainer_settings(path, model, **{**base, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_world(rank: int, world: int, port: int) -> None:
    """The torchrun environment of ``rank`` (one thread, so two ranks share 2 cores fairly)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)


def save_tiny_model(kind: str, directory) -> str:
    """A tiny Qwen3 (``kind="dense"``: the builtin one) or Qwen3-MoE (``"moe"``: 4 experts, top-2, a dense
    first layer) with the builtin character tokenizer, saved under ``directory/kind``."""
    from pathlib import Path

    from raygym.builtin import build_tiny_model, build_tokenizer

    if kind == "dense":
        model, tok = build_tiny_model(seed=3)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        tok = build_tokenizer()
        config = Qwen3MoeConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        torch.manual_seed(4)
        model = Qwen3MoeForCausalLM(config)
        # Random init of router / norms is near-constant; spread them so routing and norms matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight") or "norm" in name:
                    p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    path = Path(directory) / kind
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def hf_log_probs(model_dir: str, batch: TrainBatch) -> list[torch.Tensor]:
    """Response-token log-probs of ``batch`` under the HF model in ``model_dir`` (one sample at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t, r in zip(batch.tokens, batch.response_lengths, strict=True):
            logits = model(t[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, t[1:, None])[:, 0]
            out.append(lp[-r:])
    return out


def spawn_ranks(script: str, args: list[str], world: int, timeout: float = 600.0) -> list[str]:
    """Run ``python script args`` as ``world`` ranks of a local torch.distributed world (one thread each);
    raise with every rank's output tail when one fails. Returns their outputs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only our own children, by handle
                p.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {i} ---\n{out[-6000:]}" for i, out in enumerate(outputs))
        raise AssertionError(f"ranks {failed} of {script} failed:\n{tails}")
    return outputs


MEGATRON_MISSING = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
# The "megatron" parameter of a test parametrized over backends: marked, and skipped where it cannot run.
MEGATRON = pytest.param("megatron", marks=[
    pytest.mark.megatron,
    pytest.mark.skipif(MEGATRON_MISSING, reason="megatron-core is not installed (pip install 'raygym[megatron]')"),
])
