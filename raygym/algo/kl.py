"""Per-token KL estimators between the policy and the reference policy.

With d = log_probs - ref_log_probs (both log-probs of the sampled tokens):
k1 = d, k2 = d**2 / 2, k3 = exp(-d) - 1 + d (unbiased, always >= 0), low_var_kl = k3 clamped to [-10, 10].

>>> import torch
>>> kl_penalty(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0]), "k1")
tensor([ 0., -1.])
"""

from __future__ import annotations

import torch

from raygym.errors import ConfigError

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_BOUND = 10.0


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference, same shape as the inputs.

    ``kind`` is one of ``"k1" | "k2" | "k3" | "low_var_kl"`` (the ``kl_loss_type`` field).
    """
    delta = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind in ("k3", "low_var_kl"):
        k3 = torch.expm1(-delta) + delta  # expm1 keeps precision when delta is tiny
        if kind == "low_var_kl":
            return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
        return k3
    raise ConfigError(f"kl_loss_type={kind!r}: unknown KL estimator; use one of {', '.join(KL_KINDS)}")
