"""Verifying weights an engine will not checksum: a probe of log-probs (pure; no torch, no ray).

After a sync, every engine answers one ``/generate`` request: a few seeded samples from fixed prompts, and
fixed token sequences it scores teacher-forced (``input_token_logprobs``, when the run samples at temperature
1, where the engines' raw prompt log-probs are the trainer's). The trainer scores the same tokens with its own
forward pass. An engine whose weights are not the trainer's (a tensor dropped, a bucket misapplied, a stale
version) disagrees by more than the numerical noise between the two (bf16 kernels on the engine, fp32 on a
CPU trainer).

How much more is calibrated per run (:class:`ProbeCalibration`): the first sync loads identical weights, so
its differences (and, before it, those of the weights the engines loaded themselves) are the noise floor of
this engine, dtype and model; every later sync must stay within a few times that floor (with small absolute
minimums), on the mean and on the worst token. A fixed
tolerance cannot do this: 0.1 is three orders of magnitude above the float32 floor (~1e-4) and let wrong
MoE experts (0.05-0.18 off) and a 0.11 worst token through.

>>> p = ProbeSpec()
>>> request = p.generate_request(temperature=1.0)
>>> request.input_ids[0][:4], request.sampling_params[0]["max_new_tokens"], len(request.input_ids)
([1, 2, 3, 4], 8, 6)
>>> compare_logprobs([[-1.0, -2.0]], [[-1.01, -2.03]], tolerance=0.05)
ProbeResult(tokens=2, mean_abs_diff=0.02, max_abs_diff=0.03, ok=True)
>>> c = ProbeCalibration.measure(floor_mean=2e-5, floor_max=1e-4, cap=0.1)
>>> c.judge(compare_logprobs([[-1.0, -2.0]], [[-1.0001, -2.0]], tolerance=c.tolerance)).ok
True
>>> c.judge(compare_logprobs([[-1.0] * 9 + [-2.0]], [[-1.0] * 9 + [-2.002]], tolerance=c.tolerance)).ok  # one token
False
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from raygym.engine_api.protocol import GenerateRequest, GenerateResponse

# Calibration (see ProbeCalibration), from measurements on the builtin tiny Qwen3 (docs/engines.md, "The probe"):
# over 200 honest syncs of a bf16 engine whose model moved far (lr 1e-2), the mean difference stayed within
# 0.4x-2.1x of the first sync's and the worst token within 0.6x-8x of its (single tokens spike: bf16 decode
# against an fp32 forward; the 5th largest stayed within 0.5x-2.1x); float32 engines match to 1e-7 (mean) / 5e-7 (worst). One tensor scaled by 1.01 moves
# the float32 probe by 1.5e-4 / 5e-4 (the dense model's layer-1 up_proj) down to 5e-6 / 7e-5 (one expert's
# down_proj in the MoE): the minimums below sit under that and 20-100x above the float32 floor.
FACTOR = 4.0  # on the mean
MAX_FACTOR = 16.0  # on the worst token
MIN_MEAN = 2e-6  # absolute floors of the tolerances: a float32 engine may match the trainer bit for bit
MIN_MAX = 5e-5
SAME_WEIGHTS = 2.0  # two measurements within this ratio of means (plus a slack) saw the same weights
# The slack when the payload is cast to 16 bits: the engine then serves rounded weights the probe before the first
# sync did not see (a float32 engine loading bf16 payloads: ~1e-3 on the tiny model); vLLM's unpacked CPU MoE
# experts were 0.05-0.18 off on most tokens.
HALF_PRECISION_SLACK = 1e-2


def _sequence(seed: int, length: int, low: int, high: int) -> tuple[int, ...]:
    """A fixed pseudo-random token sequence in ``[low, high)`` (an LCG: the same on every host and Python)."""
    state, out = seed, []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(low + (state >> 33) % (high - low))
    return tuple(out)


@dataclass(frozen=True)
class ProbeSpec:
    """Fixed prompts to sample from and fixed sequences to score (token ids small enough for any vocabulary:
    the builtin tiny model has 50).

    ``scored`` sequences of ``scored_len`` tokens are scored teacher-forced at temperature 1: every position
    is one more token compared for the price of one prefill, so a wrong tensor shows on many tokens."""

    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 12, 13, 14, 15, 3))
    new_tokens: int = 8
    seed: int = 20240601
    scored: int = 4
    scored_len: int = 48
    token_range: tuple[int, int] = (2, 48)

    def sequences(self) -> list[list[int]]:
        """The teacher-forced sequences (deterministic in ``seed``).

        >>> ProbeSpec(scored=1, scored_len=5).sequences()
        [[6, 9, 29, 45, 25]]
        """
        low, high = self.token_range
        return [list(_sequence(self.seed + i, self.scored_len, low, high)) for i in range(self.scored)]

    def teacher_forced(self, temperature: float) -> bool:
        """Whether prompt log-probs are compared: engines report them from raw logits (SGLang, vLLM's
        ``prompt_logprobs`` and raygym's server alike), which the trainer scores only at temperature 1."""
        return temperature == 1.0 and self.scored > 0

    def generate_request(self, temperature: float, lora_path: str | None = None) -> GenerateRequest:
        """The ``/generate`` request: one seeded sample per prompt, unfiltered, with output log-probs, then (at
        temperature 1, without an adapter) the scored sequences with their prompt log-probs (``lora_path``: with
        that adapter; prompt log-probs are then left out: vLLM 0.32's CPU LoRA path fails computing them through
        an adapted ``lm_head``, and its engine dies).

        >>> len(ProbeSpec().generate_request(1.0, lora_path="raygym").input_ids)
        2
        """
        params = [{"max_new_tokens": self.new_tokens, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                   "ignore_eos": True, "sampling_seed": self.seed + i} for i in range(len(self.prompts))]
        inputs = [list(p) for p in self.prompts]
        if not self.teacher_forced(temperature) or lora_path is not None:
            return GenerateRequest(input_ids=inputs, sampling_params=params, return_logprob=True, lora_path=lora_path)
        scored = self.sequences()
        params += [{**params[0], "max_new_tokens": 1, "sampling_seed": self.seed + len(inputs) + i}
                   for i in range(len(scored))]
        return GenerateRequest(input_ids=inputs + scored, sampling_params=params, return_logprob=True,
                               logprob_start_len=0, lora_path=lora_path)


@dataclass(frozen=True)
class ImageProbe:
    """The probe's item for a vision-language model: a prompt that opens with one fixed image, then text the
    engines score after it. Only the image tower's output sets the text's log-probs apart from the text-only
    items', so an engine that holds the language model right and the tower wrong fails here (engines that take
    a checksum of every tensor catch it anyway; stock SGLang's probe would not).

    ``tokens``: the prompt with the image's pad widened (what the trainer and raygym's engines take), ``prefix``
    of them up to the image's last pad (not compared: the trainer embeds the image there); ``one_pad``: the same
    prompt with the image as one pad, as stock SGLang takes it (:mod:`raygym.engines.sglang_images`); ``image``:
    the PNG data URL.

    >>> probe = ImageProbe(tokens=(50, 9, 9, 9, 9, 52, 5, 6, 7), prefix=5, one_pad=(50, 9, 52, 5, 6, 7), image="data:")
    >>> probe.request(1.0, sglang=False).input_ids, probe.request(1.0, sglang=True).input_ids
    ([50, 9, 9, 9, 9, 52, 5, 6, 7], [50, 9, 52, 5, 6, 7])
    >>> probe.request(0.7, sglang=False).sampling_params["max_new_tokens"]
    8
    """

    tokens: tuple[int, ...]
    prefix: int
    one_pad: tuple[int, ...]
    image: str
    new_tokens: int = 8
    seed: int = 20240607

    def request(self, temperature: float, *, sglang: bool, lora_path: str | None = None) -> GenerateRequest:
        """One ``/generate``: scored teacher-forced after the image at temperature 1 without an adapter (as
        :meth:`ProbeSpec.generate_request` does), else one seeded sample of ``new_tokens`` after the prompt;
        ``sglang``: with the image as one pad."""
        forced = temperature == 1.0 and lora_path is None
        params = {"max_new_tokens": 1 if forced else self.new_tokens, "temperature": temperature, "top_p": 1.0,
                  "top_k": -1, "ignore_eos": True, "sampling_seed": self.seed}
        return GenerateRequest(input_ids=list(self.one_pad if sglang else self.tokens), image_data=[self.image],
                               sampling_params=params, return_logprob=True, logprob_start_len=0 if forced else None,
                               lora_path=lora_path)

    def answer(self, answer: Any, request: GenerateRequest) -> EngineProbe:
        """What one engine answered to :meth:`request`: the tokens after the image and their log-probs (the
        scored prompt's, then the generated ones), to be scored by the trainer with the image."""
        item = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
        if not isinstance(item, GenerateResponse) or not item.meta_info.output_token_logprobs:
            raise ValueError("probe: the image prompt's answer carries no output_token_logprobs")
        tokens, values = item.tokens_and_logprobs()
        prompt = list(self.tokens)
        if request.logprob_start_len != 0:
            return EngineProbe([prompt], [tokens], [values], [[self.image]])
        entries = item.meta_info.input_token_logprobs or []
        if len(entries) != len(prompt):
            raise ValueError(f"probe: {len(entries)} prompt log-probs for the image prompt of {len(prompt)} tokens")
        scored = [float(e[0]) for e in entries[self.prefix:] if e and e[0] is not None]
        if len(scored) != len(prompt) - self.prefix:
            raise ValueError(f"probe: {len(scored)} log-probs for the {len(prompt) - self.prefix} tokens after the image")
        return EngineProbe([prompt[: self.prefix]], [prompt[self.prefix:] + tokens], [scored + values], [[self.image]])


@dataclass(frozen=True)
class EngineProbe:
    """What one engine answered: per request item, the tokens the trainer must score after ``prefixes`` and
    the engine's log-probs of them (the scored prompt's tokens after its first, then the generated ones)."""

    prefixes: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    images: list[list[str]] | None = None  # each item's images (PNG data URLs), where any has one

    def plus(self, other: EngineProbe) -> EngineProbe:
        """Both answers' items, in order (``images`` kept for every item where either has one).

        >>> EngineProbe([[1]], [[2]], [[-0.5]]).plus(EngineProbe([[3]], [[4]], [[-0.1]], [["img"]])).images
        [[], ['img']]
        """
        images = None
        if self.images is not None or other.images is not None:
            images = (self.images or [[] for _ in self.prefixes]) + (other.images or [[] for _ in other.prefixes])
        return EngineProbe(self.prefixes + other.prefixes, self.responses + other.responses,
                           self.logprobs + other.logprobs, images)

    @classmethod
    def from_answer(cls, answer: Any, request: GenerateRequest) -> EngineProbe:
        """Read the answer to :meth:`ProbeSpec.generate_request` (a list of
        :class:`~raygym.engine_api.protocol.GenerateResponse`, one per item of ``request``). Items whose prompt
        log-probs were asked for are scored from their first token on."""
        if not isinstance(answer, list):
            raise ValueError(f"probe: expected a list of answers, got {type(answer).__name__}")
        inputs = [p for p in request.input_ids or [] if isinstance(p, list)]
        if len(inputs) != len(answer):
            raise ValueError(f"probe: {len(answer)} answers to {len(inputs)} prompts")
        forced = request.logprob_start_len == 0
        prefixes, responses, logprobs = [], [], []
        for prompt, item in zip(inputs, answer, strict=True):
            if not item.meta_info.output_token_logprobs:
                raise ValueError("probe: an answer carries no output_token_logprobs")
            tokens, values = item.tokens_and_logprobs()
            if forced and len(prompt) > 1:
                entries = item.meta_info.input_token_logprobs or []
                scored = [float(e[0]) for e in entries[1:] if e and e[0] is not None]
                if len(scored) != len(prompt) - 1:
                    raise ValueError(f"probe: {len(scored)} prompt log-probs for a prompt of {len(prompt)} tokens")
                prefixes.append(prompt[:1])
                responses.append(prompt[1:] + tokens)
                logprobs.append(scored + values)
            else:
                prefixes.append(prompt)
                responses.append(tokens)
                logprobs.append(values)
        return cls(prefixes, responses, logprobs)


@dataclass(frozen=True)
class ProbeResult:
    """The differences of one probe. ``trimmed_mean`` / ``trimmed_max``: the same with the largest
    :func:`outliers` left out (what is judged): a token whose top-k experts tie in an MoE layer is routed
    differently by engine and trainer (0.02 apart where the rest agree to 1e-4), and bf16 decode spikes on single
    tokens; a wrong tensor moves far more tokens than that."""

    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    ok: bool
    trimmed_mean: float = field(default=-1.0, repr=False)
    trimmed_max: float = field(default=-1.0, repr=False)

    def __post_init__(self) -> None:
        if self.trimmed_mean < 0:
            object.__setattr__(self, "trimmed_mean", self.mean_abs_diff)
        if self.trimmed_max < 0:
            object.__setattr__(self, "trimmed_max", self.max_abs_diff)


def outliers(tokens: int) -> int:
    """How many of the largest differences the judged statistics leave out: one token in 64.

    >>> outliers(222), outliers(40)
    (3, 0)
    """
    return tokens // 64


def compare_logprobs(engine: list[list[float]], trainer: list[list[float]], tolerance: float,
                     max_tolerance: float | None = None) -> ProbeResult:
    """Mean and max absolute difference over every token; ``ok`` when the mean is within ``tolerance`` and
    (when given) the worst token within ``max_tolerance``, both without the :func:`outliers`."""
    diffs: list[float] = []
    for e_row, t_row in zip(engine, trainer, strict=True):
        if len(e_row) != len(t_row):
            raise ValueError(f"probe: {len(e_row)} engine log-probs vs {len(t_row)} from the trainer")
        diffs.extend(abs(a - b) for a, b in zip(e_row, t_row, strict=True))
    if not diffs:
        return ProbeResult(0, 0.0, 0.0, False)
    kept = sorted(diffs)[: len(diffs) - outliers(len(diffs))]
    mean, trimmed_mean = sum(diffs) / len(diffs), sum(kept) / len(kept)
    ok = trimmed_mean <= tolerance and (max_tolerance is None or kept[-1] <= max_tolerance)
    return ProbeResult(len(diffs), round(mean, 7), round(max(diffs), 7), ok, round(trimmed_mean, 7),
                       round(kept[-1], 7))


def worst_of(results: list[ProbeResult]) -> ProbeResult:
    """Each statistic's worst over several engines' results (``ok`` when all are).

    >>> worst_of([ProbeResult(9, 0.1, 0.2, True), ProbeResult(8, 0.3, 0.1, False)])
    ProbeResult(tokens=8, mean_abs_diff=0.3, max_abs_diff=0.2, ok=False)
    """
    return ProbeResult(min(r.tokens for r in results), max(r.mean_abs_diff for r in results),
                       max(r.max_abs_diff for r in results), all(r.ok for r in results),
                       max(r.trimmed_mean for r in results), max(r.trimmed_max for r in results))


@dataclass(frozen=True)
class ProbeCalibration:
    """Tolerances of one run's probe, from its noise floor: the differences the first sync measured, when
    engine and trainer held identical weights, raised by every later sync that passed (:meth:`follow`).

    ``tolerance`` (mean) = ``max(FACTOR * floor_mean, MIN_MEAN)``, at most ``cap`` (the user's
    ``update_weight_probe_tolerance``); ``max_tolerance`` (worst token) = ``max(MAX_FACTOR * floor_max, MIN_MAX)``.

    >>> c = ProbeCalibration.measure(floor_mean=0.001, floor_max=0.004, cap=0.1)
    >>> round(c.tolerance, 6), round(c.max_tolerance, 6)
    (0.004, 0.064)
    >>> round(ProbeCalibration.measure(floor_mean=0.05, floor_max=0.3, cap=0.1).tolerance, 6)
    0.1
    """

    floor_mean: float
    floor_max: float
    tolerance: float
    max_tolerance: float
    cap: float = math.inf

    @classmethod
    def measure(cls, floor_mean: float, floor_max: float, cap: float) -> ProbeCalibration:
        """The calibration for a noise floor of ``floor_mean`` / ``floor_max``."""
        return cls(floor_mean, floor_max, min(cap, max(FACTOR * floor_mean, MIN_MEAN)),
                   max(MAX_FACTOR * floor_max, MIN_MAX), cap)

    @classmethod
    def from_first_sync(cls, after: ProbeResult, before: ProbeResult | None, cap: float,
                        slack: float = MIN_MEAN) -> ProbeCalibration:
        """The floor from the first sync's probe (``after``) and, where it ran, the probe of the weights the
        engines loaded themselves, taken just before (``before``). A fresh run's trainer is at most one step
        from the checkpoint, so both saw the same weights: the floor is the larger of the two (more of the
        noise's tail). Where they disagree, the smaller one saw the same weights: a resumed run's ``before``
        compares the checkpoint with the resumed weights; an ``after`` far above ``before`` means the first
        update itself broke something (vLLM's unpacked CPU MoE experts did), and then it fails. ``slack``: how much
        more than ``SAME_WEIGHTS`` times the smaller mean still counts as the same weights
        (:data:`HALF_PRECISION_SLACK` where the payload is rounded to 16 bits).

        >>> fresh = ProbeCalibration.from_first_sync(ProbeResult(9, 1e-3, 4e-3, True), ProbeResult(9, 8e-4, 5e-3, True), 0.1)
        >>> fresh.floor_mean, fresh.floor_max
        (0.001, 0.005)
        >>> broken = ProbeCalibration.from_first_sync(ProbeResult(9, 0.03, 0.15, True), ProbeResult(9, 1e-5, 1e-4, True), 0.1)
        >>> broken.judge(ProbeResult(9, 0.03, 0.15, True)).ok
        False
        """
        seen = [after] if before is None or before.tokens == 0 else [before, after]
        low = min(r.trimmed_mean for r in seen)
        same = [r for r in seen if r.trimmed_mean <= SAME_WEIGHTS * low + slack]
        return cls.measure(max(r.trimmed_mean for r in same), max(r.trimmed_max for r in same), cap)

    def follow(self, passed: ProbeResult) -> ProbeCalibration:
        """The calibration for the next sync after ``passed`` was judged honest: the floor rises to what it
        measured. The honest difference grows as training sharpens the policy (a float16 engine's probe rose from
        1e-4 to 4e-4 over 35 steps of the tiny preset, tracking the rollouts' own engine/trainer mismatch), so a
        floor fixed at the first sync, on a near-uniform random model, fails honest syncs; a wrong tensor is a
        jump from the last honest sync, which the factors still catch. The floor never falls.

        >>> c = ProbeCalibration.measure(floor_mean=1e-4, floor_max=4e-4, cap=0.1)
        >>> later = c.follow(ProbeResult(222, 3e-4, 1e-3, True, 3e-4, 8e-4))
        >>> later.judge(ProbeResult(222, 9e-4, 3e-3, True, 9e-4, 3e-3)).ok, c.judge(ProbeResult(222, 9e-4, 3e-3, True, 9e-4, 3e-3)).ok
        (True, False)
        >>> later.follow(ProbeResult(222, 1e-5, 1e-5, True, 1e-5, 1e-5)).floor_mean
        0.0003
        """
        return ProbeCalibration.measure(max(self.floor_mean, passed.trimmed_mean),
                                        max(self.floor_max, passed.trimmed_max), self.cap)

    def judge(self, result: ProbeResult) -> ProbeResult:
        """``result`` with ``ok`` decided by these tolerances (on its trimmed statistics)."""
        ok = result.tokens > 0 and result.trimmed_mean <= self.tolerance and result.trimmed_max <= self.max_tolerance
        return ProbeResult(result.tokens, result.mean_abs_diff, result.max_abs_diff, ok, result.trimmed_mean,
                           result.trimmed_max)

    def margin(self, result: ProbeResult) -> float:
        """How close ``result`` came to failing: above 1 fails."""
        return max(result.trimmed_mean / self.tolerance, result.trimmed_max / self.max_tolerance)
