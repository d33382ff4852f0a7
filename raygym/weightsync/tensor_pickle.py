"""``serialized_named_tensors`` of ``/update_weights_from_tensor``: base64 pickles of ``[(name, tensor)]``.

SGLang reads each entry with a restricted unpickler that admits torch's own rebuild functions. A CPU
tensor pickled by the standard pickler carries its bytes inline (no shared memory, no file descriptors),
so such an entry works between any two processes, on any host. CUDA tensors are pickled as IPC handles
instead (see :mod:`raygym.weightsync.transport_ipc`).

:func:`loads_named_tensors` is the receiving side for raygym's own server: it admits only what a list of
named tensors needs, and loads inline tensor bytes with ``torch.load(weights_only=True)``.

>>> import torch
>>> text = dumps_named_tensors([("w", torch.arange(3, dtype=torch.float32))])
>>> loads_named_tensors(text)[0][1].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import torch

# The one tensor a pointer request carries: JSON {"url", "engine", "version"} as uint8.
POINTER_NAME = "__raygym_pointer__"


def dumps_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Base64 of the standard pickle of ``named_tensors`` (CPU tensors travel inline)."""
    return base64.b64encode(pickle.dumps([(n, t.detach()) for n, t in named_tensors])).decode()


def _load_tensor_bytes(data: bytes) -> Any:
    """Stand-in for ``torch.storage._load_from_bytes`` that refuses anything but tensor data."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _NamedTensorUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_tensor_bytes
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") and torch.cuda.is_available():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"serialized_named_tensors: {module}.{name} is not allowed here")


def loads_named_tensors(text: str) -> list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry; ValueError names what is wrong with it."""
    try:
        raw = base64.b64decode(text, validate=True)
        value = _NamedTensorUnpickler(io.BytesIO(raw)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError) as exc:
        raise ValueError(f"serialized_named_tensors: not a pickled list of (name, tensor): {exc}") from exc
    if not isinstance(value, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in value
    ):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return value
