"""``RecipeFields``: every field of the :class:`~raygym.config.recipe.Recipe` (how to train), with the
``Qwen3_4B_Recipe`` reference page's field names and defaults plus raygym's own fields (listed in
``docs/internals.md``), and the quantities derived from them (GPUs, nodes, data-parallel size). The rules
(:mod:`raygym.config.recipe_checks`) are typed against it, so they need no import of the
:class:`~raygym.config.recipe.Recipe`, which extends it and runs them. Pure.

>>> RecipeFields().rollout_batch_size, "lr" in OPTIONAL_FIELDS, "rollout_num_gpus" in OPTIONAL_FIELDS
(16, False, True)
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import model_validator

from raygym.config.allocation import GpuAllocation, compute_allocation
from raygym.config.base import CustomFunction, MiB, Section, option, option_factory, parse_json_object
from raygym.errors import ConfigError


class RecipeFields(Section):
    """The Recipe's fields, unvalidated beyond their types (build a :class:`~raygym.config.recipe.Recipe`,
    which checks every rule). ``extra_config`` keys override the same-named fields."""

    # ── cluster and parallelism ──
    actor_num_nodes: int = option(1, "Nodes for the actor (policy) trainer.")
    actor_num_gpus_per_node: int = option(8, "GPUs per actor node (also the GPUs per node of the whole cluster).")
    colocate: bool = option(True, "Share GPUs between the trainer and rollout engines.")
    cpu_placement: str = option(
        "disjoint",
        "CPU runs whose engines decode while the trainer trains (async_mode, fully_async): 'disjoint' pins trainer "
        "ranks and engines to disjoint cores of their node, as GPUs are disjoint; 'shared' leaves it to the OS.",
    )
    cpu_engine_cores: int | None = option(
        None,
        "CPU runs with cpu_placement='disjoint' whose engines decode while the trainer trains: the cores of a node "
        "the engines decode on, the trainer ranks sharing the rest; None: one core per engine.",
    )
    auto_split: bool = option(
        False,
        "Engines that decode while the trainer trains (async_mode or fully_async, colocate=False): measure both "
        "sides over the first auto_split_probe_steps steps, then re-pick at a checkpoint the split of devices "
        "(cores of a node on CPU, GPUs on a cluster) that balances their rates, and go on from that checkpoint.",
    )
    auto_split_probe_steps: int = option(
        4, "Steps auto_split measures before it re-picks the split (the first is left out as warm-up)."
    )
    rollout_num_gpus: int | None = option(
        None, "Total GPUs for rollout engines when disaggregated; None lets the allocation resolver size it."
    )
    rollout_num_gpus_per_engine: int = option(1, "GPUs and tensor-parallel size per rollout engine.")
    tensor_model_parallel_size: int = option(1, "Megatron tensor-parallel size for the actor.")
    sequence_parallel: bool = option(
        False, "Megatron sequence parallelism. Requires tensor parallelism greater than one."
    )
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel size for the actor.")
    context_parallel_size: int = option(1, "Context-parallel size for the actor.")
    expert_model_parallel_size: int = option(1, "Expert-parallel size for MoE models.")
    use_critic: bool = option(False, "Train a separate critic model for PPO. GRPO does not use one.")
    critic_num_nodes: int | None = option(
        None, "Nodes for the critic when use_critic is set (default: the actor's)."
    )
    critic_num_gpus_per_node: int | None = option(None, "GPUs per critic node (default: the actor's).")
    trainer_backend: str = option(
        "auto", "Trainer implementation: 'torch' (HF model, FSDP2), 'megatron' or 'auto'."
    )
    rollout_engine: str = option(
        "auto",
        "Rollout engine: 'sglang', 'vllm', 'raygym' (built-in server) or 'auto' (sglang when CUDA and sglang "
        "exist).",
    )
    colocate_trainer_gpu_share: float = option(
        0.5, "Fraction of each GPU the trainer bundle claims when colocated."
    )
    colocate_engine_gpu_share: float = option(0.4, "Fraction of each GPU an engine bundle claims when colocated.")
    placement_timeout: float = option(600.0, "Seconds to wait for the placement groups before failing.")
    async_mode: bool = option(
        False, "Overlap rollout generation and training, one step off-policy (needs colocate=False)."
    )
    fully_async: bool = option(
        False,
        "Fully asynchronous training: engines generate continuously, the trainer takes each step's groups as they "
        "complete, weight updates land while requests are in flight (which continue on the new weights); needs "
        "colocate=False. See max_staleness.",
    )
    max_staleness: int = option(
        2,
        "fully_async: how many policy versions older than the trainer a sample's oldest token may be when it is "
        "trained (AReaL's max_head_offpolicyness); generation runs at most this many steps ahead.",
    )
    stale_sample_policy: str = option(
        "regenerate",
        "fully_async: a group that still comes back older than max_staleness is 'regenerate'd (its prompt is "
        "generated again) or 'drop'ped (counted, never trained).",
    )
    environment: dict[str, str] = option_factory(
        lambda: {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "1"},
        "Environment variables for every Ray worker of the run (NCCL settings and the like; no secrets).",
    )
    train_env_vars: dict[str, str] | None = option(
        None, "Extra environment variables for the training processes only (a dict, or inline JSON)."
    )

    # ── RL algorithm ──
    advantage_estimator: str = option("grpo", "Advantage estimator.")
    n_samples_per_prompt: int = option(8, "Responses sampled per prompt as one GRPO group.")
    eps_clip: float = option(0.2, "PPO clip lower bound.")
    eps_clip_high: float = option(0.28, "Upper PPO clip bound for asymmetric DAPO clipping.")
    eps_clip_c: float | None = option(
        None, "Dual-clip constant for negative advantages (> 1); None disables dual clip."
    )
    use_kl_loss: bool = option(False, "Add a per-token KL loss term against the reference model.")
    kl_loss_type: str = option("low_var_kl", "KL formulation.")
    kl_loss_coef: float = option(0.0, "Coefficient of the KL loss term.")
    kl_coef: float = option(0.0, "KL penalty coefficient applied in the reward.")
    entropy_coef: float = option(0.0, "Entropy bonus coefficient.")
    calculate_per_token_loss: bool = option(False, "Average the loss over tokens instead of over samples.")
    ref_load: str = option("", "Checkpoint read by the reference model for KL terms.")
    use_tis: bool = option(False, "Truncated importance sampling against the rollout log-probs (on by default when async_mode or fully_async is set).")
    tis_clip: float = option(2.0, "Upper clamp of the truncated importance-sampling weight.")
    tis_clip_low: float = option(
        0.0, "Lower bound of the importance weight: truncate mode clamps it into [tis_clip_low, tis_clip]."
    )
    tis_mode: str = option(
        "truncate",
        "With use_tis: 'truncate' clamps the weight (TIS); 'mask' keeps it inside [tis_clip_low, tis_clip] and "
        "drops tokens outside it (MIS). IcePop: --use-tis --tis-mode mask --tis-level token --tis-clip-low 0.5 "
        "--tis-clip 2.0.",
    )
    tis_level: str = option(
        "token",
        "With use_tis, the importance ratio old/rollout per 'token', per 'sequence' (product over the sample's "
        "tokens) or 'geometric' (their geometric mean); a sample's ratio weights (or masks) all its tokens.",
    )
    use_rollout_routing_replay: bool = option(
        False,
        "MoE routing replay (R3): the engines return the experts each token was routed to in every layer and both "
        "trainer backends force them in their log-prob and training forwards (slime's and Miles' name). Engines: "
        "raygym's server; stock SGLang >= 0.5.15 on GPU.",
    )
    gamma: float = option(1.0, "Discount factor (PPO / GAE).")
    lambd: float = option(1.0, "GAE lambda (PPO).")
    critic_lr: float | None = option(None, "Critic learning rate; None uses lr.")
    value_clip: float | None = option(
        None, "PPO critic: clip range of the value loss around the old values; None = eps_clip, 0 = no clipping."
    )

    # ── rollout ──
    num_rollout: int = option(1, "Training and rollout steps for the run.")
    start_rollout_id: int | None = option(
        None, "Rollout step to start counting from; None continues from the iteration stored in load."
    )
    rollout_batch_size: int = option(
        16, "Prompts sampled per rollout step; each prompt is expanded into a group of sampled responses."
    )
    rollout_max_response_len: int = option(4096, "Max generated tokens per sample.")
    rollout_max_prompt_len: int | None = option(
        None, "Prompts longer than this many tokens are skipped; None keeps all."
    )
    rollout_temperature: float = option(1.0, "Sampling temperature for rollout generation.")
    rollout_top_p: float = option(1.0, "Nucleus-sampling top-p for rollout generation.")
    rollout_stop_token_ids: list[int] | None = option(None, "Extra token ids that terminate generation.")
    rollout_shuffle: bool = option(True, "Shuffle the prompt dataset between epochs.")
    over_sampling_batch_size: int | None = option(None, "Extra DAPO prompts sampled to replace filtered groups.")
    dynamic_sampling_filter_path: str | None = option(
        None, "Import path of the predicate that selects sample groups ('pkg.module:function')."
    )
    balance_data: bool = option(False, "Rebalance kept samples across data-parallel ranks.")
    rm_type: str | None = option(
        None,
        "Built-in reward (next_digit and long_tail score the builtin tasks of the same names; reasoning_gym scores "
        "reasoning-gym:<task> data with the task's own scorer; math_verify needs raygym[math]). Leave unset for a "
        "custom reward.",
    )
    reward_functions: dict[str, float] | None = option(
        None,
        "Several rewards summed with weights, {name: weight}: built-in rm_type names or import paths "
        "('pkg.module:function'); each is logged as rollout/reward/<name>. Overrides rm_type and "
        "custom_rm_function.",
    )
    capture_trace: bool = option(False, "Attach sampled per-request execution traces to recorded rollouts.")
    trace_sample_limit: int = option(16, "Maximum traced samples per rollout when capture_trace is enabled.")
    substep_timing: str = option("auto", "Per-substep timing metrics: 'auto' or 'off'.")

    # ── fault tolerance ──
    use_fault_tolerance: bool = option(True, "Recover from rollout engine failures (health checks and restarts).")
    rollout_health_check_interval: int = option(
        30, "Interval in seconds between rollout engine /health_generate checks during generate/eval."
    )
    rollout_health_check_timeout: int = option(
        30, "Timeout in seconds to wait for a rollout engine /health_generate response before killing it."
    )
    rollout_health_check_first_wait: int = option(
        300, "Initial delay in seconds before health checks. DeepGEMM compilation may require a longer delay."
    )

    # ── training ──
    global_batch_size: int = option(16, "Training samples per optim step.")
    micro_batch_size: int = option(1, "Samples per micro-batch when use_dynamic_batch_size is False.")
    lr: float = option(5e-07, "Learning rate.")
    min_lr: float = option(0.0, "Floor of the learning-rate schedule.")
    lr_warmup_iters: int = option(0, "Optimizer steps of linear warm-up.")
    lr_decay_iters: int | None = option(None, "Optimizer steps of decay; None = all optimizer steps of the run.")
    lr_decay_style: str = option("constant", "Learning-rate schedule.")
    weight_decay: float = option(0.1, "Weight decay.")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.98, "Adam beta2.")
    optimizer: str = option("adam", "Optimizer name.")
    clip_grad: float = option(1.0, "Gradient-norm clipping threshold; 0 disables clipping.")
    seed: int = option(1234, "Random seed of the run (data order, sampling, init).")
    freeze_params_name_list: list[str] | None = option(
        None, "Parameter-name patterns matched with re.search to select frozen weights."
    )

    # ── LoRA (raygym/lora.py, raygym/trainer/lora.py) ──
    lora_rank: int = option(
        0, "LoRA rank: train low-rank adapters on the frozen base model and sync only them to the engines "
        "(torch backend); 0 = full fine-tuning."
    )
    lora_alpha: int = option(16, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank.")
    lora_dropout: float = option(0.0, "Dropout on the adapters' input while training.")
    lora_target_modules: str = option(
        "all-linear", "Modules the adapters attach to: 'all-linear' (every linear layer but the output head) or "
        "comma-separated module names (q_proj,k_proj,v_proj,o_proj)."
    )

    # ── memory and precision ──
    attention_dropout: float = option(0.0, "Attention dropout probability.")
    hidden_dropout: float = option(0.0, "Hidden-layer dropout probability.")
    attention_softmax_in_fp32: bool = option(True, "Compute attention softmax in fp32.")
    accumulate_allreduce_grads_in_fp32: bool = option(True, "Accumulate and all-reduce gradients in fp32.")
    use_distributed_optimizer: bool = option(
        False, "Shard optimizer state across data-parallel ranks with Megatron's distributed optimizer."
    )
    recompute_granularity: str = option("full", "Activation recomputation granularity: 'full' or 'selective'.")
    recompute_method: str = option("uniform", "Recomputation method: 'uniform' or 'block'.")
    recompute_num_layers: int = option(1, "Layers per recomputation chunk.")
    torch_activation_checkpointing: bool = option(
        False,
        "Torch backend: recompute each decoder layer's activations in backward (less memory, about a third "
        "more compute). The recompute_* fields configure the Megatron backend.",
    )
    distributed_timeout_minutes: int = option(
        10, "Minutes a trainer collective (its torch.distributed / Megatron process groups) may wait before failing."
    )

    # ── dynamic batching ──
    use_dynamic_batch_size: bool = option(
        True,
        "Pack variable-length samples into micro-batches up to max_tokens_per_gpu instead of a fixed size.",
    )
    max_tokens_per_gpu: int = option(8192, "Token budget per GPU per micro-batch when dynamic batching is on.")
    qkv_format: str = option("thd", "QKV layout for the Megatron backend.")

    # ── eval ──
    eval_interval: int | None = option(10, "Run eval every N rollout steps; None disables eval.")
    n_samples_per_eval_prompt: int = option(4, "Responses sampled per eval prompt.")
    eval_max_response_len: int = option(4096, "Max generated tokens per eval sample.")
    eval_top_p: float = option(1.0, "Nucleus-sampling top-p for eval generation.")
    eval_config: dict[str, Any] | None = option(None, "Evaluation defaults and datasets.")

    # ── checkpointing ──
    save: str = option(
        "/checkpoints", "Checkpoint output directory (path or fsspec URL); '' = <output_dir>/checkpoints."
    )
    save_interval: int = option(10, "Save a checkpoint every N rollout steps.")
    load: str = option("", "Checkpoint directory to resume from; empty starts from the HF weights.")
    no_save_optim: bool = option(
        False, "Omit optimizer state from checkpoints. The checkpoints cannot resume the optimizer exactly."
    )
    no_load_optim: bool = option(False, "Do not load optimizer state when resuming.")
    megatron_to_hf_mode: str = option(
        "", "Export mode for saved Megatron checkpoints; not supported, leave empty (checkpoints always hold hf/)."
    )
    slime_model_script: str = option(
        "", "Script that defines MODEL_ARGS (megatron); not supported, leave empty (config.json is read)."
    )
    source_hf_checkpoint: str | None = option(
        None, "Source checkpoint when it differs from the model's own; not supported, leave unset."
    )
    megatron_conversion_hf_checkpoint: str | None = option(
        None,
        "HF checkpoint for an HF->Megatron conversion; not supported, leave unset (hf_checkpoint is loaded).",
    )

    # ── weight sync ──
    update_weight_mode: str = option(
        "full", "Weight synchronization mode. 'full' sends all weights; 'delta' sends byte-level changes; 'auto' "
        "picks full or delta for each sync from the measured cost of both (fast links: full; slow links: delta)."
    )
    update_weight_transport: str = option(
        "nccl", "'nccl' (gloo on CPU), 'disk' (needs a shared filesystem) or 'ipc' (colocated on GPU)."
    )
    update_weight_encoding: str = option("indices", "Encoding for delta payloads.")
    update_weight_disk_dir: str = option("", "Shared directory (path or fsspec URL) used by the disk transport.")
    update_weight_buffer_size: int = option(512 * MiB, "Bytes per weight-sync bucket.")
    update_weight_full_interval: int = option(0, "Send full weights every N syncs in delta mode; 0 = never.")
    update_weight_pause_mode: str = option(
        "abort", "How engines pause generation for a sync: 'abort' or 'in_place'."
    )
    update_weight_timeout: float = option(600.0, "Seconds one weight sync may take before it fails.")
    update_weight_double_buffer: bool = option(
        False,
        "Engines receive the next version into a shadow copy while they keep serving the current one, then "
        "switch between two forward passes: generation pauses only for the switch (raygym's server; costs a "
        "second copy of the weights on every engine).",
    )
    update_weight_probe_tolerance: float = option(
        0.1,
        "Engines verified by probe (stock SGLang, vLLM beside its checksums): an upper bound on the tolerance "
        "of the mean |log-prob difference| between engine and trainer on the probe after a sync. The tolerances "
        "themselves are calibrated per run from the probe's noise floor at the first sync (mean and worst "
        "token; docs/engines.md, 'The probe').",
    )

    # ── custom functions (a callable, or an import path 'pkg.module:function') ──
    custom_rm_function: CustomFunction = option(
        None,
        "Reward function, called as its signature says: fn(sample), fn(prompt, response, label, metadata), "
        "fn(samples) -> list, TRL's fn(prompts, completions, **columns) -> list[float | None] or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info).",
    )
    custom_generate_function: CustomFunction = option(None, "Custom generation step for one sample.")
    custom_reward_post_process_function: CustomFunction = option(
        None, "Function applied to rewards after generation."
    )
    custom_rollout_log_function: CustomFunction = option(None, "Function called with each rollout's data.")
    custom_eval_rollout_log_function: CustomFunction = option(
        None, "Function called with each evaluation rollout's data."
    )
    rollout_function: CustomFunction = option(None, "Custom rollout loop replacing the built-in one.")
    custom_megatron_before_log_prob_hook: CustomFunction = option(
        None, "Hook run in the trainer before log-probs."
    )
    custom_megatron_before_train_step_hook: CustomFunction = option(
        None, "Hook run in the trainer before each step."
    )

    # ── environments, LLM judge, on-policy distillation (raygym/envs, raygym/rewards/judge.py, raygym/rewards/distill.py) ──
    rollout_env: CustomFunction = option(
        None, "Multi-turn environment: a raygym.envs.Environment class or factory ('pkg.module:Class'); each "
        "sample plays one episode; rm_type='env' (or unset) rewards it with the episode's reward.",
    )
    rollout_env_max_turns: int = option(4, "Model turns per episode of rollout_env.")
    rollout_env_max_context_len: int | None = option(
        None, "Prompt + response tokens an episode may fill (model and environment tokens); None = no limit."
    )
    judge_hf_checkpoint: str | None = option(
        None, "LLM judge model: starts a judge engine group with its own GPUs; rm_type='judge' scores with it."
    )
    judge_num_engines: int = option(1, "Judge engines (each on judge_num_gpus_per_engine GPUs of one node).")
    judge_num_gpus_per_engine: int = option(1, "GPUs (and tensor-parallel size) per judge engine.")
    judge_prompt_template: str = option(
        "Rate the response from 0 to 10.\nTask: {prompt}\nResponse: {response}\nScore:",
        "Judge prompt; {prompt}, {response} and {label} are filled in.",
    )
    judge_max_response_len: int = option(16, "Tokens the judge may write; its score is the first number in them.")
    judge_score_min: float = option(0.0, "Lowest score the template asks for (maps to reward 0).")
    judge_score_max: float = option(10.0, "Highest score the template asks for (maps to reward 1).")
    judge_failure_score: float = option(0.0, "Reward when the judge's answer holds no score in range.")
    judge_batch_size: int = option(32, "Judge prompts per /generate request.")
    judge_cache_size: int = option(4096, "Judged (prompt, response, label) triples remembered; 0 = no cache.")
    distill_teacher_checkpoint: str | None = option(
        None, "On-policy distillation: the teacher model (its own GPUs) scores every sampled token; the "
        "per-token reverse KL becomes the advantage.",
    )
    distill_num_gpus: int = option(1, "GPUs for the teacher (one scoring actor per GPU).")
    distill_kl_coef: float = option(1.0, "Weight of the per-token reverse-KL advantage log p_teacher - log p_student.")
    distill_task_weight: float = option(
        1.0, "Weight of the task reward's advantage next to the distillation term; 0 = pure distillation."
    )

    # ── SGLang ──
    sglang_mem_fraction_static: float = option(
        0.75, "Fraction of GPU memory sglang reserves for weights + KV cache."
    )
    sglang_enable_dp_attention: bool = option(False, "Enable data-parallel attention across engine ranks.")
    sglang_dp_size: int | None = option(None, "Data-parallel size for the engines.")
    sglang_ep_size: int | None = option(None, "Expert-parallel size for MoE models.")
    sglang_enable_dp_lm_head: bool = option(False, "Data-parallel LM head paired with DP attention.")
    sglang_disable_custom_all_reduce: bool = option(
        False, "Fall back to NCCL all-reduce instead of sglang's kernel."
    )
    sglang_cuda_graph_bs: list[int] | None = option(None, "Batch sizes to capture CUDA graphs for.")
    sglang_cuda_graph_backend_prefill: str | None = option(None, "CUDA-graph backend for prefill.")
    sglang_max_running_requests: int | None = option(None, "Cap on concurrent in-flight requests per engine.")
    sglang_tool_call_parser: str | None = option(None, "Tool-call output parser.")
    sglang_reasoning_parser: str | None = option(None, "Parser for reasoning/thinking output.")
    sglang_config: dict[str, Any] | None = option(None, "Extra SGLang engine settings (server arguments).")
    sglang_request_params: dict[str, Any] | None = option(None, "Additional parameters for generation requests.")
    rollout_engine_python: str = option(
        "",
        "Python interpreter that runs the engine server (e.g. the venv where SGLang is installed); "
        "'' = the interpreter running raygym.",
    )

    # ── overrides ──
    extra_config: dict[str, Any] | None = option(
        None, "Values that override same-named recipe fields (keys must be Recipe field names)."
    )
    apply_chat_template_kwargs: dict[str, Any] | str = option(
        "", "Keyword arguments for the tokenizer's apply_chat_template (a dict or JSON); '' = none."
    )
    multimodal_keys: dict[str, Any] | str | None = option(
        None, "Dataset columns of multimodal inputs, modality -> column (a dict or JSON), e.g. "
        "'{\"image\": \"images\"}'; only 'image' is supported (a column of one image or a list: paths relative "
        "to the data file, URLs, data URLs, base64 or bytes), and it needs a vision-language hf_checkpoint. "
        "None = text prompts only."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_extra_config(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field in ("train_env_vars",):
            if isinstance(data.get(field), str):
                data[field] = parse_json_object(field, data[field])
        if isinstance(data.get("lora_target_modules"), (list, tuple)):  # PEFT's list form, kept as one string
            data["lora_target_modules"] = ",".join(str(m) for m in data["lora_target_modules"])
        extra = data.get("extra_config")
        if extra is None:
            return data
        if not isinstance(extra, dict):
            raise ConfigError(f"extra_config={extra!r}: must be a dict of recipe field overrides")
        for key, value in extra.items():
            if key not in cls.model_fields or key == "extra_config":
                close = difflib.get_close_matches(str(key), list(cls.model_fields), n=3)
                raise ConfigError(
                    f"extra_config[{key!r}]: not a Recipe field; extra_config only overrides recipe fields"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
            data[key] = value
        return data

    # ── derived quantities ──

    def auxiliary_gpus(self) -> int:
        """GPUs of the judge engines and the distillation teacher, outside ``gpu_allocation()``."""
        judge = self.judge_num_engines * self.judge_num_gpus_per_engine if self.judge_hf_checkpoint else 0
        return judge + (self.distill_num_gpus if self.distill_teacher_checkpoint else 0)

    def gpu_allocation(self) -> GpuAllocation:
        """GPUs per role, engines and nodes (see :func:`raygym.config.allocation.compute_allocation`)."""
        return compute_allocation(
            actor_num_nodes=self.actor_num_nodes,
            actor_num_gpus_per_node=self.actor_num_gpus_per_node,
            colocate=self.colocate,
            rollout_num_gpus=self.rollout_num_gpus,
            rollout_num_gpus_per_engine=self.rollout_num_gpus_per_engine,
            use_critic=self.use_critic,
            critic_num_nodes=self.critic_num_nodes,
            critic_num_gpus_per_node=self.critic_num_gpus_per_node,
        )

    def total_nodes(self) -> int:
        """Nodes the run needs (actor + critic + disaggregated rollout)."""
        return self.gpu_allocation().total_nodes

    def data_parallel_size(self) -> int:
        """Actor GPUs / (TP x PP x CP)."""
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        return (self.actor_num_nodes * self.actor_num_gpus_per_node) // model_parallel


# The fields that may be None.
OPTIONAL_FIELDS = frozenset(
    name for name, info in RecipeFields.model_fields.items() if type(None) in typing.get_args(info.annotation)
)
