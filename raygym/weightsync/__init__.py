"""Weight sync: trainer -> inference engines, full or delta, versioned and verified.

Pure parts: :mod:`.codec` (delta encoding, checksums), :mod:`.buckets` (bucket planning),
:mod:`.payload` (bucket wire format), :mod:`.snapshot`. Sender side (trainer rank 0): :mod:`.sender`
with the transports :mod:`.transport_dist` (nccl/gloo), :mod:`.transport_disk`, :mod:`.transport_ipc`.
Engine side: :mod:`.loader` (``load_payload``, SGLang custom-loader convention), used by the engine's weight
routes in :mod:`raygym.engines.serving.weight_receiver`. Driver side: :class:`.coordinator.WeightSync`. Heavy modules
are imported on use. ``raygym.rollout`` imports this package, never the reverse: what both need of the
engines (:mod:`raygym.engine_api.kinds`, :mod:`raygym.engine_api.auth`) sits below both.
"""

from raygym.weightsync.codec import apply_delta, checksum, encode_delta

__all__ = ["apply_delta", "checksum", "encode_delta"]
