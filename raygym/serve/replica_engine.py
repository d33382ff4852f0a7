"""The engine behind one OpenAI front (a Ray Serve replica's or the one-box server's): its recipe from the run's
engine fields, a LoRA adapter served beside the base weights, the check that it can run here, and
:func:`start_engine_front`, which starts it and builds the front."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from raygym.config import Recipe
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.serve.settings import ServeSettings


def _context_len(model_dir: str) -> int | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


ENGINE_RECIPE_FIELDS = ("seed", "rollout_engine_python", "rollout_num_gpus", "rollout_num_gpus_per_engine", "rollout_max_prompt_len",
                        "rollout_max_response_len", "update_weight_timeout")


def engine_recipe(engine_settings: dict[str, Any]) -> Recipe:
    """The validated :class:`~raygym.config.Recipe` a replica's engine starts from: the run's engine fields
    (``sglang_*`` and :data:`ENGINE_RECIPE_FIELDS`) over the defaults; the training fields are left out.

    >>> engine_recipe({"sglang_max_running_requests": 32, "lr": 1.0}).sglang_max_running_requests
    32
    """
    chosen = {name: value for name, value in engine_settings.items()
              if name in Recipe.model_fields and (name.startswith("sglang_") or name in ENGINE_RECIPE_FIELDS)}
    return Recipe(**chosen)


def adapter_serving(kind: str, settings: ServeSettings) -> tuple[list[str], dict[str, Any]]:
    """(server flags, fields of every request) that make engine kind ``kind`` serve ``settings.adapter_dir``
    beside the base weights: the adapter is loaded at start under :data:`raygym.lora.ADAPTER_NAME`, which every
    request names (``lora_path``). Nothing without an adapter."""
    if not settings.adapter_dir:
        return [], {}
    from raygym.engines.launch.lora import engine_lora_args
    from raygym.lora import ADAPTER_NAME, LoraSpec, model_targets, read_adapter

    spec = LoraSpec.from_config(read_adapter(settings.adapter_dir)[0])
    targets = model_targets(settings.model_dir, spec)
    return engine_lora_args(kind, spec, targets, settings.adapter_dir), {"lora_path": ADAPTER_NAME}


class ReplicaEngine:
    """The front's engine (:class:`raygym.serve.front.Engine`): the replica's EngineActor on the replica's event
    loop, every request carrying ``fields`` (a LoRA adapter's ``lora_path``)."""

    def __init__(self, engine: Any, fields: dict[str, Any]) -> None:
        self.engine, self.fields = engine, fields

    def generate(self, request: GenerateRequest) -> Awaitable[GenerateResponse | list[GenerateResponse]]:
        return self.engine.generate_async(request.model_copy(update=self.fields) if self.fields else request)

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        return self.engine.generate_stream(request.model_copy(update=self.fields) if self.fields else request)


def preflight_engine_here(settings: ServeSettings) -> str:
    """The engine kind a replica will run, checked before Ray starts: SGLang or vLLM importable by the engine
    interpreter, and on a machine without CUDA a model vLLM's CPU attention can run (its head size). Returns
    the kind; ConfigError names the fix."""
    import torch

    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.engines.interpreter import check_engine_python
    from raygym.engines.launch.vllm import check_cpu_head_dim, checkpoint_head_dim

    kind = choose_rollout_engine(settings.engine)
    if kind in ("sglang", "vllm"):
        check_engine_python(kind, settings.engine_settings.get("rollout_engine_python"))
    if kind == "vllm" and not torch.cuda.is_available():
        check_cpu_head_dim(checkpoint_head_dim(settings.model_dir), settings.model_dir, "raygym serve --engine vllm")
    return kind


def start_engine_front(settings: ServeSettings, gpu_ids: list[int]) -> tuple[Any, Any]:
    """Start the engine ``settings`` name on ``gpu_ids`` and build the OpenAI front in front of it; returns
    ``(EngineActor, OpenAIFront)``; a vision-language checkpoint's front takes chat images
    (:mod:`raygym.serve.images`). Shared by a Serve replica and the one-box server (:mod:`raygym.serve.direct`)."""
    import tempfile

    from transformers import AutoTokenizer

    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.engines.actor import EngineActor
    from raygym.serve.front import OpenAIFront
    from raygym.serve.images import ChatImages

    kind = choose_rollout_engine(settings.engine)
    gpus = max(1, len(gpu_ids))  # one engine per replica: it may decode on every core the replica has
    recipe = engine_recipe({**settings.engine_settings, "rollout_num_gpus": gpus, "rollout_num_gpus_per_engine": gpus})
    server_args, fields = adapter_serving(kind, settings)
    engine = EngineActor(recipe, engine_index=0, model_path=settings.model_dir, gpu_ids=gpu_ids,
                         host="127.0.0.1", backend=kind, log_dir=tempfile.mkdtemp(prefix="raygym-serve-engine-"),
                         extra_server_args=server_args)
    try:
        engine.start()
        tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
        images = ChatImages.for_checkpoint(settings.model_dir, tokenizer, settings.model_name)
    except BaseException:
        engine.close()
        raise
    context = _context_len(settings.model_dir)
    if kind == "vllm":  # vLLM holds KV cache for the run's longest request, not the model's whole context
        from raygym.engines.launch.vllm import max_model_len

        context = min(context or max_model_len(recipe), max_model_len(recipe))
    front = OpenAIFront(tokenizer, ReplicaEngine(engine, fields), settings.model_name,
                        context_len=context, default_max_tokens=settings.default_max_tokens, images=images)
    return engine, front


__all__ = ["ENGINE_RECIPE_FIELDS", "ReplicaEngine", "adapter_serving", "engine_recipe", "preflight_engine_here",
           "start_engine_front"]
