"""A trainer rank 0 in the test process: the tiny model, real AdamW steps, and the weight-sync methods
exactly as TrainerActor exposes them (shared by the weight-sync tests against raygym's server and SGLang)."""

from __future__ import annotations

import torch

from raygym.weightsync.codec import checksum
from raygym.weightsync.sender import RankWeightSync


class LocalTrainer:
    """Trainer rank 0 in this process: the tiny model, real AdamW steps, and the weight-sync methods
    exactly as TrainerActor exposes them."""

    def __init__(self, model_path: str, lr: float = 5e-6):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.wsync = RankWeightSync(0)

    def train_step(self) -> None:
        ids = torch.randint(2, self.model.config.vocab_size, (4, 16))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def hf_weights(self):
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    def engine_checksums(self) -> dict[str, str]:
        return {n: checksum(t.to(torch.bfloat16)) for n, t in self.hf_weights()}

    def init_weight_sync(self, spec):
        return self.wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False, refresh_snapshot: bool = True):
        return self.wsync.push(version, self.hf_weights(), force_full, refresh_snapshot)

    def commit_weights(self, version: int) -> None:
        self.wsync.commit(version)

    def discard_weights(self) -> None:
        self.wsync.discard()

    def reconnect_weight_sync(self):
        return self.wsync.reconnect()

    def close_weight_sync(self) -> None:
        self.wsync.close()

    def probe_log_probs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """What TrainerActor.probe_log_probs returns: log-probs of ``responses`` after ``prompts`` (temperature 1)."""
        out = []
        with torch.no_grad():
            for prompt, response in zip(prompts, responses, strict=True):
                ids = torch.tensor([prompt + response])
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist())
        return out
