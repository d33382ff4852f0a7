"""The TRL side of ``raygym bench e2e``: the same GRPO step through TRL's ``GRPOTrainer``.

Runs in TRL's own interpreter (TRL is not a raygym dependency). Create it once with
``python -m venv --system-site-packages .venv-trl && .venv-trl/bin/pip install trl``, then
``raygym bench e2e --trl-python .venv-trl/bin/python`` runs this module there as a subprocess (``python -m``, with
the caller's raygym on ``PYTHONPATH``).

Same task (a builtin task's prompts and shaped reward, imported from ``raygym.builtin``: ``--task next-digit`` or
``long-tail``), same model (a Qwen3 checkpoint directory written by ``raygym.builtin``), same group size, prompts
per step, response length and learning rate; one optimizer step per generation, no KL term, TRL's default loss (``dapo``: token-level, which
``raygym.bench.e2e`` sets on raygym's side too), CPU. Prints one JSON
line: ``{"trl_seconds_per_step": ..., "phases": {...}, "steps": ..., "reward_first": ..., "reward_last": ...}``.

``phases`` splits TRL's mean step the way ``raygym.bench.e2e`` splits raygym's: ``generate_s`` (time inside
``GRPOTrainer._generate_single_turn``, HF ``generate``), ``reward_s`` (inside ``_calculate_rewards``) and
``train_s`` (the rest of the step: tokenization, the loss's forward, backward and the optimizer step).

    .venv-trl/bin/python -m raygym.bench.trl_baseline --model-dir /tmp/tiny-qwen3 --steps 12 --task long-tail
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from raygym.builtin import TASK_ROWS, long_tail_reward, next_digit_reward  # the tasks raygym trains on

REWARDS = {"builtin:next-digit": next_digit_reward, "builtin:long-tail": long_tail_reward}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="HF checkpoint directory (model + tokenizer)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (rollout_batch_size)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (n_samples_per_prompt)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--task", choices=("next-digit", "long-tail"), default="next-digit", help="builtin task")
    args = p.parse_args(argv)
    task = f"builtin:{args.task}"
    task_reward = REWARDS[task]

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[import-not-found]  # TRL's own interpreter

    class StepClock(TrainerCallback):
        """Each step's seconds, and the seconds spent inside the trainer methods ``timed`` wraps."""

        def __init__(self) -> None:
            self.started = 0.0
            self.seconds: list[float] = []
            self.rewards: list[float] = []
            self.lengths: list[float] = []  # mean completion length per step
            self.inside: dict[str, float] = {"generate_s": 0.0, "reward_s": 0.0}
            self.phases: list[dict[str, float]] = []

        def timed(self, phase: str, method):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return method(*a, **kw)
                finally:
                    self.inside[phase] += time.perf_counter() - t0
            return wrapper

        def on_step_begin(self, args, state, control, **kwargs):
            self.inside = dict.fromkeys(self.inside, 0.0)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.started
            self.seconds.append(step)
            self.phases.append({**self.inside, "train_s": step - sum(self.inside.values())})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    def reward(prompts, completions, label, **kwargs):
        return [task_reward(c, lab) for c, lab in zip(completions, label, strict=True)]

    rows = TASK_ROWS[task](max(1024, args.prompts * (args.steps + 1)), args.seed)
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.group,  # completions per optimizer step
            num_generations=args.group,
            max_completion_length=args.max_new_tokens,
            steps_per_generation=1,
            num_iterations=1,
            learning_rate=args.lr,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=0.0,
            temperature=1.0,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=args.seed,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=config,
                              train_dataset=Dataset.from_list(rows), callbacks=[clock])
        trainer._generate_single_turn = clock.timed("generate_s", trainer._generate_single_turn)
        trainer._calculate_rewards = clock.timed("reward_s", trainer._calculate_rewards)
        trainer.train()
    measured = clock.seconds[args.warmup:] or clock.seconds
    phases = clock.phases[args.warmup:] or clock.phases
    print(json.dumps({
        "trl_seconds_per_step": sum(measured) / len(measured),
        "phases": {k: sum(ph[k] for ph in phases) / len(phases) for k in phases[0]},
        "task": task,
        "steps": len(clock.seconds),
        "measured_steps": len(measured),
        "reward_first": clock.rewards[0] if clock.rewards else None,
        "reward_last": clock.rewards[-1] if clock.rewards else None,
        "completion_len_mean": sum(clock.lengths) / len(clock.lengths) if clock.lengths else None,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
