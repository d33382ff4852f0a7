"""The sync protocol the driver runs after each training step: ``WeightSync.push(version)``.

1. pause generation on every engine (``update_weight_pause_mode``: "abort" or "in_place");
2. flush the KV cache (retried with a bound; in-flight requests aborted first if it keeps failing);
3. the trainers push ``version`` (rank 0 sends; full or delta, see :mod:`raygym.weightsync.sender`);
4. every engine's checksums for ``version`` are compared with the sender's (``/raygym/weights_checksum``);
   a mismatch or a failed load triggers one automatic full resync, counted in ``sync/full_resyncs``;
5. the sender's delta snapshot advances (only now: every engine verified);
6. generation continues.

>>> sync = WeightSync(recipe, trainers=[rank0, rank1], engines=["http://10.0.0.5:30000"])  # doctest: +SKIP
>>> sync.setup(); metrics = sync.push(version=1); sync.shutdown()                         # doctest: +SKIP

``trainers`` are TrainerActor handles (rank 0 first) with ``init_weight_sync(spec)``,
``push_weights(version, force_full)``, ``commit_weights(version)`` and ``discard_weights()``; plain
objects with those methods (same process) work too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import EngineLink, as_link, checked
from raygym.weightsync.sender import SenderSpec

FLUSH_RETRIES = 20
FLUSH_SLEEP_S = 0.25


def _invoke(target: Any, method: str, *args: Any, timeout: float) -> list[Any] | Any:
    """Call ``method`` on a Ray actor handle (waiting at most ``timeout``) or on a local object."""
    fn = getattr(target, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args), timeout=timeout)
    return fn(*args)


def _invoke_all(targets: Sequence[Any], method: str, *args: Any, timeout: float) -> list[Any]:
    """Call ``method`` on every trainer at once (all ranks take part); results in rank order."""
    remote = [getattr(t, method) for t in targets]
    if all(hasattr(fn, "remote") for fn in remote):
        import ray

        return ray.get([fn.remote(*args) for fn in remote], timeout=timeout)
    return [fn(*args) for fn in remote]


class WeightSync:
    """Driver-side weight sync: versioned, verified, with automatic full resync."""

    def __init__(self, recipe: Any, trainers: Sequence[Any], engines: Sequence[str | EngineLink], *,
                 spec_overrides: dict[str, Any] | None = None):
        self.trainers = list(trainers)
        if not self.trainers:
            raise ValueError("WeightSync needs at least one trainer (rank 0 first)")
        self.links = [as_link(e, i) for i, e in enumerate(engines)]
        self.spec = SenderSpec.from_recipe(recipe, list(self.links), **(spec_overrides or {}))
        self.full_interval = int(getattr(recipe, "update_weight_full_interval", 0) or 0)
        self.pause_mode = getattr(recipe, "update_weight_pause_mode", "abort") or "abort"
        self.timeout_s = self.spec.timeout_s
        self.version: int | None = None
        self.syncs = 0
        self.full_resyncs = 0
        self._force_full = True  # the first sync seeds engines and snapshot with identical bytes

    def setup(self) -> dict[str, Any]:
        """Send the spec to the trainers; rank 0 connects to every engine (dist group formed here)."""
        return _invoke_all(self.trainers, "init_weight_sync", self.spec, timeout=self.timeout_s)[0]

    def push(self, version: int) -> dict[str, float]:
        """Make every engine serve ``version``; returns ``sync/*`` metrics (``sync/mode``: 1 delta, 0 full)."""
        start = time.perf_counter()
        self._pause()
        try:
            force = self._force_full or (self.full_interval > 0 and self.syncs % self.full_interval == 0
                                         and self.syncs > 0)
            result, error = self._push_and_verify(version, force)
            resynced = 0.0
            if error is not None:
                self.full_resyncs += 1
                resynced = 1.0
                result, error = self._push_and_verify(version, force_full=True)
                if error is not None:
                    raise WeightSyncError(f"version {version}: full resync failed too: {error}")
            _invoke_all(self.trainers[:1], "commit_weights", version, timeout=self.timeout_s)
        finally:
            self._continue()
        self._force_full = False
        self.syncs += 1
        self.version = version
        metrics = dict(result["metrics"])
        metrics.update({"sync/full_resyncs": float(self.full_resyncs), "sync/resynced": resynced,
                        "sync/time_s": time.perf_counter() - start})
        return metrics

    def resync_engine(self, index: int) -> dict[str, float]:
        """Engine ``index`` was restarted: re-form the group and push the current version in full."""
        if self.version is None:
            raise WeightSyncError("resync_engine before any push: nothing to resync")
        _invoke(self.trainers[0], "reconnect_weight_sync", timeout=self.timeout_s)
        self._force_full = True
        return self.push(self.version)

    def verify(self, version: int, expected: dict[str, str]) -> list[str]:
        """Engines whose weight version or checksums differ from ``expected`` (descriptions)."""
        bad = []
        for link in self.links:
            try:
                answer = checked(link, "raygym/weights_checksum", {"names": None}, self.timeout_s)
            except WeightSyncError as exc:
                bad.append(str(exc))
                continue
            got = answer.get("checksums", {})
            wrong = [n for n, h in expected.items() if got.get(n) != h]
            if str(answer.get("weight_version")) != str(version) or wrong:
                bad.append(f"{link.name}: weight_version {answer.get('weight_version')!r} (want {version}), "
                           f"{len(wrong)} tensor(s) differ {wrong[:3]}")
        return bad

    def shutdown(self) -> None:
        """Leave the weight-update group (trainer side)."""
        try:
            _invoke(self.trainers[0], "close_weight_sync", timeout=min(self.timeout_s, 30.0))
        except Exception:
            pass

    def _push_and_verify(self, version: int, force_full: bool) -> tuple[dict[str, Any], str | None]:
        try:
            results = _invoke_all(self.trainers, "push_weights", version, force_full, timeout=self.timeout_s)
        except WeightSyncError as exc:
            return {}, str(exc)
        except Exception as exc:  # a Ray task error wraps the WeightSyncError raised in the trainer
            if "WeightSyncError" not in f"{type(exc).__name__} {exc}":
                raise
            _invoke(self.trainers[0], "discard_weights", timeout=self.timeout_s)
            return {}, str(exc)
        result = results[0]
        bad = self.verify(version, result["checksums"])
        if bad:
            _invoke(self.trainers[0], "discard_weights", timeout=self.timeout_s)
            return result, "; ".join(bad)
        return result, None

    def _pause(self) -> None:
        for link in self.links:
            checked(link, "pause_generation", {"mode": self.pause_mode}, self.timeout_s)
        for link in self.links:
            self._flush(link)

    def _flush(self, link: EngineLink) -> None:
        for attempt in range(FLUSH_RETRIES):
            try:
                checked(link, "flush_cache", {}, self.timeout_s)
                return
            except WeightSyncError:
                if attempt == FLUSH_RETRIES // 2:
                    checked(link, "abort_request", {"abort_all": True}, self.timeout_s)
                time.sleep(FLUSH_SLEEP_S)
        raise WeightSyncError(f"engine {link.name}: /flush_cache kept failing after {FLUSH_RETRIES} tries "
                              f"(requests still pending? pause mode {self.pause_mode!r})")

    def _continue(self) -> None:
        for link in self.links:
            try:
                checked(link, "continue_generation", {}, self.timeout_s)
            except WeightSyncError:
                pass  # an engine that cannot continue is reported by its health check
