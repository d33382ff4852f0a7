"""A LoRA run end to end on CPU, as a user runs it (`raygym ...` subprocesses, each with its own local Ray):

- `raygym train --lora-rank 8` (tiny preset, raygym's server): every sync sends the adapters only and verifies
  each of them by checksum; the engine generates with the trainer's adapters (log-prob mismatch ~1e-7); the
  checkpoints and the final export hold the adapter in PEFT's format, which ``peft`` loads;
- a run resumed from the step-1 checkpoint continues at step 2 with the same samples as the uninterrupted run
  (the engines got the checkpoint's adapters, not the fresh ones);
- `raygym eval` of the final checkpoint reproduces the run's last eval exactly (base + adapter on the engine);
- `raygym export --merged` is the same model as base + adapter;
- `raygym serve` answers with the adapter applied (its log-probs are peft's, not the base model's);
- `raygym report` renders the run.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.e2e.test_after_training import REPO_ROOT, _env, _free_port, _raygym

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KEY = "e2e-lora-serve-key-31c7"
ADAPTER_TENSORS = 2 * (7 * 2 + 1)  # (A, B) x (q k v o gate up down in 2 layers + lm_head)
EXACT_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/generated_tokens")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """Run A: 4 steps, checkpoints after steps 1 and 3, eval at steps 1 and 3. Run B: resumed from a copy of A's
    step-1 checkpoint (what a run killed after it leaves), to step 3."""
    from raygym.builtin import next_digit_rows

    root = tmp_path_factory.mktemp("lora")
    data = root / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in next_digit_rows(32, seed=5)))
    common = ["train", "--lora-rank", "8", "--num-rollout", "4", "--save-interval", "2", "--eval-interval", "2",
              "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--seed", "7",
              "--eval-prompt-data", json.dumps({"digits": str(data)})]
    a, b = root / "a", root / "b"
    done = _raygym(*common, "--output-dir", str(a), timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    save = b / "checkpoints"
    shutil.copytree(a / "checkpoints" / "iter_0000001", save / "iter_0000001")
    rows = (a / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")
    done = _raygym(*common, "--output-dir", str(b), "--save", str(save), "--load", str(save), timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "continuing at step 2" in done.stdout
    return a, b


def rows_of(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def response_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def test_only_adapters_are_synced_and_they_are_what_the_engine_serves(lora_runs):
    from peft import PeftConfig

    a, _ = lora_runs
    rows = rows_of(a)
    assert sorted(rows) == [0, 1, 2, 3]
    sizes = {r["sync/raw_bytes"] for r in rows.values()}
    assert len(sizes) == 1 and sizes.pop() < 100_000  # fp32 adapters of rank 8; the base model is 0.35 MB
    for r in rows.values():
        assert r["sync/verified_tensors"] == ADAPTER_TENSORS and r["sync/full_resyncs"] == 0
        assert r["rollout/logprob_mismatch_mean"] < 1e-5  # the engine generates with exactly the trained adapters
    assert rows[3]["rollout/reward_mean"] >= 0.0 and "eval/digits/reward_mean" in rows[3]
    for step in ("iter_0000001", "iter_0000003"):
        assert (a / "checkpoints" / step / "adapter" / "adapter_model.safetensors").is_file()
    config = PeftConfig.from_pretrained(str(a / "hf"))  # the end-of-run export: the adapter
    assert config.r == 8 and "lm_head" in config.target_modules


def test_resume_sends_the_checkpoints_adapters_to_the_engines(lora_runs):
    a, b = lora_runs
    ra, rb = rows_of(a), rows_of(b)
    assert sorted(rb) == [0, 1, 2, 3]
    for step in (2, 3):  # same samples as the uninterrupted run: the engine served the checkpoint's adapters
        for key in EXACT_KEYS:
            assert rb[step][key] == ra[step][key], (step, key)
        assert rb[step]["rollout/logprob_mismatch_mean"] < 1e-5
        assert rb[step]["train/pg_loss"] == pytest.approx(ra[step]["train/pg_loss"], rel=1e-4, abs=1e-6)


def test_eval_reproduces_the_runs_last_eval(lora_runs):
    a, _ = lora_runs
    done = _raygym("eval", str(a), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((a / "eval" / "iter_0000003" / "metrics.json").read_text())
    expected = {k: v for k, v in rows_of(a)[3].items() if k.startswith("eval/")}
    assert expected and {k: summary["metrics"][k] for k in expected} == expected


def test_merged_export_is_the_base_with_the_adapter(lora_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    a, _ = lora_runs
    done = _raygym("export", str(a / "checkpoints"), str(tmp_path / "merged"), "--merged", timeout=120)
    assert done.returncode == 0 and "the merged model" in done.stdout, done.stdout + done.stderr
    base_dir = json.loads((a / "hf" / "adapter_config.json").read_text())["base_model_name_or_path"]
    prompt, response = [15, 16, 17, 18], [19, 20, 1]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                     str(a / "hf")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert response_log_probs(merged, prompt, response) == pytest.approx(
        response_log_probs(peft, prompt, response), abs=1e-5)


def test_serve_answers_with_the_adapter_applied(lora_runs):
    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a, _ = lora_runs
    port = _free_port()
    env, ray_tmp = _env(RAYGYM_SERVE_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "raygym", "serve", str(a), "--port", str(port)], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    printed: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            printed.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        base = model = None
        while base is None:
            line = lines.get(timeout=240)
            assert line is not None, "".join(printed)[-4000:]
            match = re.search(r"serving (\S+) at (http://\S+/v1)", line)
            if match:
                model, base = match.group(1), match.group(2)
        assert any("LoRA adapter" in line for line in printed), "".join(printed)
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        answer = client.completions.create(model=model, prompt="next:3=", max_tokens=4, temperature=1.0, seed=5,
                                           logprobs=0)
        served = answer.choices[0].logprobs.token_logprobs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(a / "hf"))
    prompt = tokenizer.encode("next:3=")
    tokens = answer.choices[0].logprobs.tokens
    shown = next((i for i, t in enumerate(tokens) if len(t) != 1), len(tokens))  # the characters before an EOS
    assert shown >= 1, tokens
    response, served = tokenizer.encode("".join(tokens[:shown])), served[:shown]
    base_dir = json.loads((a / "hf" / "adapter_config.json").read_text())["base_model_name_or_path"]
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    expected = response_log_probs(PeftModel.from_pretrained(plain, str(a / "hf")).eval(), prompt, response)
    assert served == pytest.approx(expected, abs=1e-4)  # base + the run's adapter
    without = response_log_probs(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval(),
                                 prompt, response)
    assert max(abs(x - y) for x, y in zip(served, without, strict=True)) > 1e-3  # not the base alone


def test_report_renders_a_lora_run(lora_runs, tmp_path):
    a, _ = lora_runs
    out = tmp_path / "report.html"
    done = _raygym("report", str(a), "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    html = out.read_text()
    assert "lora_rank" in html and "sync/raw_bytes" in html


def test_colocated_lora_run_syncs_verified_adapters(tmp_path):
    """Trainer and engine on one (logical) GPU: the engine releases its memory for training and takes the
    adapters back through the colocated transport, each verified."""
    done = _raygym("train", "--lora-rank", "8", "--colocate", "--no-rollout-num-gpus", "--num-rollout", "2",
                   "--save-interval", "1000", "--output-dir", str(tmp_path / "run"), timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = rows_of(tmp_path / "run")
    assert sorted(rows) == [0, 1]
    for r in rows.values():
        assert r["sync/verified_tensors"] == ADAPTER_TENSORS and r["sync/full_resyncs"] == 0
        assert r["rollout/logprob_mismatch_mean"] < 1e-5
    assert "sharing the trainer's GPUs" in done.stdout
