"""The trainer's typed view of the config reaches the backends: model dtype, dropout, activation
checkpointing, the process-group timeout, the reference model source and the declared architecture."""

from __future__ import annotations

import datetime

import pytest
import torch
from trainer_setup import make_batch, settings_for, trainer_settings

from raygym.errors import ConfigError
from raygym.trainer.megatron_model import MegatronOptions
from raygym.trainer.torch_backend import TorchBackend, compute_dtype, has_active_dropout


def test_view_fields_come_from_the_recipe_and_the_model_config():
    s = trainer_settings("m", model={"ref_checkpoint": "ref", "dtype": "float32", "hidden_size": 64},
                         lr=1e-5, distributed_timeout_minutes=3)
    assert (s.lr, s.hf_checkpoint, s.ref_load, s.dtype) == (1e-5, "m", "ref", "float32")
    assert s.dist_timeout == datetime.timedelta(minutes=3) and s.declared_architecture == {"hidden_size": 64}
    assert trainer_settings("m", model={"ref_checkpoint": "ref"}, ref_load="own").ref_load == "own"  # recipe first
    assert trainer_settings("m").ref_load == ""  # the initial policy weights
    with pytest.raises(AttributeError):
        s.lr = 1.0  # type: ignore[misc]  (frozen)


def test_model_dtype_is_the_megatron_params_dtype():
    opts = MegatronOptions.from_settings(trainer_settings("m", model={"dtype": "bfloat16"}, qkv_format="bshd"))
    assert opts.params_dtype == "bfloat16" and opts.torch_dtype(cuda=False) == torch.bfloat16
    assert opts.qkv_format == "bshd"
    assert MegatronOptions.from_settings(trainer_settings("m")).torch_dtype(cuda=False) == torch.float32


def test_torch_compute_dtype():
    assert compute_dtype("auto", cuda=True) == torch.bfloat16 and compute_dtype("auto", cuda=False) == torch.float32
    assert compute_dtype("bfloat16", cuda=True) == torch.bfloat16
    assert compute_dtype("float32", cuda=True) == compute_dtype("float32", cuda=False) == torch.float32
    with pytest.raises(ConfigError, match="dtype='float16'.*loss scaling"):
        compute_dtype("float16", cuda=True)
    with pytest.raises(ConfigError, match="dtype='bfloat16'.*float32 on CPU"):
        compute_dtype("bfloat16", cuda=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal of half precision")
def test_torch_backend_refuses_half_precision_on_cpu(tiny_model_path):
    with pytest.raises(ConfigError, match="dtype='bfloat16'"):
        TorchBackend(settings_for(tiny_model_path, model={"dtype": "bfloat16"})).init()


def test_float32_dtype_trains_like_auto_on_cpu(tiny_model_path):
    if torch.cuda.is_available():
        pytest.skip("on a GPU 'auto' computes in bfloat16")
    batch = make_batch(seed=6)
    metrics = []
    for dtype in ("auto", "float32"):
        backend = TorchBackend(settings_for(tiny_model_path, model={"dtype": dtype}))
        backend.init()
        metrics.append(backend.train_step(batch.with_log_probs(backend.compute_log_probs(batch))
                                          .with_advantages("grpo"), 0)["train/pg_loss"])
    assert metrics[0] == metrics[1]


def test_attention_dropout_reaches_the_hf_model_and_hidden_dropout_is_refused(tiny_model_path):
    backend = TorchBackend(settings_for(tiny_model_path, attention_dropout=0.1))
    info = backend.init()
    assert backend.model.config.attention_dropout == 0.1 and has_active_dropout(backend.model)
    assert info["single_pass_log_probs"] is False  # train-mode log-probs would differ from the eval pass
    with pytest.raises(ConfigError, match="hidden_dropout=0.1: the torch backend"):
        TorchBackend(settings_for(tiny_model_path, hidden_dropout=0.1))


def test_activation_checkpointing_is_a_recipe_field(tiny_model_path):
    def checkpointing(model) -> bool:
        if hasattr(model, "is_activation_checkpointing"):  # transformers 5
            return bool(model.is_activation_checkpointing)
        return bool(model.is_gradient_checkpointing)

    on = TorchBackend(settings_for(tiny_model_path, torch_activation_checkpointing=True))
    off = TorchBackend(settings_for(tiny_model_path))
    on.init()
    off.init()
    assert checkpointing(on.model) and not checkpointing(off.model)


def test_declared_architecture_is_checked_against_the_checkpoint(tiny_model_path):
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny_model_path).hidden_size
    TorchBackend(settings_for(tiny_model_path, model={"hidden_size": hidden})).init()
    with pytest.raises(ConfigError, match=rf"hidden_size={hidden + 1}: the checkpoint .* has hidden_size={hidden}"):
        TorchBackend(settings_for(tiny_model_path, model={"hidden_size": hidden + 1})).init()
    with pytest.raises(ConfigError, match="num_experts=4: .* has num_experts=None"):
        TorchBackend(settings_for(tiny_model_path, model={"num_experts": 4})).init()
