"""What the sender needs of a transport (``nccl``/gloo group, ``disk``, ``ipc``), as one typed protocol."""

from __future__ import annotations

from typing import Protocol

import torch


class Transport(Protocol):
    """Sender side of one transport: connect once, then per version ``begin``, ``send_bucket``\\*, ``finish``."""

    kind: str

    @property
    def connected(self) -> bool:
        """Whether ``begin`` may be called without :meth:`connect` first."""
        ...

    def connect(self) -> None:
        """Set up what every version uses (the dist group is formed here)."""
        ...

    def begin(self, version: int) -> None:
        """Prepare to send ``version``."""
        ...

    def announce(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """The bucket a later :meth:`send_bucket` will send, in order, once it is packed: the transport may start
        delivering its request to the engines early (doing nothing is valid). Every announced bucket is sent."""
        ...

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Hand one bucket (its manifest bytes and its payload buffer) to every engine."""
        ...

    def finish(self, version: int) -> None:
        """Return once every engine loaded every bucket of ``version``."""
        ...

    def close_group(self) -> None:
        """Drop the connection state so the next :meth:`connect` starts afresh (e.g. an engine restarted)."""
        ...

    def close(self) -> None:
        """Release everything (threads, group)."""
        ...
