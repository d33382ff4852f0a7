"""A tied embedding is sent once by the torch backend (as SGLang and vLLM load it, and as the Megatron
backend sends it), and an engine with the same tie still ends with both names updated and verified."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from trainer_setup import settings_for

from raygym.config import Recipe
from raygym.engines.serving.weight_receiver import WeightReceiver
from raygym.weightsync.codec import checksum
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.engine_link import LocalEngineLink
from raygym.weightsync.sender import RankWeightSync
from raygym.weightsync.sources import WeightSources

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_copy(path: str, out: Path) -> str:
    """The tiny checkpoint with ``tie_word_embeddings=True`` (tokenizer files copied as they are)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for item in Path(path).iterdir():
        if item.is_file() and item.suffix != ".safetensors" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    return str(out)


class BackendTrainer:
    """Trainer rank 0 in this process around a backend, with TrainerActor's weight-sync methods."""

    def __init__(self, backend):
        self.backend, self.wsync = backend, RankWeightSync(0)

    def init_weight_sync(self, spec):
        return self.wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False, refresh_snapshot: bool = True):
        return self.wsync.push(version, self.backend.iter_hf_weights(), force_full, refresh_snapshot)

    def commit_weights(self, version: int) -> None:
        self.wsync.commit(version)

    def discard_weights(self) -> None:
        self.wsync.discard()

    def close_weight_sync(self) -> None:
        self.wsync.close()


def test_a_tied_embedding_is_sent_once_and_the_tied_engine_gets_it_under_both_names(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from raygym.trainer.torch_backend import TorchBackend

    plain = TorchBackend(settings_for(tiny_model_path))
    plain.init()
    untied = [n for n, _ in plain.iter_hf_weights()]
    assert EMBED in untied and HEAD in untied  # an untied head is a weight of its own
    path = tied_copy(tiny_model_path, tmp_path / "tied")
    backend = TorchBackend(settings_for(path))
    backend.init()
    names = [n for n, _ in backend.iter_hf_weights()]
    assert EMBED in names and HEAD not in names and len(names) == len(set(names))
    assert set(names) == set(untied) - {HEAD}
    with torch.no_grad():
        backend.model.get_input_embeddings().weight.add_(0.25)  # the trainer moved on
    engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert engine.lm_head.weight is engine.model.embed_tokens.weight
    receiver = WeightReceiver(engine, sources=WeightSources(["memory://raygym-tied"]))
    sync = WeightSync(Recipe(update_weight_transport="disk", update_weight_disk_dir="memory://raygym-tied",
                             update_weight_mode="full", colocate=False),
                      [BackendTrainer(backend)], [LocalEngineLink(receiver, "tied-engine")])
    sync.setup()
    metrics = sync.push(1)
    assert metrics["sync/verified_tensors"] == len(names) and metrics["sync/full_resyncs"] == 0.0
    want = checksum(dict(backend.iter_hf_weights())[EMBED])
    got = receiver.weights_checksum(names=[EMBED, HEAD])["checksums"]
    assert got == {EMBED: want, HEAD: want}
