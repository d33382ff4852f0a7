"""What each engine kind can do, declared once: the sync coordinator and config validation ask here.

Pure (no torch, no ray at import). It sits below ``raygym.rollout`` and ``raygym.weightsync``, which both ask
it, and ``raygym.config``, which refuses with it, before anything starts, a weight-sync combination an engine
kind cannot carry out.

Engine kinds:

- ``raygym``: raygym's own server (``python -m raygym.engines.raygym_server.server``). Its parameters carry the
  checkpoint's HF names, so weights are verified exactly (per-tensor xxh3 checksums through
  ``/raygym/weights_checksum``) and raygym's delta payloads apply over every transport.
- ``sglang``: stock, unpatched SGLang. Its parameters are fused and TP-sharded (``qkv_proj``,
  ``gate_up_proj``), so only full HF-named tensors may reach it, always through the model's own
  ``load_weights``: ``/update_weights_from_distributed`` (``flattened_bucket``), ``/update_weights_from_disk``
  (a HF safetensors directory) or, colocated on GPU, ``/update_weights_from_tensor`` (CUDA IPC handles).
  A delta travels only where SGLang runs a custom loader: ``/update_weights_from_tensor`` with raygym's
  ``load_payload_via_model``, which rebuilds full tensors from a host snapshot it keeps; the delta
  itself is read from the ``disk`` transport's shared directory. Verification: the weight version label
  plus a probe — fixed token sequences scored by the engine (``input_token_logprobs``) must match the
  trainer's own forward pass (SGLang 0.5.18 implements ``/get_weights_by_name`` for no Qwen3 model).
- ``vllm``: vLLM's engine behind raygym's adapter (``python -m raygym.engines.vllm.server``, run by vLLM's
  interpreter). Weights arrive through vLLM's weight-transfer lifecycle (start / update / finish, one session
  per sync) with raygym's transfer backend in vLLM's workers (:mod:`raygym.engines.vllm.weights`): HF-named
  full tensors go to the model's ``load_weights`` between vLLM's layerwise-reload calls, over a torch
  process group (``flattened_bucket``), from a HF safetensors directory, or as CUDA IPC handles; deltas
  over the group or the disk are rebuilt into full tensors from a host snapshot each worker keeps.
  Verification: exact checksums of the HF-named tensors the workers handed to ``load_weights`` (they keep
  them; ``/raygym/weights_checksum``), and the probe for what loading does with them (vLLM's parameters are
  fused, TP-sharded and, on CPU, repacked into kernel layouts: no HF-named bytes of them exist to checksum,
  and vLLM 0.32's CPU MoE experts were served unpacked after every update, which only the probe saw).

LoRA (``lora_rank > 0``): only the adapters are synced, in the form each kind takes (``lora``):

- ``raygym``: ``"weights"``: its server attaches the adapters to its model as parameters of their own
  (``<module>.lora_A.weight``, applied beside the base layer, never merged into it), so adapter tensors travel
  and are verified exactly like weights (checksums; full, delta or auto over every transport).
- ``sglang``: ``"lora_endpoints"``: launched with ``--enable-lora``, it loads each version's PEFT directory through
  ``/load_lora_adapter`` (after ``/unload_lora_adapter``) and requests name it in ``lora_path``; verified by the
  probe (whose requests name it too). GPU only: SGLang's CPU backend cannot serve adapters
  (``sglang/srt/lora/layers.py``: every LoRA layer pins host memory, ``torch.tensor(..., pin_memory=True)`` in
  ``ColumnParallelLinearWithLoRA.__init__``, ``RowParallelLinearWithLoRA.set_lora_info`` and the others, which
  needs a CUDA driver; checked with 0.5.15.post1, 0.5.18 and 0.5.23).
- ``vllm``: ``"lora_endpoints"``: raygym's adapter runs vLLM with ``enable_lora`` and turns the same routes into
  ``LoRARequest``s (a new one replaces the served adapter at once, ``lora_replace``); verified by the probe.
  Adapters load whole from a directory: full syncs only (``auto`` means full).

>>> caps = capabilities("sglang")
>>> caps.verification, sorted(caps.delta_transports)
('probe', ['disk'])
>>> check_weight_sync("sglang", mode="delta", transport="nccl", colocate=False)
Traceback (most recent call last):
...
raygym.errors.ConfigError: update_weight_mode='delta' over update_weight_transport='nccl' is not possible with rollout_engine='sglang': stock SGLang applies no custom loader on /update_weights_from_distributed, so a delta would be dropped; use --update-weight-transport disk (delta through SGLang's custom-weight-loader hook) or --update-weight-mode full
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from raygym.errors import ConfigError

ENGINE_KINDS = ("raygym", "sglang", "vllm")
ROLLOUT_ENGINES = ("auto", *ENGINE_KINDS)  # what ``rollout_engine`` takes
TRANSPORTS = ("nccl", "disk", "ipc")


def choose_rollout_engine(name: str) -> str:
    """Resolve ``rollout_engine``: ``auto`` = SGLang when CUDA and sglang are importable, else raygym.

    >>> choose_rollout_engine("vllm")
    'vllm'
    """
    if name not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout_engine={name!r}: use one of {', '.join(ROLLOUT_ENGINES)}")
    if name != "auto":
        return name
    import importlib.util

    import torch

    return "sglang" if torch.cuda.is_available() and importlib.util.find_spec("sglang") else "raygym"


@dataclass(frozen=True)
class EngineCapabilities:
    """One engine kind's abilities.

    Attributes:
        kind: ``"raygym"``, ``"sglang"`` or ``"vllm"``.
        verification: ``"checksum"`` (exact bytes of every tensor) or ``"probe"`` (the engine's log-probs of
            fixed token sequences against the trainer's forward pass, with a tolerance calibrated per run:
            :mod:`raygym.weightsync.probe`).
        checksums: which per-tensor checksums the engine can give: ``"held"`` (of the weights it serves, by HF
            name: raygym's server), ``"loaded"`` (of the HF-named tensors its weight updates loaded, before the
            engine fused or repacked them: vLLM behind raygym's adapter; compared besides the probe),
            ``"gpu"`` (stock SGLang's ``/weights_checker``, whose checksum works on CUDA only; raygym does not
            call it yet: untested, so SGLang relies on the probe) or ``"no"``.
        full_transports / delta_transports: transports that carry a full / a delta payload to this kind.
        dist_format: how a bucket travels over ``/update_weights_from_distributed``: ``"raygym_bucket"``
            (raygym's manifest + buffer, applied by its custom loader) or ``"flattened_bucket"`` (HF-named
            full tensors back to back, SGLang's format, applied by the model's ``load_weights``).
        delta_loader: the custom loader a delta payload names in ``load_format``.
        memory_release: ``"always"`` (releases on request), ``"memory_saver"`` (only when launched with
            ``--enable-memory-saver``, on GPU) or ``"sleep_mode"`` (vLLM's sleep/wake, only when launched
            with sleep mode, on GPU).
        accepts_api_key_env: the server reads its API key from the environment (else from a config file).
        double_buffer: the engine can receive the next version into a shadow copy while it keeps serving
            the current one, and switch between two forward passes (``update_weight_double_buffer``).
        lora: how the kind serves LoRA adapters (module docstring): ``"weights"`` or ``"lora_endpoints"``.
        lora_on_cpu: whether it serves them without CUDA.
        lora_replace: ``/load_lora_adapter`` of a loaded name replaces it in one step (else unload first).
        inflight_update: how a weight update meets requests in flight in a fully asynchronous run
            (``fully_async``): ``"swap"`` = they stay in the engine, which swaps the weights between two
            decode steps, recomputes their KV cache on the new ones and reports each token's version
            (``output_token_weight_versions``); ``"resubmit"`` = the engine aborts them at the pause and
            returns their tokens so far, and the rollout manager continues each one on the new weights once
            the update is done (the engine reports one version per answer, so each part is one answer:
            stock SGLang's in_place/retract pauses and vLLM's keep pause would continue them without saying
            which tokens came from which weights).
        routed_experts: whether it returns the experts each token was routed to (MoE routing replay,
            ``use_rollout_routing_replay``; :mod:`raygym.routed_experts`): ``"always"`` (raygym's server, launched
            with ``--enable-return-routed-experts``), ``"gpu"`` (stock SGLang from 0.5.15 with the same flag; its
            CPU backend cannot: the capture's host buffer is pinned memory, ``torch.zeros(..., pin_memory=True)``
            in ``sglang/srt/state_capturer/base.py``, which needs a CUDA driver; checked with 0.5.15.post1, 0.5.18
            and 0.5.23) or ``"no"`` (vLLM behind raygym's adapter: vLLM 0.32 captures them only in its Model Runner
            V2, ``enable_return_routed_experts`` with ``VLLM_USE_V2_MODEL_RUNNER=1``, which needs Triton, so not on
            CPU, and the adapter does not ask for them).
    """

    kind: str
    verification: str
    checksums: str
    full_transports: frozenset[str]
    delta_transports: frozenset[str]
    dist_format: str
    delta_loader: str
    memory_release: str
    accepts_api_key_env: bool
    double_buffer: bool = False
    lora: str = "lora_endpoints"
    lora_on_cpu: bool = True
    lora_replace: bool = False
    inflight_update: str = "resubmit"
    routed_experts: str = "no"


# Custom loaders (SGLang's convention: ``fn(model, named_tensors)``, imported by dotted path).
DIRECT_LOADER = "raygym.weightsync.loader.load_payload"  # writes into HF-named parameters
MODEL_LOADER = "raygym.weightsync.loader.load_payload_via_model"  # hands full tensors to model.load_weights

_CAPABILITIES = {
    "raygym": EngineCapabilities(
        kind="raygym", verification="checksum", checksums="held",
        full_transports=frozenset(TRANSPORTS), delta_transports=frozenset({"nccl", "disk"}),
        dist_format="raygym_bucket", delta_loader=DIRECT_LOADER, memory_release="always",
        accepts_api_key_env=True, double_buffer=True, lora="weights", inflight_update="swap", routed_experts="always",
    ),
    "sglang": EngineCapabilities(
        kind="sglang", verification="probe", checksums="gpu",
        full_transports=frozenset(TRANSPORTS), delta_transports=frozenset({"disk"}),
        dist_format="flattened_bucket", delta_loader=MODEL_LOADER, memory_release="memory_saver",
        accepts_api_key_env=False, lora_on_cpu=False, routed_experts="gpu",
    ),
    "vllm": EngineCapabilities(
        kind="vllm", verification="probe", checksums="loaded",
        full_transports=frozenset(TRANSPORTS), delta_transports=frozenset({"nccl", "disk"}),
        dist_format="flattened_bucket", delta_loader=MODEL_LOADER, memory_release="sleep_mode",
        accepts_api_key_env=True, lora_replace=True,
    ),
}


def capabilities(kind: str) -> EngineCapabilities:
    """The declared capabilities of engine kind ``kind`` (ConfigError for an unknown kind)."""
    try:
        return _CAPABILITIES[kind]
    except KeyError:
        raise ConfigError(f"rollout_engine={kind!r}: unknown engine kind; use one of {list(ENGINE_KINDS)}") from None


def weight_update_session(kind: str, version: str | None) -> bool:
    """Whether weight updates must sit between ``/begin_weight_update`` and ``/end_weight_update``
    (stock SGLang from 0.5.23 refuses them otherwise; vLLM's adapter maps them onto vLLM's
    start/finish weight update, around which its layerwise reload runs).

    >>> weight_update_session("sglang", "0.5.23"), weight_update_session("sglang", "0.5.18")
    (True, False)
    >>> weight_update_session("vllm", None)
    True
    """
    if kind == "vllm":
        return True
    return kind == "sglang" and version is not None and version_tuple(version) >= (0, 5, 23)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.15.post1"`` -> ``(0, 5, 15)`` (release numbers only).

    >>> version_tuple("0.5.15.post1"), version_tuple("0.5.6rc1")
    ((0, 5, 15), (0, 5, 6))
    """
    return tuple(int(n) for n in re.findall(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)[0] if n)


def payload_modes(kind: str, *, transport: str, colocate: bool) -> tuple[str, ...]:
    """The payloads (``full``, ``delta``) engine kind ``kind`` can receive over ``transport``: what
    ``update_weight_mode="auto"`` may choose from. Colocated engines take full weights only (a handle
    costs the same whatever changed).

    >>> payload_modes("raygym", transport="nccl", colocate=False), payload_modes("sglang", transport="nccl", colocate=False)
    (('full', 'delta'), ('full',))
    """
    caps = capabilities(kind)
    modes: tuple[str, ...] = ("full",) if transport in caps.full_transports else ()
    if transport in caps.delta_transports and not colocate:
        modes += ("delta",)
    return modes


def check_weight_sync(kind: str, *, mode: str, transport: str, colocate: bool, double_buffer: bool = False) -> None:
    """Raise ConfigError when engine kind ``kind`` cannot receive ``mode`` payloads over ``transport``
    (``auto``: when it can receive neither), or cannot double-buffer when ``double_buffer`` is asked for."""
    caps = capabilities(kind)
    if double_buffer and not caps.double_buffer:
        raise ConfigError(
            f"update_weight_double_buffer=True is not possible with rollout_engine={kind!r}: it cannot receive a "
            "version into a shadow copy while serving; pass --no-update-weight-double-buffer")
    if mode == "auto":
        if payload_modes(kind, transport=transport, colocate=colocate):
            return
        mode = "full"
    allowed = caps.delta_transports if mode == "delta" else caps.full_transports
    if transport in allowed:
        return
    if kind == "vllm" and mode == "delta":  # only ipc is left
        raise ConfigError(
            f"update_weight_mode='delta' over update_weight_transport={transport!r} is not possible with "
            "rollout_engine='vllm': CUDA IPC ships handles, not bytes, so a colocated delta saves nothing; use "
            "--update-weight-transport nccl or disk, or --update-weight-mode full"
        )
    if kind == "sglang" and mode == "delta":
        why = {
            "nccl": "stock SGLang applies no custom loader on /update_weights_from_distributed, so a delta "
                    "would be dropped",
            "ipc": "CUDA IPC ships handles, not bytes: a colocated delta saves nothing",
        }[transport]
        raise ConfigError(
            f"update_weight_mode='delta' over update_weight_transport={transport!r} is not possible with "
            f"rollout_engine='sglang': {why}; use --update-weight-transport disk (delta through SGLang's "
            "custom-weight-loader hook) or --update-weight-mode full"
        )
    raise ConfigError(
        f"update_weight_mode={mode!r} over update_weight_transport={transport!r} is not supported by "
        f"rollout_engine={kind!r}; supported transports: {sorted(allowed)}"
    )


def check_inflight_update(kind: str, *, pause_mode: str) -> None:
    """Raise ConfigError when a fully asynchronous run on engine kind ``kind`` cannot take weight updates with
    requests in flight as configured: a ``resubmit`` kind must abort them at the pause (``pause_mode`` 'abort')
    so each part of a response carries its own version.

    >>> check_inflight_update("raygym", pause_mode="in_place")
    >>> check_inflight_update("sglang", pause_mode="in_place")
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: fully_async=True with rollout_engine='sglang' and update_weight_pause_mode='in_place': sglang reports one weight version per answer, so a request kept in place across an update would mix versions nobody can tell apart; use --update-weight-pause-mode abort (requests in flight are continued on the new weights by raygym) or --rollout-engine raygym
    """
    caps = capabilities(kind)
    if caps.inflight_update == "resubmit" and pause_mode != "abort":
        raise ConfigError(
            f"fully_async=True with rollout_engine={kind!r} and update_weight_pause_mode={pause_mode!r}: {kind} "
            "reports one weight version per answer, so a request kept in place across an update would mix versions "
            "nobody can tell apart; use --update-weight-pause-mode abort (requests in flight are continued on the "
            "new weights by raygym) or --rollout-engine raygym")


def check_lora(kind: str, *, mode: str, double_buffer: bool, cuda: bool | None = None) -> None:
    """Raise ConfigError when engine kind ``kind`` cannot serve a LoRA run's adapters as configured (``cuda``:
    whether the engines have CUDA; None = not known yet, checked again where the engines start).

    >>> check_lora("raygym", mode="delta", double_buffer=False)
    >>> check_lora("sglang", mode="full", double_buffer=False, cuda=False)
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: lora_rank > 0 with rollout_engine='sglang' on CPU: SGLang's CPU backend cannot serve LoRA adapters (sglang/srt/lora/layers.py: its LoRA layers pin host memory, which needs a CUDA driver); use --rollout-engine vllm (its CPU build serves adapters) or --rollout-engine raygym
    """
    caps = capabilities(kind)
    if cuda is False and not caps.lora_on_cpu:
        raise ConfigError(
            f"lora_rank > 0 with rollout_engine={kind!r} on CPU: SGLang's CPU backend cannot serve LoRA adapters "
            "(sglang/srt/lora/layers.py: its LoRA layers pin host memory, which needs a CUDA driver); use "
            "--rollout-engine vllm (its CPU build serves adapters) or --rollout-engine raygym")
    if caps.lora == "lora_endpoints" and mode == "delta":
        raise ConfigError(
            f"update_weight_mode='delta' with lora_rank > 0 and rollout_engine={kind!r}: {kind} loads each version's "
            "adapter whole from a PEFT directory; use --update-weight-mode full (an adapter is a few MB) or auto, "
            "or --rollout-engine raygym (its adapters take deltas)")
    if double_buffer and not caps.double_buffer:
        check_weight_sync(kind, mode="full", transport="nccl", colocate=False, double_buffer=True)


ROUTED_EXPERTS_SGLANG = (0, 5, 15)  # the first SGLang release with --enable-return-routed-experts


def check_routing_replay(kind: str, *, cuda: bool | None = None, version: str | None = None) -> None:
    """Raise ConfigError when engine kind ``kind`` cannot return the routed experts routing replay needs
    (``cuda``: whether the engines have CUDA, None = not known yet; ``version``: the engine's, when known).

    >>> check_routing_replay("raygym", cuda=False)
    >>> check_routing_replay("sglang", cuda=False)
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: use_rollout_routing_replay=True with rollout_engine='sglang' on CPU: stock SGLang returns routed experts on GPU only (its capture buffer is pinned host memory, which needs a CUDA driver); use --rollout-engine raygym, or drop --use-rollout-routing-replay
    """
    caps = capabilities(kind)
    fix = "use --rollout-engine raygym, or drop --use-rollout-routing-replay"
    if caps.routed_experts == "no":
        raise ConfigError(
            f"use_rollout_routing_replay=True with rollout_engine={kind!r}: raygym's vLLM adapter does not return "
            f"routed experts (vLLM captures them only in its Model Runner V2, which needs Triton); {fix}")
    if caps.routed_experts == "gpu" and cuda is False:
        raise ConfigError(
            f"use_rollout_routing_replay=True with rollout_engine={kind!r} on CPU: stock SGLang returns routed "
            f"experts on GPU only (its capture buffer is pinned host memory, which needs a CUDA driver); {fix}")
    if kind == "sglang" and version is not None and version_tuple(version) < ROUTED_EXPERTS_SGLANG:
        raise ConfigError(
            f"use_rollout_routing_replay=True with SGLang {version}: --enable-return-routed-experts arrived in "
            "0.5.15; install sglang>=0.5.15 for the engines, or drop --use-rollout-routing-replay")
