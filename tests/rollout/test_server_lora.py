"""raygym's server serving LoRA adapters trained elsewhere: started with a PEFT adapter directory
(``--lora-adapter``, what ``raygym serve`` / ``raygym eval`` pass) it computes exactly what ``peft`` computes;
SGLang's ``/load_lora_adapter`` / ``/unload_lora_adapter`` swap adapters, and a request naming an adapter that is
not loaded is refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from raygym.lora import ADAPTER_NAME
from tests.weightsync.raygym_servers import raygym_servers

PROMPT, RESPONSE = [5, 6, 7, 8], [9, 10, 11, 12, 13]


def peft_adapter(model_path: str, out: str, seed: int) -> list[float]:
    """A PEFT adapter with random (non-zero) B saved to ``out``; returns peft's log-probs of RESPONSE."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.save_pretrained(out)
    return log_probs(model.eval())


def log_probs(model: torch.nn.Module) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + RESPONSE])).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(RESPONSE)[:, None]).squeeze(-1).tolist()


def post(url: str, route: str, body: dict) -> httpx.Response:
    from raygym.engine_api.auth import auth_headers

    return httpx.post(f"{url}/{route}", json=body, headers=auth_headers(), timeout=60)


def engine_log_probs(url: str, **extra) -> list[float]:
    answer = post(url, "generate", {"input_ids": PROMPT + RESPONSE, "return_logprob": True,
                                    "logprob_start_len": len(PROMPT) - 1,
                                    "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}, **extra})
    assert answer.status_code == 200, answer.text
    return [float(e[0]) for e in answer.json()["meta_info"]["input_token_logprobs"][1:]]


def test_adapters_are_served_as_peft_computes_them(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    first = peft_adapter(tiny_model_path, str(tmp_path / "a"), seed=1)
    second = peft_adapter(tiny_model_path, str(tmp_path / "b"), seed=2)
    base = log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval())
    with raygym_servers(tiny_model_path, 1, "float32", extra_args=["--lora-adapter", str(tmp_path / "a")]) as urls:
        url = urls[0]
        assert engine_log_probs(url) == pytest.approx(first, abs=1e-5)
        assert engine_log_probs(url, lora_path=ADAPTER_NAME) == pytest.approx(first, abs=1e-5)
        refused = post(url, "generate", {"input_ids": PROMPT, "lora_path": "other",
                                         "sampling_params": {"max_new_tokens": 1}})
        assert refused.status_code == 400 and "lora_path='other'" in refused.text

        assert post(url, "load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")}).status_code == 400
        assert post(url, "unload_lora_adapter", {"lora_name": ADAPTER_NAME}).json()["success"]
        assert engine_log_probs(url) == pytest.approx(base, abs=1e-5)  # no adapter: the base model
        loaded = post(url, "load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert loaded.json() == {"success": True, "loaded_adapters": {"b": str(tmp_path / "b")}}
        assert engine_log_probs(url, lora_path="b") == pytest.approx(second, abs=1e-5)
        missing = post(url, "load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "nowhere")})
        assert missing.status_code == 400 and "adapter_config.json" in missing.text
        assert engine_log_probs(url, lora_path="b") == pytest.approx(second, abs=1e-5)  # a failed load changes nothing
