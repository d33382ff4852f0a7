"""RolloutManager: prompts -> routed ``/generate`` requests -> samples -> rewards -> kept groups.

A plain class with async methods: the driver wraps it as an async Ray actor, tests call it
directly. Use ONE event loop for a manager's whole life (its HTTP clients and health monitor are
bound to it).

Per step (:meth:`RolloutManager.generate`) it returns ``rollout_batch_size`` groups of
``n_samples_per_prompt`` samples, contiguous, ordered by the data order of their prompts
(``group_index`` 0..B-1, ``sample_index`` 0..n-1). Every group is one batched HTTP request (one
prompt and one seeded ``sampling_params`` per sample; with ``custom_generate_function`` one request
per sample), routed by least outstanding requests; rewards are scored as groups finish, off the
event loop.

DAPO dynamic sampling (``dynamic_sampling_filter_path``): each round samples
``max(over_sampling_batch_size, groups still missing)`` prompts (slime's meaning: the prompts per
sampling round, validated >= ``rollout_batch_size``; unset = just the missing ones); groups the
predicate rejects are dropped;
once ``rollout_batch_size`` groups are kept, what is still in flight is cancelled and aborted on the
engines. Prompts of aborted groups are consumed (the data position moved past them). After
``max_sampling_rounds`` rounds without enough groups it raises :class:`RaygymError`.

Hooks (callables or ``"pkg.mod:fn"`` import paths, sync or async):

- ``custom_generate_function(args, sample, sampling_params, generate) -> Sample`` replaces one
  sample's generation (multi-turn, tools). ``args`` is the ``TrainConfig``; ``sample`` arrives with
  its prompt fields set; ``generate(input_ids: list[int], sampling_params: dict) -> GenerateResponse`` is
  an async function that sends one routed (and, with fault tolerance, retried) ``/generate`` request and
  returns the engine's answer (:class:`raygym.engine_api.protocol.GenerateResponse`: ``text``, ``output_ids``,
  ``meta_info`` with ``output_token_logprobs`` and ``finish_reason``; its fields read as attributes or
  as the JSON reads, ``answer["meta_info"]["finish_reason"]["type"]``). The function returns the sample with
  ``response_tokens``, ``response_text``, ``rollout_log_probs`` and ``loss_mask`` (one entry per
  response token: 1 = policy token, 0 = tool/user token) and ``finish_reason`` filled.
- ``rollout_function(args, rollout_id, manager) -> list[Sample]`` replaces the whole step; it may
  use ``manager.dataset``, ``manager.sampling_params()`` and ``await manager.generate_group(row, params)``.

Custom post-processing (``custom_reward_post_process_function``) runs on the final batch.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raygym import routed_experts
from raygym.data.prompts import (
    PromptDataset,
    PromptRow,
    dataset_from_config,
    dataset_options,
    eval_dataset_urls,
    load_eval_datasets,
)
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.engines import sglang_images
from raygym.engines.health import ClientFactory, EnginePool
from raygym.engines.launch.lora import adapter_request_fields
from raygym.errors import RaygymError
from raygym.rewards.scoring import (
    RewardModel,
    load_callable,
    reward_component_metrics,
    reward_model_from_config,
)
from raygym.rollout import tasks
from raygym.rollout.dynamic_sampling import collect_groups
from raygym.rollout.filters import GroupFilter, load_group_filter
from raygym.rollout.responses import (
    MAX_CONTINUATIONS,
    continuation_budget,
    continuation_params,
    derive_sampling_seed,
    image_fields,
    token_versions,
    weight_version_of,
)
from raygym.rollout.rollout_metrics import eval_dataset_metrics, rollout_batch_metrics
from raygym.rollout.settings import RolloutSettings
from raygym.types import Sample

if TYPE_CHECKING:
    from raygym.config.run import TrainConfig
    from raygym.rollout.stream import AsyncStream


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _since(counts: dict[str, int], mark: dict[str, int]) -> dict[str, int]:
    """What each running count of the engine pool grew by since ``mark`` (empty: since the start)."""
    return {k: v - mark.get(k, 0) for k, v in counts.items()}


class RolloutManager:
    """Generates each step's samples and the eval metrics over a list of ``EngineActor`` handles.

    >>> manager = RolloutManager(cfg, engines, tokenizer_path)            # doctest: +SKIP
    >>> samples = await manager.generate(rollout_id=0, weight_version=0)  # doctest: +SKIP
    >>> manager.metrics()["rollout/reward_mean"]                           # doctest: +SKIP
    """

    def __init__(
        self,
        cfg: TrainConfig,
        engine_handles: list[Any],
        tokenizer_path: str,
        *,
        client_factory: ClientFactory | None = None,
        dataset: PromptDataset | None = None,
        eval_datasets: dict[str, PromptDataset] | None = None,
        reward_model: RewardModel | None = None,
        data_cache_dir: str | None = None,
        request_timeout: float | None = None,
        max_sampling_rounds: int = 8,
        pass_threshold: float = 1.0,
        judge: Any = None,
        teacher: Any = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.settings = RolloutSettings.from_config(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.dataset = dataset if dataset is not None else dataset_from_config(cfg, self.tokenizer, data_cache_dir)
        if eval_datasets is None:
            options = {k: v for k, v in dataset_options(cfg).items() if k != "shuffle"}
            eval_datasets = load_eval_datasets(eval_dataset_urls(cfg), self.tokenizer, data_cache_dir, **options)
        self.eval_datasets = eval_datasets
        # Environments, LLM judge, distillation (raygym/rollout/tasks.py): judge is a raygym.rewards.judge.JudgeClient,
        # teacher a raygym.rewards.distill.TeacherScorer.
        self.judge, self.teacher = judge, teacher
        self._custom_generate = tasks.episode_runner(
            self.settings, self.tokenizer,
            load_callable(self.settings.custom_generate_function, "custom_generate_function"),
            cfg.chat_template_kwargs())
        self.rewards = (reward_model or tasks.task_reward_model(cfg, judge, self._custom_generate)
                        or reward_model_from_config(cfg))
        self.group_filter: GroupFilter | None = load_group_filter(self.settings.dynamic_sampling_filter_path)
        self._rollout_function = load_callable(self.settings.rollout_function, "rollout_function")
        s = self.settings
        self.image_tokens = sglang_images.tokenizer_image_tokens(self.tokenizer)  # None for a text model
        self.pool = EnginePool(
            engine_handles,
            fault_tolerance=s.use_fault_tolerance,
            client_factory=client_factory or sglang_images.client_factory(  # stock SGLang: one pad per image
                cfg.recipe.rollout_engine, self.image_tokens, request_timeout),
            request_timeout=request_timeout,
            health_interval=s.rollout_health_check_interval,
            health_timeout=s.rollout_health_check_timeout,
            health_first_wait=s.rollout_health_check_first_wait,
            request_fields={**adapter_request_fields(cfg.recipe),
                            **routed_experts.request_fields(cfg.recipe.use_rollout_routing_replay)},
        )
        self.max_sampling_rounds = max_sampling_rounds
        self.pass_threshold = pass_threshold  # a sample "passes" for pass@k when reward >= this
        self.weight_version = 0
        self.continue_aborted = False  # partial rollouts: fully asynchronous runs continue what a sync aborted
        self.stream: AsyncStream | None = None  # fully_async: the producer (raygym/rollout/stream.py)
        self._resumed_pending: list[int] = []  # keys a checkpoint kept, generated first by the stream
        self._counts_mark: dict[str, int] = {}  # the pool's running counts up to the last take (fully async)
        self.continued = 0  # continuation requests sent
        self._started = False
        self._metrics: dict[str, float] = {}
        self._seen: list[Sample] = []  # every sample generated this step (kept or not)
        self._trace_budget = 0
        self._seed_scope: tuple[Any, ...] = ("rollout", 0)
        self._group_counter = 0  # groups requested in the current scope (names their seeds)
        self._eval_samples: dict[str, list[Sample]] = {}

    # --- lifecycle and driver-facing state -----------------------------------------------------

    async def _ensure_started(self) -> None:
        if not self._started:
            await self.pool.start()
            self._started = True

    async def close(self) -> None:
        await self.pool.close()
        self.rewards.close()
        await tasks.close_episode_runner(self._custom_generate)
        if self.judge is not None:
            await self.judge.close()

    def use_engine_api_key(self, key: str) -> None:
        """The run's engine API key, sent with every request (call before the first one)."""
        from raygym.engine_api.auth import use_engine_api_key

        use_engine_api_key(key)

    def engines_needing_weights(self) -> list[int]:
        """Engines restarted after a failure that must receive the current weights (then call
        :meth:`mark_engine_synced`)."""
        return self.pool.engines_needing_weights()

    def mark_engine_synced(self, engine_index: int, weight_version: int) -> bool:
        """Return a restarted engine to the router; True if ``weight_version`` is the current one."""
        return self.pool.mark_engine_synced(engine_index, weight_version)

    def set_weight_version(self, weight_version: int) -> None:
        """Every engine in rotation now holds ``weight_version`` (a caller that knows which engines a sync reached
        calls :meth:`apply_sync` instead)."""
        self.weight_version = weight_version
        self.pool.set_weight_version(weight_version)
        if self.stream is not None:
            self.stream.wake()

    def apply_sync(self, weight_version: int, reached: list[int]) -> list[int]:
        """A verified weight sync put ``weight_version`` on engines ``reached`` (the driver's fleet, after its
        push): they serve it, restarted ones among them return to rotation, and every other engine in rotation
        leaves it (its requests in flight move elsewhere) until a sync reaches it. Returns the engines that
        left."""
        self.weight_version = weight_version
        left = self.pool.apply_sync(weight_version, reached)
        if self.stream is not None:
            self.stream.wake()
        return left

    def hold_back(self, engine_indexes: list[int]) -> list[int]:
        """Engines a sync being pushed does not reach: out of rotation now, before :meth:`apply_sync`."""
        return self.pool.hold_back(engine_indexes)

    async def report_engine_failure(self, engine_index: int, reason: str) -> None:
        """The driver found engine ``engine_index``'s server dead (outside a request): restart it in the
        background, as after a failed request."""
        await self._ensure_started()
        await self.pool.report_failure(engine_index, reason)

    def engine_states(self) -> list[str]:
        """``healthy`` | ``dead`` | ``needs_weights`` | ``lost`` per engine (push weights to the healthy and
        needs_weights ones; a lost engine's actor is gone and waits for :meth:`replace_engine`)."""
        return [self.pool.router.state(i) for i in range(self.pool.router.num_engines)]

    def mark_engine_lost(self, engine_index: int, reason: str) -> None:
        """Engine ``engine_index``'s actor is gone (its node died): no traffic until it is replaced."""
        self.pool.mark_lost(engine_index, reason)

    async def replace_engine(self, engine_index: int, handle: Any) -> None:
        """A new started actor serves engine ``engine_index``; it gets traffic once it holds the current
        weights (:meth:`mark_engine_synced`)."""
        await self._ensure_started()
        await self.pool.replace_engine(engine_index, handle)

    def data_state(self) -> dict[str, Any]:
        """The training data position, for checkpoints; in a fully asynchronous run also the prompts started
        and not yet trained (``async_pending``: their keys), which a resumed run generates first."""
        state: dict[str, Any] = {"train": self.dataset.state_dict()}
        if self.stream is not None:
            state["async_pending"] = self.stream.pending_keys()
        return state

    def data_metrics(self) -> dict[str, float]:
        """The training data's load-time counts (``data/*``, :meth:`PromptDataset.load_metrics`)."""
        return self.dataset.load_metrics()

    def load_data_state(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["train"])
        self._resumed_pending = [int(k) for k in state.get("async_pending", [])]

    # --- fully asynchronous generation (raygym/rollout/stream.py) ------------------------------------

    async def start_stream(self, first_step: int, weight_version: int, max_staleness: int, policy: str) -> None:
        """Start generating continuously for steps ``first_step`` on (``fully_async``) with the engines serving
        ``weight_version``: at most ``max_staleness`` steps ahead of the trainer; the prompts a resumed
        checkpoint kept come first."""
        from raygym.rollout.stream import AsyncStream

        await self._ensure_started()
        self.set_weight_version(weight_version)
        if self.stream is not None:
            raise RaygymError("start_stream: the stream is already running")
        self.continue_aborted = True
        if self.settings.use_fault_tolerance:
            self.pool.monitor.activate()
        self.stream = AsyncStream(self, batch_size=self.settings.rollout_batch_size, max_staleness=max_staleness,
                                  policy=policy, first_step=first_step, pending=self._resumed_pending)
        self._resumed_pending = []
        self.stream.start()

    async def take(self, step: int) -> list[Sample]:
        """The groups step ``step`` trains on (fully asynchronous runs): ``rollout_batch_size`` groups whose
        every token comes from a policy version ``>= step - max_staleness``, in the order they completed.
        :meth:`metrics` then describes them."""
        if self.stream is None:
            raise RaygymError("take() before start_stream()")
        samples, stream_metrics = await self.stream.take(step)
        self.rewards.post_process(samples)
        if self.teacher is not None:
            await self.teacher.score(samples)
        counts = self.pool.counts()
        stats = {"kept": self.settings.rollout_batch_size, "dropped": int(stream_metrics["async/filtered_groups"]),
                 "surplus": 0, "aborted": 0, "rounds": 0}
        self._metrics = self._step_metrics(samples, stream_metrics["async/interval_s"], stats,
                                           _since(counts, self._counts_mark))
        self._metrics.update(stream_metrics)
        self._seen, self._counts_mark = [], counts  # generated since: the next step's
        return samples

    async def stop_stream(self) -> None:
        """Stop generating (what is in flight is cancelled and aborted on the engines)."""
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
            self.continue_aborted = False
            self.pool.monitor.deactivate()

    def metrics(self) -> dict[str, float]:
        """Metrics of the last :meth:`generate` (``rollout/*``)."""
        return dict(self._metrics)

    def eval_samples(self) -> dict[str, list[Sample]]:
        """The samples of the last :meth:`evaluate`, per eval dataset."""
        return dict(self._eval_samples)

    # --- requests -------------------------------------------------------------------------------

    def sampling_params(self, evaluation: bool = False) -> dict[str, Any]:
        """SGLang ``sampling_params`` for rollout (or eval), ``sglang_request_params`` merged last. A
        vision-language model's image placeholder tokens stop a response: sampled, the engines would take one
        for another image when the response is continued (after an abort, or as the next turn's context)."""
        s = self.settings
        params: dict[str, Any] = {
            "temperature": s.rollout_temperature,
            "top_p": s.eval_top_p if evaluation else s.rollout_top_p,
            "max_new_tokens": s.eval_max_response_len if evaluation else s.rollout_max_response_len,
        }
        stops = [*(s.rollout_stop_token_ids or []), *(self.image_tokens or [])]
        if stops:
            params["stop_token_ids"] = list(dict.fromkeys(stops))
        params.update(s.sglang_request_params or {})
        return params

    async def _send(self, input_ids: list[int], sampling_params: dict[str, Any],
                    trace: dict[str, Any] | None = None, images: list[str] | None = None) -> tuple[int, GenerateResponse]:
        extra: dict[str, Any] = {"image_data": list(images)} if images else {}  # unset, not null, for text
        request = GenerateRequest(input_ids=list(input_ids), sampling_params=dict(sampling_params), return_logprob=True,
                                  **extra)
        engine, answer = await self.pool.request(request, trace)
        if isinstance(answer, list):
            raise RaygymError(f"{self.pool.engine_name(engine)} answered one prompt with {len(answer)} outputs")
        return engine, answer

    def _fill(self, sample: Sample, response: GenerateResponse, engine: int, *, extend: bool = False) -> None:
        """Read one ``/generate`` answer into ``sample`` (``extend``: append it, a continuation of the response
        so far)."""
        meta = response.meta_info
        tokens, rollout_log_probs = response.tokens_and_logprobs()
        versions = token_versions(meta, len(tokens), self.weight_version)
        text = response.text
        if extend:
            sample.response_tokens += tokens
            sample.rollout_log_probs += rollout_log_probs
            sample.token_versions += versions
            sample.response_text += text
        else:
            sample.response_tokens, sample.rollout_log_probs = tokens, rollout_log_probs
            sample.token_versions, sample.response_text = versions, text
        sample.loss_mask = [1] * len(sample.response_tokens)
        sample.finish_reason = response.finish_type
        sample.status = "truncated" if sample.finish_reason == "length" else "completed"
        sample.weight_version = min(sample.token_versions, default=weight_version_of(meta, self.weight_version))
        sample.engine = self.pool.engine_name(engine)
        if self.pool.request_fields.get(routed_experts.REQUEST_FIELD):  # MoE routing replay
            routed_experts.read_into(sample, meta, extending=extend)

    async def _continue_aborted(self, samples: list[Sample], params: list[dict[str, Any]]) -> None:
        """Partial rollouts (``fully_async``): a response the engine aborted for a weight update (stock SGLang
        and vLLM pause by aborting) is continued on the new weights, from its prompt and tokens so far, until it
        ends by itself; each part keeps its own tokens' versions and log-probs."""
        for segment in range(1, MAX_CONTINUATIONS + 1):
            todo = [(s, p) for s, p in zip(samples, params, strict=True) if s.finish_reason == "abort"
                    and continuation_budget(s, p) > 0]
            if not todo:
                return
            self.continued += len(todo)
            request = GenerateRequest(input_ids=[list(s.prompt_tokens) + list(s.response_tokens) for s, _ in todo],
                                      sampling_params=[continuation_params(s, p, segment) for s, p in todo],
                                      return_logprob=True, **image_fields([s for s, _ in todo]))
            engine, answer = await self.pool.request(request, None, keep_aborted=True)
            responses = answer if isinstance(answer, list) else [answer]
            for (sample, _), response in zip(todo, responses, strict=True):
                self._fill(sample, response, engine, extend=True)
        for s in samples:
            if s.finish_reason == "abort":
                s.status = "aborted"

    async def _generate_together(self, samples: list[Sample], params: list[dict[str, Any]]) -> None:
        """One batched ``/generate`` request (SGLang's list form: one prompt and one sampling_params,
        with its own ``sampling_seed``, per sample) for samples of one group: the same samples as one
        request each, without the per-request HTTP and scheduling cost."""
        traced = min(self._trace_budget, len(samples))  # the step traces trace_sample_limit samples in all
        self._trace_budget -= traced
        trace = {"queued": time.time()} if traced else None
        request = GenerateRequest(input_ids=[list(s.prompt_tokens) for s in samples], sampling_params=params,
                                  return_logprob=True, **image_fields(samples))
        engine, responses = await self.pool.request(request, trace, keep_aborted=self.continue_aborted)
        if not isinstance(responses, list) or len(responses) != len(samples):
            raise RaygymError(f"{self.pool.engine_name(engine)} answered a batch of {len(samples)} prompts with "
                              f"{len(responses) if isinstance(responses, list) else 1} outputs")
        for sample, response in zip(samples, responses, strict=True):
            self._fill(sample, response, engine)
        if self.continue_aborted:
            await self._continue_aborted(samples, params)
        if trace is not None:
            trace["done"] = time.time()
            for sample in samples[:traced]:
                sample.trace = dict(trace)

    async def _generate_sample(self, sample: Sample, params: dict[str, Any], score_now: bool) -> None:
        trace = None
        if self._trace_budget > 0:
            self._trace_budget -= 1
            trace = {"queued": time.time()}
        if self._custom_generate is None:
            engine, response = await self._send(sample.prompt_tokens, params, trace, sample.images)
            self._fill(sample, response, engine)
        else:
            async def generate(input_ids: list[int], sampling_params: dict[str, Any]) -> GenerateResponse:
                return (await self._send(input_ids, sampling_params, trace, sample.images))[1]

            result = await _maybe_await(self._custom_generate(self.cfg, sample, dict(params), generate))
            if not isinstance(result, Sample):
                raise RaygymError(f"custom_generate_function returned {type(result).__name__}; it must return the Sample")
            if result is not sample:
                sample.__dict__.update(result.__dict__)
            mask = sample.effective_loss_mask()
            if len(mask) != sample.response_length:
                raise RaygymError(f"custom_generate_function: loss_mask has {len(mask)} entries for "
                                  f"{sample.response_length} response tokens; give one per response token")
            if sample.status == "pending":
                sample.status = "truncated" if sample.finish_reason == "length" else "completed"
        if trace is not None:
            trace["done"] = time.time()
            sample.trace = trace
        if score_now:
            await self.rewards.score([sample])

    async def generate_group(self, row: PromptRow, params: dict[str, Any], n: int | None = None,
                             *, group_key: int | None = None, scope: tuple[Any, ...] | None = None) -> list[Sample]:
        """Generate and score ``n`` (default ``n_samples_per_prompt``) samples for one prompt.

        Sample ``j`` is sent with ``sampling_seed`` derived from (the recipe's ``seed``, ``scope`` (default: the
        step's or eval's), ``group_key``, j); ``group_key`` defaults to the order of the calls in the step."""
        n = n or self.settings.n_samples_per_prompt
        if group_key is None:
            group_key = self._group_counter
            self._group_counter += 1
        samples = self._new_group(row, n)
        batched = self.rewards.per_group
        if self._custom_generate is None:
            await self._generate_together(samples, [self._seeded(params, group_key, s.sample_index, scope) for s in samples])
            await self.rewards.score(samples)
        else:
            await asyncio.gather(*(self._generate_sample(s, self._seeded(params, group_key, s.sample_index, scope),
                                                         score_now=not batched) for s in samples))
            if batched:
                await self.rewards.score(samples)
        self._seen.extend(samples)
        return samples

    def reserve_group_keys(self, count: int) -> int:
        """Name the next ``count`` groups of the step (their sampling seeds); returns the first key."""
        first, self._group_counter = self._group_counter, self._group_counter + count
        return first

    @property
    def generates_per_sample(self) -> bool:
        """Samples are generated one request each (``custom_generate_function`` or an environment)."""
        return self._custom_generate is not None

    def _new_group(self, row: PromptRow, n: int) -> list[Sample]:
        return [
            Sample(prompt=row.prompt, prompt_tokens=list(row.prompt_tokens), group_index=-1, sample_index=j,
                   data_index=row.data_index, label=row.label, metadata=dict(row.metadata),
                   weight_version=self.weight_version, columns=dict(row.columns), images=list(row.images))
            for j in range(n)
        ]

    async def generate_round(self, rows: Sequence[PromptRow], params: dict[str, Any], first_key: int) -> list[list[Sample]]:
        """Generate and score one group per row (group keys ``first_key + position``) in one batched
        request per healthy engine (contiguous shares of whole groups), so an engine prefills and decodes
        the round as one batch instead of merging many staggered small requests. Same samples, seeds
        and scores as :meth:`generate_group` per row."""
        n = self.settings.n_samples_per_prompt
        groups = [self._new_group(row, n) for row in rows]
        parts = max(1, min(len(groups), len(self.pool.router.healthy()) or 1))
        bounds = [round(k * len(groups) / parts) for k in range(parts + 1)]

        async def part(k: int) -> None:
            share = groups[bounds[k]:bounds[k + 1]]
            samples = [s for g in share for s in g]
            params_list = [self._seeded(params, first_key + bounds[k] + pos, s.sample_index)
                           for pos, g in enumerate(share) for s in g]
            await self._generate_together(samples, params_list)

        await asyncio.gather(*(part(k) for k in range(parts)))
        await asyncio.gather(*(self.rewards.score(g) for g in groups))
        for g in groups:
            self._seen.extend(g)
        return groups

    def _seeded(self, params: dict[str, Any], group_key: int, sample_index: int,
                scope: tuple[Any, ...] | None = None) -> dict[str, Any]:
        if "sampling_seed" in params:
            return params
        seed = derive_sampling_seed(self.settings.seed, *(scope or self._seed_scope), group_key, sample_index)
        return {**params, "sampling_seed": seed}

    # --- one training step ---------------------------------------------------------------------

    async def generate(self, rollout_id: int, weight_version: int | None = None) -> list[Sample]:
        """``rollout_batch_size`` x ``n_samples_per_prompt`` scored samples for step ``rollout_id``.

        ``weight_version``: the policy version the engines serve now (default: unchanged)."""
        await self._ensure_started()
        if weight_version is not None:
            self.weight_version = weight_version
            self.pool.set_weight_version(weight_version)
        self._seen = []
        self._seed_scope, self._group_counter = ("rollout", rollout_id), 0
        self._trace_budget = self.settings.trace_sample_limit if self.settings.capture_trace else 0
        self.pool.router.reset_counts()
        self.pool.routed_rows = [0] * len(self.pool.routed_rows)
        counts_before = self.pool.counts()
        if self.settings.use_fault_tolerance:
            self.pool.monitor.activate()
        start = time.monotonic()
        stats: dict[str, int] = {"kept": 0, "dropped": 0, "surplus": 0, "aborted": 0, "rounds": 0}
        try:
            if self._rollout_function is not None:
                samples = list(await _maybe_await(self._rollout_function(self.cfg, rollout_id, self)))
            else:
                groups = await collect_groups(self, self.sampling_params(), stats)
                samples = []
                for g, group in enumerate(groups):
                    for s in group:
                        s.group_index = g
                    samples.extend(group)
            self.rewards.post_process(samples)
            if self.teacher is not None:
                await self.teacher.score(samples)
        finally:
            self.pool.monitor.deactivate()
        elapsed = time.monotonic() - start
        self._metrics = self._step_metrics(samples, elapsed, stats, _since(self.pool.counts(), counts_before))
        return samples

    def _step_metrics(self, samples: Sequence[Sample], elapsed: float, stats: dict[str, int],
                      counts: dict[str, int]) -> dict[str, float]:
        metrics = rollout_batch_metrics(samples, self._seen, elapsed, failures=counts["failures"],
                                        retries=counts["retries"], malformed=counts["malformed"], moved=counts["moved"])
        metrics.update(reward_component_metrics(samples, self.rewards.names, "rollout/"))
        if self.group_filter is not None:
            metrics.update({
                "rollout/dynamic_kept_groups": float(stats["kept"]),
                "rollout/dynamic_dropped_groups": float(stats["dropped"]),
                "rollout/dynamic_aborted_groups": float(stats["aborted"] + stats["surplus"]),
                "rollout/dynamic_rounds": float(stats["rounds"]),
            })
        metrics.update(tasks.sample_metrics(samples))
        if self.judge is not None:
            metrics.update(self.judge.metrics())
        for i, count in enumerate(self.pool.routed_rows):  # samples requested (a group's batch counts each)
            metrics[f"rollout/engine{i}_requests"] = float(count)
        return metrics

    # --- eval ------------------------------------------------------------------------------------

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Every eval prompt x ``n_samples_per_eval_prompt`` with eval sampling settings; per dataset
        ``eval/<name>/reward_mean``, ``eval/<name>/pass@<k>`` (k = n, unbiased), ``pass@1``,
        ``response_len_mean`` and ``truncated_frac``."""
        await self._ensure_started()
        n = self.settings.n_samples_per_eval_prompt
        params = self.sampling_params(evaluation=True)
        out: dict[str, float] = {}
        self._trace_budget = 0
        if self.settings.use_fault_tolerance:
            self.pool.monitor.activate()
        try:
            self._eval_samples = {}
            for name, dataset in self.eval_datasets.items():
                self._seed_scope = ("eval", rollout_id, name)
                groups = await asyncio.gather(*(self.generate_group(dataset[i], params, n, group_key=i)
                                                for i in range(len(dataset))))
                samples = [s for g in groups for s in g]
                self._eval_samples[name] = samples
                out.update(eval_dataset_metrics(f"eval/{name}/", groups, n, self.pass_threshold))
                if len(self.rewards.names) > 1:
                    out.update(reward_component_metrics(samples, self.rewards.names, f"eval/{name}/"))
        finally:
            if self.stream is None:  # a fully asynchronous run's stream keeps the health monitor on
                self.pool.monitor.deactivate()
            # eval samples are not the next step's generation (a fully asynchronous stream keeps adding those)
            eval_ids = {id(s) for group in self._eval_samples.values() for s in group}
            self._seen = [s for s in self._seen if id(s) not in eval_ids]
        return out
