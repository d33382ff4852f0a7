"""TrainConfig.cli_args() / TrainConfig.from_cli_args(): an exact round trip for every field of every
model (a seeded property test over many random valid configs), plus what users type (load_train_config:
presets, TOML run files)."""

from __future__ import annotations

import json
import random
import string
import typing

import pytest

from raygym import ConfigError, DatasetConfig, MetricsConfig, ModelConfig, Recipe, TrainConfig
from raygym.config import FLAGS, format_cli_help
from raygym.config.constants import RECIPE_CHOICES, UNSUPPORTED_MODEL_FIELDS, UNSUPPORTED_RECIPE_FIELDS
from raygym.run.config_loading import load_train_config

N_CONFIGS = 200


def reward_exact(prompt, response, label, metadata):
    """A module-level reward: has an import path."""
    return float(response.strip() == label)


def text(rng: random.Random) -> str:
    pool = string.ascii_letters + string.digits + " -_@=:/.,{}[]\"'\n\té"
    special = ["", "-", "--lr", "@run.toml", "null", "none", "true", "0", "-1e-3", "{}", " padded "]
    if rng.random() < 0.3:
        return rng.choice(special)
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 12)))


def json_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(6 if depth < 2 else 4)
    if pick == 0:
        return rng.randint(-(10**12), 10**12)
    if pick == 1:
        return rng.random() * 10 ** rng.randint(-8, 8)
    if pick == 2:
        return text(rng)
    if pick == 3:
        return rng.choice([True, False, None])
    if pick == 4:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {text(rng) or "k": json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


# Fields that shape the cluster and the batch: drawn together (see random_layout), not one by one.
LAYOUT = {
    "actor_num_nodes", "actor_num_gpus_per_node", "colocate", "rollout_num_gpus", "rollout_num_gpus_per_engine",
    "tensor_model_parallel_size", "sequence_parallel", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "use_critic", "critic_num_nodes", "critic_num_gpus_per_node",
    "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "micro_batch_size",
    "over_sampling_batch_size", "use_dynamic_batch_size", "async_mode", "advantage_estimator",
    "update_weight_mode", "update_weight_transport", "update_weight_disk_dir", "min_lr", "lr",
}  # fmt: skip


def random_layout(rng: random.Random) -> dict:
    """A consistent cluster + batch shape (rejection-sampled by the caller)."""
    nodes, per_node = rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 8])
    actor = nodes * per_node
    divisors = [d for d in (1, 2, 4, 8) if actor % d == 0]
    tp = rng.choice(divisors)
    pp = rng.choice([d for d in (1, 2) if (actor // tp) % d == 0])
    colocate = rng.random() < 0.5
    per_engine = rng.choice([d for d in (1, 2, 4, 8) if per_node % d == 0])
    critic = rng.random() < 0.3
    n, prompts = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 64)
    dp = actor // (tp * pp)
    batches = [g for g in range(dp, prompts * n + 1, dp) if (prompts * n) % g == 0]
    transport = rng.choice(["nccl", "disk", "ipc" if colocate else "nccl"])
    lr = rng.random() * 1e-4
    return {
        "actor_num_nodes": nodes,
        "actor_num_gpus_per_node": per_node,
        "colocate": colocate,
        "rollout_num_gpus": rng.choice([None, per_engine * rng.randint(1, 2) * (per_node // per_engine)]),
        "rollout_num_gpus_per_engine": per_engine,
        "tensor_model_parallel_size": tp,
        "sequence_parallel": tp > 1 and rng.random() < 0.5,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": 1,
        "expert_model_parallel_size": rng.choice([d for d in divisors if (actor // pp) % d == 0]),
        "use_critic": critic,
        "critic_num_nodes": rng.choice([None, nodes]) if critic else rng.choice([None, 3]),
        "critic_num_gpus_per_node": rng.choice([None, per_node]) if critic else None,
        "advantage_estimator": "ppo" if critic and rng.random() < 0.5 else rng.choice(["grpo", "gspo"]),
        "rollout_batch_size": prompts,
        "n_samples_per_prompt": n,
        "global_batch_size": rng.choice(batches) if batches else dp,
        "use_dynamic_batch_size": rng.random() < 0.7,
        "micro_batch_size": 1,
        "over_sampling_batch_size": rng.choice([None, prompts + rng.randint(0, 8)]),
        "async_mode": not colocate and rng.random() < 0.5,
        "update_weight_mode": "full" if colocate else rng.choice(["full", "delta"]),
        "update_weight_transport": transport,
        "update_weight_disk_dir": "/shared/sync" if transport == "disk" else rng.choice(["", "/x"]),
        "lr": lr,
        "min_lr": lr * rng.random(),
    }


def random_value(rng: random.Random, model, field: str):
    """A valid value for a field that has no cross-field constraint."""
    annotation = model.model_fields[field].annotation
    members = typing.get_args(annotation) or (annotation,)
    if type(None) in members and rng.random() < 0.3:
        return None
    choices = RECIPE_CHOICES.get(field) if model is Recipe else None
    if choices:
        return rng.choice(choices)
    if model is ModelConfig and field == "dtype":
        return rng.choice(["auto", "bfloat16", "float16", "float32"])
    if model is DatasetConfig and field == "format":
        return rng.choice(["auto", "jsonl", "parquet"])
    if model is MetricsConfig and field == "wandb_mode":
        return rng.choice(["online", "offline", "disabled"])
    if field in ("input_key", "label_key") and model is DatasetConfig:
        return field + "-" + text(rng)
    if field == "auto_split":  # valid with a few other fields only: random_config sets them together
        return False
    if bool in members:
        return rng.random() < 0.5
    if int in members:
        return rng.choice([1, 2, 4, 8, rng.randint(1, 10**6)])
    if float in members:
        if field == "eps_clip_c":
            return 1.0 + rng.random() * 3
        if field in ("colocate_trainer_gpu_share", "colocate_engine_gpu_share"):
            return 0.01 + rng.random() * 0.49
        if field in ("placement_timeout", "update_weight_timeout", "tis_clip", "eps_clip_high"):
            return 0.5 + rng.random() * 1000
        return 0.01 + rng.random() * 0.98  # inside every (0, 1) range
    if field in ("environment", "train_env_vars", "eval_prompt_data"):
        return {f"VAR_{i}": text(rng) for i in range(rng.randint(0, 3))}
    if field in ("rollout_stop_token_ids", "sglang_cuda_graph_bs"):
        return [rng.randint(0, 300000) for _ in range(rng.randint(0, 5))]
    if field == "freeze_params_name_list":
        return [text(rng) for _ in range(rng.randint(0, 3))]
    if "custom" in field or field in ("rollout_function",):
        return rng.choice([reward_exact, "raygym.builtin:next_digit_reward", "pkg.module.fn", "a.b:C.method"])
    if field == "dynamic_sampling_filter_path":
        return rng.choice(["pkg.filters:keep_nonzero_std", "pkg.filters.keep"])
    if field in ("apply_chat_template_kwargs", "multimodal_keys"):
        return rng.choice([{}, {"enable_thinking": rng.random() < 0.5}, "", '{"image": "img"}'])
    if field == "extra_config":
        return rng.choice([None, {}, {"num_rollout": rng.randint(1, 9)}, {"seed": 7, "rm_type": "math"}])
    if dict in members or any(typing.get_origin(m) is dict for m in members):
        return {text(rng) or "k": json_value(rng) for _ in range(rng.randint(0, 3))}
    return text(rng) or "x"


def random_section(rng, model, base: dict, n_changes: int, skip=()) -> dict:
    values = dict(base)
    fields = [f for f in model.model_fields if f not in skip]
    for field in rng.sample(fields, min(n_changes, len(fields))):
        values[field] = random_value(rng, model, field)
    return values


def random_config(rng: random.Random) -> TrainConfig:
    from raygym import presets

    while True:
        base = rng.choice(list(presets.PRESETS.values()))().field_values()
        if rng.random() < 0.6:
            base.update(random_layout(rng))
        try:
            # fields raygym refuses to run take only their default: not drawn
            fields = random_section(rng, Recipe, base, rng.randint(1, 40),
                                    skip=set(LAYOUT) | set(UNSUPPORTED_RECIPE_FIELDS))
            if rng.random() > 0.9:  # auto_split needs engines of their own, an async schedule, steps after its probe
                fields.update(auto_split=True, colocate=False, async_mode=False, fully_async=True, use_critic=False,
                              rollout_function=None, num_rollout=max(int(fields["num_rollout"]), 6),
                              auto_split_probe_steps=rng.choice([3, 4, 5]))
            recipe = Recipe(**fields)
            model = ModelConfig(
                **random_section(
                    rng, ModelConfig, {"hf_checkpoint": "x"}, 5,
                    skip={"num_experts", "num_layers"} | set(UNSUPPORTED_MODEL_FIELDS),
                )
            )
            dataset = DatasetConfig(**random_section(rng, DatasetConfig, {}, 5))
            metrics = MetricsConfig(**random_section(rng, MetricsConfig, {}, 3))
            return TrainConfig(
                recipe=recipe,
                model=model,
                dataset=dataset,
                metrics=metrics,
                output_dir=rng.choice([None, text(rng), "s3://b/run"]),
                run_id=rng.choice([None, "run-" + str(rng.randint(0, 999))]),
            )
        except ConfigError:
            continue  # rejection sampling: only valid configs are round-tripped


def test_random_configs_round_trip_exactly():
    rng = random.Random(20240607)
    covered: set[str] = set()
    for _ in range(N_CONFIGS):
        cfg = random_config(rng)
        args = cfg.cli_args()
        assert all(isinstance(a, str) for a in args)
        back = TrainConfig.from_cli_args(args)
        assert back == cfg, (cfg, back)
        assert back.cli_args() == args
        defaults = Recipe().field_values()
        covered |= {k for k, v in cfg.recipe.field_values().items() if v != defaults[k]}
    # the property exercised (almost) every recipe field that may leave its default
    drawable = set(Recipe.model_fields) - set(UNSUPPORTED_RECIPE_FIELDS)
    assert len(covered) >= len(drawable) - 5, drawable - covered


def test_every_field_of_all_models_has_a_flag():
    flagged = {(s.section, s.field) for s in FLAGS}
    for section, model in (
        ("recipe", Recipe),
        ("model", ModelConfig),
        ("dataset", DatasetConfig),
        ("metrics", MetricsConfig),
    ):
        assert {(section, f) for f in model.model_fields} <= flagged
    assert {("run", "output_dir"), ("run", "run_id")} <= flagged
    help_text = format_cli_help()
    assert (
        "--n-samples-per-prompt" in help_text
        and "--hf-checkpoint" in help_text
        and "--wandb-project" in help_text
    )


def test_flags_are_slime_style():
    cfg = TrainConfig(recipe=Recipe(n_samples_per_prompt=4, colocate=False, rollout_num_gpus=8),
                      model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"), metrics=MetricsConfig(wandb_project="p"))  # fmt: skip
    args = cfg.cli_args()
    assert args[args.index("--n-samples-per-prompt") + 1] == "4"
    assert args[args.index("--hf-checkpoint") + 1] == "Qwen/Qwen3-4B"
    assert args[args.index("--wandb-project") + 1] == "p"
    assert "--no-colocate" in args and "--colocate" not in args
    assert "--no-eval-config" in args  # None is expressible
    assert json.loads(args[args.index("--environment") + 1]) == cfg.recipe.environment
    # the dataset's apply_chat_template_kwargs shares a name with the recipe's: it gets a section prefix
    assert "--dataset-apply-chat-template-kwargs" in args and "--apply-chat-template-kwargs" in args


def test_false_and_none_override_true_and_values():
    cfg = load_train_config(
        ["--preset", "qwen3-4b", "--no-colocate", "--rollout-num-gpus", "8", "--no-eval-interval"]
    )
    assert cfg.recipe.colocate is False and cfg.recipe.eval_interval is None
    assert cfg.model.hf_checkpoint == "Qwen/Qwen3-4B"


def test_callables_travel_as_import_paths():
    cfg = TrainConfig(recipe=Recipe(custom_rm_function=reward_exact), model=ModelConfig(hf_checkpoint="m"))
    args = cfg.cli_args()
    path = args[args.index("--custom-rm-function") + 1]
    assert path == f"{__name__}:reward_exact"
    back = TrainConfig.from_cli_args(args)
    assert back.recipe.custom_rm_function == path and back == cfg


def test_lambdas_and_local_functions_raise():
    def local(prompt, response, label, metadata):
        return 0.0

    for fn in (lambda *a: 0.0, local):
        cfg = TrainConfig(recipe=Recipe(custom_rm_function=fn), model=ModelConfig(hf_checkpoint="m"))
        with pytest.raises(ConfigError, match="custom_rm_function=.*no import path"):
            cfg.cli_args()


def test_no_flags_means_the_tiny_preset():
    cfg = load_train_config([])
    assert cfg.model.hf_checkpoint == "builtin:tiny-qwen3"
    assert cfg.dataset.prompt_data == "builtin:next-digit"
    assert cfg.recipe.trainer_backend == "torch" and cfg.recipe.rm_type == "next_digit"
    assert load_train_config(["--num-rollout", "3"]).recipe.rm_type == "next_digit"



def test_a_builtin_model_gets_the_tiny_preset_and_any_other_model_none():
    moe = load_train_config(["--hf-checkpoint", "builtin:tiny-qwen3-moe"])
    assert moe.model.hf_checkpoint == "builtin:tiny-qwen3-moe"
    assert moe.recipe == load_train_config([]).recipe  # the tiny preset's recipe: one trainer, its lr
    other = load_train_config(["--hf-checkpoint", "Qwen/Qwen3-0.6B"])
    assert other.recipe == Recipe() and other.recipe != moe.recipe


def test_from_cli_args_applies_no_preset():
    # The config classes know no preset: a preset (or none, meaning tiny) is the command line's reading.
    for args, named in ((["--num-rollout", "3"], "no --hf-checkpoint"), (["--preset", "tiny"], "--preset tiny")):
        with pytest.raises(ConfigError, match=f"{named}: .*applies no preset.*load_train_config"):
            TrainConfig.from_cli_args(args)
    with pytest.raises(ConfigError, match="unrecognized arguments: @run.toml"):
        TrainConfig.from_cli_args(["@run.toml", "--hf-checkpoint", "m"])
    cfg = TrainConfig.from_cli_args(["--hf-checkpoint", "m", "--num-rollout", "3"])
    assert cfg == TrainConfig(recipe=Recipe(num_rollout=3), model=ModelConfig(hf_checkpoint="m"), run_id=cfg.run_id)


def test_bad_flags_raise_config_errors():
    with pytest.raises(ConfigError, match="unrecognized arguments: --n-sample-per-prompt"):
        TrainConfig.from_cli_args(["--n-sample-per-prompt", "4"])
    with pytest.raises(
        ConfigError, match=r"n_samples_per_prompt='8.0': --n-samples-per-prompt expects a whole number"
    ):
        TrainConfig.from_cli_args(["--n-samples-per-prompt", "8.0"])
    with pytest.raises(ConfigError, match="lr='fast'"):
        TrainConfig.from_cli_args(["--lr", "fast"])
    with pytest.raises(ConfigError, match="preset='qwen9'"):
        load_train_config(["--preset", "qwen9"])
    with pytest.raises(ConfigError, match="environment"):
        TrainConfig.from_cli_args(["--environment", "{bad"])


TOML_TABLES = """
preset = "qwen3-4b"
output_dir = "runs/toml"

[recipe]
lr = 1e-6
colocate = false
rollout_num_gpus = 8
environment = { NCCL_DEBUG = "INFO" }

[model]
hf_checkpoint = "/models/Qwen3-4B"
dtype = "bfloat16"

[dataset]
prompt_data = "gsm8k.jsonl"
input_key = "question"
label_key = "answer"
apply_chat_template_kwargs = { enable_thinking = false }

[metrics]
wandb_project = "raygym"
"""


def test_toml_tables_then_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML_TABLES)
    for include in (["@", str(path)], [f"@{path}"]):
        cfg = load_train_config([*include, "--lr", "2e-6", "--wandb-group", "g"])
        assert cfg.recipe.lr == 2e-6  # flag beats file
        assert cfg.recipe.colocate is False and cfg.recipe.rollout_num_gpus == 8
        assert cfg.recipe.environment == {"NCCL_DEBUG": "INFO"}
        assert cfg.recipe.max_tokens_per_gpu == 8192  # from the preset
        assert (cfg.model.hf_checkpoint, cfg.model.dtype) == ("/models/Qwen3-4B", "bfloat16")
        assert (cfg.dataset.input_key, cfg.dataset.label_key) == ("question", "answer")
        assert cfg.dataset.apply_chat_template_kwargs == {"enable_thinking": False}
        assert (cfg.metrics.wandb_project, cfg.metrics.wandb_group) == ("raygym", "g")
        assert cfg.output_dir == "runs/toml"


def test_toml_flat_keys_and_later_files_win(tmp_path):
    first = tmp_path / "a.toml"
    first.write_text('preset = "tiny"\nnum_rollout = 5\nprompt_data = "data.jsonl"\nwandb_mode = "offline"\n')
    second = tmp_path / "b.toml"
    second.write_text("num_rollout = 6\n")
    cfg = load_train_config([f"@{first}", f"@{second}"])
    assert cfg.recipe.num_rollout == 6 and cfg.recipe.rollout_engine == "raygym"
    assert cfg.dataset.prompt_data == "data.jsonl" and cfg.metrics.wandb_mode == "offline"
    # an @-looking value of a flag is a value, not a file
    cfg = load_train_config([f"@{first}", "--wandb-name", "@home"])
    assert cfg.metrics.wandb_name == "@home"


def test_toml_errors(tmp_path):
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text("[recipe]\nlrr = 1.0\n")
    with pytest.raises(ConfigError, match=r"\[recipe\] lrr: not a field of Recipe \(did you mean lr"):
        load_train_config([f"@{bad_key}"])
    broken = tmp_path / "broken.toml"
    broken.write_text("lr = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_train_config([f"@{broken}"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config([f"@{tmp_path / 'missing.toml'}"])
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text("num_rollout = 2.0\n")
    with pytest.raises(ConfigError, match="num_rollout=2.0"):
        load_train_config([f"@{wrong_type}"])


def test_json_dict_round_trip():
    cfg = TrainConfig(recipe=Recipe(custom_rm_function=reward_exact, eval_config={"a": [1, 2]}),
                      model=ModelConfig(hf_checkpoint="m"))  # fmt: skip
    data = cfg.to_json_dict()
    assert json.loads(json.dumps(data)) == data
    assert TrainConfig.model_validate(data) == cfg


# ---- hypothesis: the same property with shrinking, and any text in a free-text field ----------------
from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# String fields whose value is free text (no choices, no import path, no URL rules): any text must survive.
FREE_TEXT_FIELDS = (
    (ModelConfig, "hf_checkpoint"),
    (DatasetConfig, "input_key"),
    (DatasetConfig, "label_key"),
    (MetricsConfig, "wandb_project"),
    (MetricsConfig, "wandb_group"),
    (Recipe, "update_weight_disk_dir"),
)
ARGV_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=24)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_hypothesis_drawn_configs_round_trip_exactly(rng):
    cfg = random_config(rng)
    args = cfg.cli_args()
    back = TrainConfig.from_cli_args(args)
    assert back == cfg and back.cli_args() == args


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FREE_TEXT_FIELDS), ARGV_TEXT)
@example((MetricsConfig, "wandb_project"), "--")  # argparse reads a bare "--" as the end of options
@example((DatasetConfig, "input_key"), "-1e-3")
@example((ModelConfig, "hf_checkpoint"), "@run.toml")  # looks like a TOML include
@example((MetricsConfig, "wandb_group"), "")
def test_any_text_in_a_free_text_field_round_trips(field, value):
    model, name = field
    sections = {ModelConfig: "model", DatasetConfig: "dataset", MetricsConfig: "metrics", Recipe: "recipe"}
    parts = {"model": {"hf_checkpoint": "m"}, "dataset": {}, "metrics": {}, "recipe": {}}
    parts[sections[model]][name] = value
    try:
        cfg = TrainConfig(recipe=Recipe(**parts["recipe"]), model=ModelConfig(**parts["model"]),
                          dataset=DatasetConfig(**parts["dataset"]), metrics=MetricsConfig(**parts["metrics"]))
    except ConfigError:
        assume(False)  # a value the field refuses (e.g. a secret-looking string) has nothing to round-trip
    back = TrainConfig.from_cli_args(cfg.cli_args())
    assert getattr(getattr(back, sections[model]), name) == value
    assert back == cfg
