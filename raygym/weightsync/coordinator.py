"""The sync protocol the driver runs after each training step: ``WeightSync.push(version)``.

1. pause generation on every engine (``update_weight_pause_mode``: "abort" or "in_place");
2. flush the KV cache (retried with a bound; in-flight requests aborted first if it keeps failing);
3. [SGLang >= 0.5.23] open a weight-update session (``/begin_weight_update``);
4. the trainers push ``version`` (rank 0 sends; full or delta, see :mod:`raygym.weightsync.sender`);
5. verify, as the engine kind declares (:mod:`raygym.engine_api.kinds`): ``checksum`` compares every
   engine's per-tensor checksums with the sender's (``/raygym/weights_checksum``); ``probe`` checks the
   weight version each engine reports (``/model_info``), the checksums of the tensors it loaded where it
   keeps them (vLLM's workers), and, once generation continues, that the engine's log-probs of a seeded
   probe match the trainer's forward pass within tolerances calibrated on the run's own noise floor (the
   probe before and after the first sync; :mod:`raygym.weightsync.probe`);
   a mismatch or a failed load triggers one automatic full resync, counted in ``sync/full_resyncs``;
6. the sender's delta snapshot advances (only now: every engine verified); the session closes;
7. generation continues.

Metrics say what was checked: ``sync/verified_tensors`` (exact checksums compared), ``sync/probe_tokens``,
``sync/probe_logprob_diff_mean`` and ``_max`` (probe), ``sync/probe_floor_mean`` and ``_max`` (its calibrated
noise floor), ``sync/probe_tolerance`` and ``_max``, ``sync/probe_margin`` (above 1 fails),
``sync/verified_versions`` (labels read back); ``sync/probe_s`` is what the probe took of ``sync/time_s``.

``update_weight_mode="auto"``: a :class:`~raygym.weightsync.sync_cost.SyncCostModel` picks full or delta
before each sync (among the payloads the engine kind takes over the transport) and learns from what the
sync cost: ``sync/mode``, ``sync/predicted_s`` (for the chosen mode), ``sync/predicted_full_s``,
``sync/predicted_delta_s``, ``sync/measured_s``, ``sync/explore`` (1 when the mode was picked to be measured).

``update_weight_double_buffer`` (engines that can, :mod:`raygym.engine_api.kinds`): steps 1-2 are
skipped; the engines load ``version`` into a shadow copy while they keep generating
(``/raygym/shadow_begin``), the shadow's checksums are verified, and ``/raygym/shadow_switch`` swaps it in
between two forward passes (aborting what is in flight first when the pause mode is ``abort``). A fully
asynchronous run (``fully_async``) on an engine whose in-flight update is a ``swap`` always goes this way and
aborts nothing: requests in flight continue on the new weights (their KV cache recomputed by the engine).
``sync/pause_s`` is how long generation was held: the whole pause without double buffering, the
longest switch with it.

>>> sync = WeightSync(recipe, trainers=[rank0, rank1], engines=["http://10.0.0.5:30000"])  # doctest: +SKIP
>>> sync.setup(); metrics = sync.push(version=1); sync.shutdown()                         # doctest: +SKIP

``trainers`` are TrainerActor handles (rank 0 first) with ``init_weight_sync(spec)``,
``push_weights(version, force_full, refresh_snapshot)``, ``commit_weights(version)``, ``discard_weights()`` and, for the
probe, ``probe_log_probs(prompts, responses)``; plain objects with those methods (same process) work too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raygym.config import Recipe
from raygym.config.schedule import FullyAsync
from raygym.engine_api.kinds import capabilities
from raygym.engine_api.protocol import (
    AbortRequest,
    BeginWeightUpdate,
    ContinueGeneration,
    Endpoint,
    ModelInfo,
    NoFields,
    PauseGeneration,
    ShadowBegin,
    ShadowSwitch,
    WeightsChecksum,
    WeightsChecksumResponse,
)
from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import EngineLink, as_link, checked
from raygym.weightsync.probe import (
    HALF_PRECISION_SLACK,
    MIN_MEAN,
    EngineProbe,
    ImageProbe,
    ProbeCalibration,
    ProbeResult,
    ProbeSpec,
    compare_logprobs,
    outliers,
    worst_of,
)
from raygym.weightsync.sender import SenderSpec
from raygym.weightsync.sync_cost import ModeChoice, SyncCostModel, SyncSample

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

    def __init__(self, recipe: Recipe, trainers: Sequence[Any], engines: Sequence[str | EngineLink], *,
                 engine_kind: str = "raygym", session: bool = False,
                 spec_overrides: dict[str, Any] | None = None, cost_model: SyncCostModel | None = None,
                 image_probe: ImageProbe | None = None):
        """``engine_kind``: what the engines are (decides format and verification); ``session``: wrap every
        update in ``/begin_weight_update`` ... ``/end_weight_update`` (stock SGLang from 0.5.23);
        ``cost_model``: what ``auto`` learned so far for this transport and engine kind (e.g. from the
        WeightSync this one replaces after an engine restart); ``image_probe``: a vision-language model's image
        item, which the probe scores beside the text (:func:`raygym.weightsync.probe_image.image_probe`)."""
        self.trainers = list(trainers)
        if not self.trainers:
            raise ValueError("WeightSync needs at least one trainer (rank 0 first)")
        self.links = [as_link(e, i) for i, e in enumerate(engines)]
        self.spec = SenderSpec.from_recipe(recipe, list(self.links), engine_kind=engine_kind,
                                           **(spec_overrides or {}))
        self.verification = capabilities(engine_kind).verification
        self.loaded_checksums = capabilities(engine_kind).checksums == "loaded"
        self.session = session
        self.probe = ProbeSpec()
        self.image_probe = image_probe
        self.engine_kind = engine_kind
        self.probe_tolerance = recipe.update_weight_probe_tolerance
        self.probe_parts = ("text",) if image_probe is None else ("text", "image")
        self._calibrations: dict[str, ProbeCalibration] = {}  # each part's tolerances, from the first sync's floor
        self._before: dict[str, ProbeResult] = {}  # each part's probe before the first sync (the engines' own weights)
        self.colocate = recipe.colocate
        self.temperature = recipe.rollout_temperature
        self.full_interval = recipe.update_weight_full_interval
        self.pause_mode = recipe.update_weight_pause_mode
        caps = capabilities(engine_kind)
        # A fully asynchronous run on an engine that swaps weights under running requests receives into the
        # shadow copy and switches without aborting anything: requests continue on the new weights.
        self.inflight_swap = (isinstance(recipe.schedule, FullyAsync) and caps.inflight_update == "swap"
                              and caps.double_buffer)
        self.double_buffer = (recipe.update_weight_double_buffer and caps.double_buffer) or self.inflight_swap
        self.cost_model = (cost_model or SyncCostModel(self.spec.payload_modes)) if self.spec.mode == "auto" else None
        self._raw_bytes = 0.0
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
        force = self._force_full or (self.full_interval > 0 and self.syncs % self.full_interval == 0
                                     and self.syncs > 0)
        choice = self._choose(force)
        if self._force_full and not self._before:
            self._probe_before_first_sync()
        refresh = True
        if choice is not None and choice.mode == "full":
            force, refresh = True, choice.refresh_snapshot
        result, error = self._attempt(version, force, refresh)
        probe_start = time.perf_counter()
        if error is None and self.verification == "probe":
            error = self._probe(version, result["metrics"])
        probe_s = time.perf_counter() - probe_start
        measured_s = time.perf_counter() - start
        resynced = 0.0
        if error is not None:
            self.full_resyncs += 1
            resynced = 1.0
            result, error = self._attempt(version, force_full=True)
            if error is None and self.verification == "probe":
                error = self._probe(version, result["metrics"])
            if error is not None:
                raise WeightSyncError(f"version {version}: full resync failed too: {error}")
        self._force_full = False
        self.syncs += 1
        self.version = version
        metrics = dict(result["metrics"])
        metrics.update({"sync/full_resyncs": float(self.full_resyncs), "sync/resynced": resynced,
                        "sync/time_s": time.perf_counter() - start, "sync/probe_s": probe_s})
        if choice is not None:
            self._learn(choice, metrics, measured_s, observe=not resynced)
        return metrics

    def _choose(self, force_full: bool) -> ModeChoice | None:
        """``auto``: the mode of this sync (a forced full sync is still predicted, to compare)."""
        if self.cost_model is None:
            return None
        if force_full:
            model = self.cost_model
            return ModeChoice("full", "forced", model.predict("full", self._raw_bytes),
                              model.predict("delta", self._raw_bytes))
        return self.cost_model.choose(self._raw_bytes)

    def _learn(self, choice: ModeChoice, metrics: dict[str, float], measured_s: float, observe: bool) -> None:
        """Fold what the sync cost into the cost model; report prediction against measurement."""
        assert self.cost_model is not None
        mode = "delta" if metrics["sync/mode"] == 1.0 else "full"
        self._raw_bytes = metrics["sync/raw_bytes"]
        if observe:
            self.cost_model.observe(SyncSample(mode, raw_bytes=metrics["sync/raw_bytes"],
                                               wire_bytes=metrics["sync/bytes"], seconds=measured_s,
                                               transfer_s=metrics["sync/transfer_s"], setup_s=metrics["sync/setup_s"]))
        predicted = {"full": choice.predicted_full_s, "delta": choice.predicted_delta_s}
        for key, value in (("sync/predicted_s", predicted[mode]), ("sync/predicted_full_s", choice.predicted_full_s),
                           ("sync/predicted_delta_s", choice.predicted_delta_s)):
            if value is not None:
                metrics[key] = value
        metrics["sync/measured_s"] = measured_s
        metrics["sync/explore"] = 1.0 if choice.reason == "explore" else 0.0

    def _attempt(self, version: int, force_full: bool, refresh: bool = True) -> tuple[dict[str, Any], str | None]:
        """One push of ``version``: into the engines' shadow copies, or paused. ``refresh``: a full push also
        updates the sender's delta snapshot."""
        if self.double_buffer:
            return self._shadow_push(version, force_full, refresh)
        return self._paused_push(version, force_full, refresh)

    def _shadow_push(self, version: int, force_full: bool, refresh: bool) -> tuple[dict[str, Any], str | None]:
        """Load into every engine's shadow copy while they serve, verify the shadows, switch, commit."""
        start = time.perf_counter()
        try:
            catch_up = [checked(link, Endpoint.RAYGYM_SHADOW_BEGIN, ShadowBegin(full=force_full), self.timeout_s)
                        for link in self.links]
            result, error = self._push_and_verify(version, force_full, refresh, shadow=True)
            if error is None:
                switch = ShadowSwitch(weight_version=str(version),
                                      abort_all_requests=self.pause_mode == "abort" and not self.inflight_swap)
                switched = [checked(link, Endpoint.RAYGYM_SHADOW_SWITCH, switch, self.timeout_s) for link in self.links]
                _invoke_all(self.trainers[:1], "commit_weights", version, timeout=self.timeout_s)
                result["metrics"]["sync/pause_s"] = max(a.switch_s for a in switched)
                result["metrics"]["sync/shadow_catch_up_s"] = max(a.catch_up_s for a in catch_up)
        except WeightSyncError as exc:  # a shadow could not be prepared or switched
            error, result = str(exc), {}
            _invoke(self.trainers[0], "discard_weights", timeout=self.timeout_s)
        if error is not None:
            for link in self.links:
                try:
                    checked(link, Endpoint.RAYGYM_SHADOW_DISCARD, NoFields(), self.timeout_s)
                except WeightSyncError:
                    pass  # an engine that cannot answer is reported by its health check
        elif result:
            result["metrics"]["sync/shadow_s"] = time.perf_counter() - start
        return result, error

    def _paused_push(self, version: int, force_full: bool, refresh: bool) -> tuple[dict[str, Any], str | None]:
        """Pause, push and verify what can be verified while paused, commit, continue."""
        paused_at = time.perf_counter()
        self._pause()
        try:
            if self.session:
                self._all(Endpoint.BEGIN_WEIGHT_UPDATE, BeginWeightUpdate())
            try:
                result, error = self._push_and_verify(version, force_full, refresh)
            finally:
                if self.session:
                    self._all(Endpoint.END_WEIGHT_UPDATE, NoFields())
            if error is None:
                _invoke_all(self.trainers[:1], "commit_weights", version, timeout=self.timeout_s)
        finally:
            self._continue()
        if error is None:
            result["metrics"]["sync/pause_s"] = time.perf_counter() - paused_at
        return result, error

    def _probe_results(self) -> dict[str, list[ProbeResult]] | str:
        """Every engine's probe against the trainer's forward pass, unjudged, per part: ``"text"``, and
        ``"image"`` for a vision-language model (an error message when an engine could not answer)."""
        lora_path = None
        if self.spec.adapter_endpoints:  # the probe scores what rollouts get: the base plus the run's adapter
            from raygym.lora import ADAPTER_NAME

            lora_path = ADAPTER_NAME
        request = self.probe.generate_request(self.temperature, lora_path=lora_path)
        image = self.image_probe
        # sent alone: stock SGLang takes the image as one pad, and fails batches with images (sglang_images)
        image_request = None if image is None else image.request(self.temperature, sglang=self.engine_kind == "sglang",
                                                                 lora_path=lora_path)
        answers = []
        for link in self.links:
            try:
                answer = EngineProbe.from_answer(checked(link, Endpoint.GENERATE, request, self.timeout_s), request)
                if image is not None and image_request is not None:
                    answer = answer.plus(image.answer(checked(link, Endpoint.GENERATE, image_request, self.timeout_s),
                                                      image_request))
                answers.append(answer)
            except (WeightSyncError, ValueError, KeyError) as exc:
                return f"{link.name}: probe generation failed: {exc}"
        texts = len(request.input_ids or [])
        results: dict[str, list[ProbeResult]] = {part: [] for part in self.probe_parts}
        for answer in answers:
            with_images = () if answer.images is None else (answer.images,)
            trainer = _invoke_all(self.trainers, "probe_log_probs", answer.prefixes, answer.responses, *with_images,
                                  timeout=self.timeout_s)[0]
            results["text"].append(compare_logprobs(answer.logprobs[:texts], trainer[:texts], self.probe_tolerance))
            if image is not None:
                results["image"].append(compare_logprobs(answer.logprobs[texts:], trainer[texts:],
                                                         self.probe_tolerance))
        return results

    def _probe_before_first_sync(self) -> None:
        """The probe on the weights the engines loaded themselves, before the first sync replaces them (part
        of the calibration; skipped when colocated, where engines may hold no memory for generation yet)."""
        if self.verification != "probe" or self.calibration is not None or self.colocate:
            return
        results = self._probe_results()
        if not isinstance(results, str):
            self._before = {part: worst_of(found) for part, found in results.items()}

    def _probe(self, version: int, metrics: dict[str, float]) -> str | None:
        """The engines' log-probs of a seeded probe against the trainer's; None when every engine agrees.

        Each part (text; an image and the text after it) is judged on its own: a wrong vision tower moves only
        the tokens after the image. The first sync calibrates the tolerances
        (:meth:`ProbeCalibration.from_first_sync`: the noise floor on identical weights, capped on the mean by
        ``update_weight_probe_tolerance``); every sync that passes raises the floor to what it measured
        (:meth:`ProbeCalibration.follow`)."""
        results = self._probe_results()
        if isinstance(results, str):
            return results
        slack = HALF_PRECISION_SLACK if self.spec.cast_dtype in ("bfloat16", "float16") else MIN_MEAN
        problems, passed = [], {}
        for part, found in results.items():
            all_of = worst_of(found)
            cal = self._calibrations.get(part)
            if cal is None:
                cal = ProbeCalibration.from_first_sync(all_of, self._before.get(part), cap=self.probe_tolerance,
                                                       slack=slack)
            for link, result in zip(self.links, found, strict=True):
                if not cal.judge(result).ok:
                    problems.append(
                        f"{link.name}: probe log-probs{' after the image' if part == 'image' else ''} differ from the "
                        f"trainer's by {result.trimmed_mean:.2e} on average, {result.trimmed_max:.2e} at worst over "
                        f"{result.tokens} tokens less the {outliers(result.tokens)} farthest (up to "
                        f"{result.max_abs_diff:.2e}) (tolerances {cal.tolerance:.2e} / {cal.max_tolerance:.2e}, from a "
                        f"noise floor of {cal.floor_mean:.2e} / {cal.floor_max:.2e}; update_weight_probe_tolerance="
                        f"{self.probe_tolerance} caps the mean's) at version {version}")
            passed[part] = cal.follow(all_of)  # the honest floor rises as training sharpens the policy
            prefix = "sync/probe_image_" if part == "image" else "sync/probe_"
            metrics.update({prefix + name: value for name, value in (
                ("tokens", float(all_of.tokens)), ("logprob_diff_mean", all_of.mean_abs_diff),
                ("logprob_diff_max", all_of.max_abs_diff), ("floor_mean", cal.floor_mean),
                ("floor_max", cal.floor_max), ("tolerance", cal.tolerance), ("tolerance_max", cal.max_tolerance),
                ("margin", cal.margin(all_of)))})
        if not problems:
            self._calibrations = passed
        return "; ".join(problems) or None

    @property
    def calibration(self) -> ProbeCalibration | None:
        """The text probe's tolerances (None before the first sync)."""
        return self._calibrations.get("text")

    def _all(self, endpoint: Endpoint, body: Any) -> None:
        for link in self.links:
            checked(link, endpoint, body, self.timeout_s)

    @property
    def compares_checksums(self) -> bool:
        """Whether syncs compare per-tensor checksums: of the weights held (raygym's server), or of the tensors
        the engine's workers loaded (vLLM behind raygym's adapter; not for adapters loaded by endpoint)."""
        return self.verification == "checksum" or (self.loaded_checksums and not self.spec.adapter_endpoints)

    def verify(self, version: int, expected: dict[str, str], shadow: bool = False) -> list[str]:
        """Engines whose weight version or checksums differ from ``expected`` (descriptions); ``shadow``:
        of the copy a double-buffered update loaded, before it is served."""
        if self.verification == "probe":
            bad = self.verify_versions(version)
            if bad or not self.compares_checksums:
                return bad
        # LoRA: the adapters only (the base weights never change, hashing them every sync would cost a full pass);
        # loaded checksums: the names sent (the engine knows only what it loaded)
        names = sorted(expected) if self.spec.adapter_config is not None or self.loaded_checksums else None
        body = WeightsChecksum(names=names, shadow=True) if shadow else WeightsChecksum(names=names)

        def ask(link: EngineLink) -> WeightsChecksumResponse | str:
            try:
                answer: WeightsChecksumResponse = checked(link, Endpoint.RAYGYM_WEIGHTS_CHECKSUM, body, self.timeout_s)
                return answer
            except WeightSyncError as exc:
                return str(exc)

        with ThreadPoolExecutor(max_workers=len(self.links), thread_name_prefix="raygym-verify") as pool:
            answers = list(pool.map(ask, self.links))  # every engine hashes its weights at the same time
        bad = []
        for link, answer in zip(self.links, answers, strict=True):
            if isinstance(answer, str):
                bad.append(answer)
                continue
            wrong = [n for n, h in expected.items() if answer.checksums.get(n) != h]
            # asked for every tensor: one the engine holds and the sender never vouched for was left out of the
            # sync (its old bytes would be served under the new version), unless it holds bytes the sync vouched
            # for under another name (a tied head is the embedding under two names; the sender sends it once)
            vouched = set(expected.values())
            uncovered = sorted(n for n, h in answer.checksums.items() if n not in expected and h not in vouched) \
                if names is None else []
            if str(answer.weight_version) != str(version) or wrong or uncovered:
                bad.append(f"{link.name}: weight_version {answer.weight_version!r} (want {version}), "
                           f"{len(wrong)} tensor(s) differ {wrong[:3]}"
                           + (f", {len(uncovered)} not covered by the sync {uncovered[:3]}" if uncovered else ""))
        return bad

    def verify_versions(self, version: int) -> list[str]:
        """Engines whose ``/model_info`` reports another weight version than ``version``."""
        bad = []
        for link in self.links:
            try:
                info: ModelInfo = checked(link, Endpoint.MODEL_INFO, None, self.timeout_s)
            except WeightSyncError as exc:
                bad.append(str(exc))
                continue
            if str(info.weight_version) != str(version):
                bad.append(f"{link.name}: reports weight_version {info.weight_version!r}, want {version}")
        return bad

    def shutdown(self) -> None:
        """Leave the weight-update group (trainer side)."""
        try:
            _invoke(self.trainers[0], "close_weight_sync", timeout=min(self.timeout_s, 30.0))
        except Exception:
            pass

    def _push_and_verify(self, version: int, force_full: bool, refresh: bool, shadow: bool = False
                         ) -> tuple[dict[str, Any], str | None]:
        try:
            results = _invoke_all(self.trainers, "push_weights", version, force_full, refresh, timeout=self.timeout_s)
        except WeightSyncError as exc:
            return {}, str(exc)
        except Exception as exc:  # a Ray task error wraps the WeightSyncError raised in the trainer
            if "WeightSyncError" not in f"{type(exc).__name__} {exc}":
                raise
            _invoke(self.trainers[0], "discard_weights", timeout=self.timeout_s)
            return {}, str(exc)
        result = results[0]
        bad = self.verify(version, result["checksums"], shadow=shadow)
        if bad:
            _invoke(self.trainers[0], "discard_weights", timeout=self.timeout_s)
            return result, "; ".join(bad)
        if self.verification == "probe":
            result["metrics"]["sync/verified_versions"] = float(len(self.links))
        if self.compares_checksums:
            result["metrics"]["sync/verified_tensors"] = float(len(result["checksums"]) * len(self.links))
        return result, None

    def _pause(self) -> None:
        for link in self.links:
            pause = PauseGeneration.model_validate({"mode": self.pause_mode})
            checked(link, Endpoint.PAUSE_GENERATION, pause, self.timeout_s)
        for link in self.links:
            self._flush(link)

    def _flush(self, link: EngineLink) -> None:
        for attempt in range(FLUSH_RETRIES):
            try:
                checked(link, Endpoint.FLUSH_CACHE, None, self.timeout_s)
                return
            except WeightSyncError:
                if attempt == FLUSH_RETRIES // 2:
                    checked(link, Endpoint.ABORT_REQUEST, AbortRequest(abort_all=True), self.timeout_s)
                time.sleep(FLUSH_SLEEP_S)
        raise WeightSyncError(f"engine {link.name}: /flush_cache kept failing after {FLUSH_RETRIES} tries "
                              f"(requests still pending? pause mode {self.pause_mode!r})")

    def _continue(self) -> None:
        for link in self.links:
            try:
                checked(link, Endpoint.CONTINUE_GENERATION, ContinueGeneration(), self.timeout_s)
            except WeightSyncError:
                pass  # an engine that cannot continue is reported by its health check
