"""Sampler-vs-learner mismatch metrics as RL frameworks log them (REFERENCES.md section 6, verl names).

With mu the sampler's and pi the learner's probability of each sampled token and rho = pi / mu:
  kl        = E[log mu - log pi]
  k3        = E[rho - log rho - 1]
  log_ppl_diff = log ppl(mu) - log ppl(pi) = E[-log mu] - E[-log pi];  ppl_ratio = exp(log_ppl_diff)
  chi2      = E[rho^2] - 1
  max_abs   = max |log mu - log pi|
"""
from __future__ import annotations

import math

import torch


def mismatch(logp_sampler: torch.Tensor, logp_learner: torch.Tensor) -> dict[str, float]:
    """Metrics over matching 1-D float tensors of per-token log-probs (computed in float64)."""
    if logp_sampler.shape != logp_learner.shape or logp_sampler.dim() != 1:
        raise ValueError(f"need two 1-D tensors of one length, got {tuple(logp_sampler.shape)} "
                         f"and {tuple(logp_learner.shape)}")
    mu, pi = logp_sampler.double(), logp_learner.double()
    log_rho = pi - mu
    rho = log_rho.exp()
    log_ppl_diff = float((-mu).mean() - (-pi).mean())
    return {"tokens": mu.numel(), "kl": float((mu - pi).mean()), "k3": float((rho - log_rho - 1).mean()),
            "log_ppl_diff": log_ppl_diff, "ppl_ratio": math.exp(log_ppl_diff), "chi2": float((rho ** 2).mean() - 1),
            "max_abs": float(log_rho.abs().max())}
