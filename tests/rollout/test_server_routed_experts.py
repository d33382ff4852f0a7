"""raygym's server answers ``return_routed_experts`` as stock SGLang does (started with
``--enable-return-routed-experts``): base64 int32 ``[prompt + output - 1, layers, top_k]``, the experts each
router chose for every token a forward pass read. Checked against the HF model's own router logits (top-k of the
gate's logits on the whole sequence, computed here, not by raygym), for several requests batched together, a
prompt prefix shared between them and sampled answers; a server started without the flag refuses the request
and names the flag."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from raygym.builtin import TINY_MOE_MODEL, materialize_model
from raygym.routed_experts import SERVER_FLAG, decode
from tests.weightsync.raygym_servers import raygym_servers

PROMPTS = [[3, 4, 5, 6], [3, 4, 5, 9, 10, 11], [20, 21]]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return materialize_model(TINY_MOE_MODEL, tmp_path_factory.mktemp("moe"), seed=0)


def post(url: str, body: dict) -> httpx.Response:
    from raygym.engine_api.auth import auth_headers

    return httpx.post(f"{url}/generate", json=body, headers=auth_headers(), timeout=120)


def hf_top_k(model_path: str, tokens: list[int]) -> np.ndarray:
    """``[len(tokens) - 1, layers, top_k]``: each layer's top-k experts by its gate's logits, the HF model's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    logits: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, a[0] @ m.weight.T))
    with torch.no_grad():
        model(torch.tensor([tokens[:-1]]))
    return torch.stack([logits[i].topk(k, dim=-1).indices for i in sorted(logits)], dim=1).numpy()


def test_routed_experts_are_the_models_own_choices(moe_model):
    with raygym_servers(moe_model, 1, "float32", extra_args=[SERVER_FLAG]) as urls:
        answer = post(urls[0], {"input_ids": PROMPTS, "return_routed_experts": True,
                                "sampling_params": {"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True}})
    assert answer.status_code == 200, answer.text
    layers, top_k = 2, 2
    for prompt, row in zip(PROMPTS, answer.json(), strict=True):
        tokens = prompt + row["output_ids"]
        assert len(row["output_ids"]) == 7
        got = decode(row["meta_info"]["routed_experts"], len(tokens)).reshape(len(tokens) - 1, layers, top_k)
        want = hf_top_k(moe_model, tokens)
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1)), (got.tolist(), want.tolist())


def test_a_server_without_the_flag_names_it(moe_model):
    with raygym_servers(moe_model, 1, "float32") as urls:
        refused = post(urls[0], {"input_ids": PROMPTS[0], "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 2}})
        plain = post(urls[0], {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 400 and SERVER_FLAG in refused.text
    assert plain.status_code == 200 and "routed_experts" not in plain.json()["meta_info"]
