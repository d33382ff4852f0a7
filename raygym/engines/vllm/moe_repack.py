"""vLLM's CPU MoE experts after a weight update: repacked, as at load time. Runs inside vLLM's worker processes.

On CPU, vLLM's unquantized MoE kernel keeps the expert weights prepacked into its grouped-gemm layout
(``CPUExperts.process_weights_after_loading`` replaces ``w13_weight`` / ``w2_weight`` with packed tensors). A
layerwise reload (what a weight update runs) materialises the layer's checkpoint-layout tensors, loads them and
calls ``UnquantizedFusedMoEMethod.process_weights_after_loading``, which, once the kernel exists, treats the call as
a weight update and skips the experts' own step, the prepacking; the reload then copies the unpacked tensors into
the kernel's packed ones. The kernel goes on reading them in its packed layout: the experts it serves are neither
the old ones nor the new ones (vLLM 0.32's CPU build; measured 0.05 to 0.18 apart from the trainer in float32 on
the builtin tiny MoE, where every other weight matched to 1e-6).

:func:`install` wraps that method so that, on a weight update, the experts' own step runs too: the tensors are
packed again, exactly as when the model loaded, before the reload copies them into the kernel's storage.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = "_raygym_repacks_cpu_experts"


def install() -> bool:
    """Make vLLM repack CPU MoE experts after each weight update (once per process); False when this vLLM has
    no such method (nothing to mend)."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:
        return False
    original = UnquantizedFusedMoEMethod.process_weights_after_loading
    if getattr(original, _INSTALLED, False):
        return True

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        kernel = getattr(self, "moe_kernel", None)  # set on the first call: later calls are weight updates
        original(self, layer)
        if kernel is not None and layer.w13_weight.device.type == "cpu":
            kernel.fused_experts.process_weights_after_loading(layer)

    setattr(process_weights_after_loading, _INSTALLED, True)
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    return True
