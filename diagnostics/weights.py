"""Per-token weights for the learner's loss that correct for the sampler-learner mismatch.

Inputs as in `diagnostics.gaps`: logp_sampler, logp_learner float [B, T], mask bool [B, T],
advantages [B] or [B, T]. Every function returns float64 [B, T] weights, 0 outside the mask; the
learner multiplies its per-token policy-gradient term by them. rho = exp(g), g = logp_learner -
logp_sampler.

  tis      truncated importance sampling: w = min(rho, C)                            C = 2
  icepop   keep a token only when its ratio lies in the band: w = 1[lo <= rho <= hi]  [0.5, 5]
  opsm     off-policy sequence masking (DeepSeek-V3.2, as in TRL): drop a whole response when
           A < 0 and mean_t(logp_sampler - logp_learner) > delta; w = 1 otherwise   delta = 0.03
  triage   TRIAGE-style gate + bounded repair (the miniTE report's outline, made concrete here):
    gate   in a response with A < 0, cut it into `risk_segment`-token segments (64); a segment is
           risky when its negative-tail depth D_s = max(0, -min g) >= `risk_depth` (1.0 nats);
           in risky segments every negative-gap token (g < 0) is attenuated to
           w = max(rho, gate_floor) (gate_floor 0): the deeper the learner sits below the sampler,
           the less a negative update pushes it further down
    repair in a response with A > 0, cut it into `repair_segment`-token segments (128); a segment
           whose mean gap o_s is negative (the learner is offset below the sampler on a rewarded
           stretch) gets w = exp(min(-o_s, repair_bound)) on all its tokens (repair_bound = ln 2,
           so at most 2x): the segment's offset is undone, but never by more than the bound
    other tokens w = 1; A == 0 responses are untouched (w = 1).
"""
from __future__ import annotations

import math

import torch

from .gaps import as_batch, broadcast_advantages, segments


def tis(logp_sampler, logp_learner, mask=None, *, cap: float = 2.0) -> torch.Tensor:
    """w = min(rho, cap) on masked tokens."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    return torch.where(m, (pi - mu).exp().clamp(max=cap), 0.0)


def icepop(logp_sampler, logp_learner, mask=None, *, low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """w = 1 where low <= rho <= high, else 0 (and 0 outside the mask)."""
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got [{low}, {high}]")
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    rho = (pi - mu).exp()
    return (m & (rho >= low) & (rho <= high)).double()


def _response_advantage(advantages, shape: torch.Size, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per response [B]: the given [B], or the mean over masked tokens of [B, T]."""
    a = broadcast_advantages(advantages, shape)
    return (a * mask).sum(1) / mask.sum(1).clamp(min=1)


def opsm(logp_sampler, logp_learner, advantages, mask=None, *, delta: float = 0.03) -> torch.Tensor:
    """w = 0 for every token of a response with A < 0 and mean(logp_sampler - logp_learner) > delta."""
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    adv = _response_advantage(advantages, mu.shape, m)
    drift = ((mu - pi) * m).sum(1) / m.sum(1).clamp(min=1)                   # [B]
    drop = (adv < 0) & (drift > delta)
    return (m & ~drop[:, None]).double()


def triage(logp_sampler, logp_learner, advantages, mask=None, *, risk_segment: int = 64, risk_depth: float = 1.0,
           gate_floor: float = 0.0, repair_segment: int = 128, repair_bound: float = math.log(2.0)) -> torch.Tensor:
    """TRIAGE-style weights (module docstring): gate on risky segments of negative-advantage
    responses, bounded repair of negative segment offsets in positive-advantage responses."""
    if risk_depth < 0 or repair_bound < 0 or not 0 <= gate_floor <= 1:
        raise ValueError(f"need risk_depth >= 0, repair_bound >= 0, 0 <= gate_floor <= 1; got {risk_depth}, "
                         f"{repair_bound}, {gate_floor}")
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    g = pi - mu
    adv = _response_advantage(advantages, g.shape, m)
    w = m.double()

    risk = segments(g, m, risk_segment)
    risky = (risk.tail_depth >= risk_depth) & (adv[risk.row] < 0)           # [S]
    in_risky = torch.zeros_like(m)
    in_risky[m] = risky[risk.ids[m]]
    gate = in_risky & (g < 0)
    w = torch.where(gate, g.exp().clamp(min=gate_floor), w)

    rep = segments(g, m, repair_segment)
    boost = torch.where((adv[rep.row] > 0) & (rep.mean_gap < 0), (-rep.mean_gap).clamp(max=repair_bound), 0.0)
    factor = torch.ones_like(w)
    factor[m] = boost[rep.ids[m]].exp()
    return w * factor
