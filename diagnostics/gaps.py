"""Log-prob layer: the per-token gap between learner and sampler, the metrics RL frameworks log,
and tail measures per segment.

Inputs are padded batches: `logp_sampler`, `logp_learner` float [B, T] (log-prob of each sampled
token under the sampler mu, as it sampled it, and under the learner pi, recomputed teacher-forced),
`mask` bool [B, T] (True on the response tokens that count), `advantages` float [B] (one per
response) or [B, T]. Everything is computed in float64.

Definitions (gap g = log pi - log mu = log rho, rho = pi / mu, E = mean over masked tokens):
  mean_abs_gap, max_abs_gap, gap quantiles      of |g| and g
  kl            E[log mu - log pi] = -E[g]                       (verl `rollout_corr` k1)
  k3            E[rho - log rho - 1]  (>= 0; ~ E[g^2] / 2 for small gaps)
  chi2          E[rho^2] - 1
  log_ppl_diff  log ppl(mu) - log ppl(pi) = E[-log mu] - E[-log pi] = E[g], per token pooled;
                ppl_ratio = exp(log_ppl_diff)
Segment measures (segment = `segment` consecutive response tokens of one sequence, counted over
masked tokens only; the last segment may be shorter):
  tail depth    D_s = max(0, -min_{t in s} g_t): how far the learner falls below the sampler at
                the worst token of the segment (nats)
  direction     a token's update pushes log pi in the direction sign(A_t). It "flips" relative to
                the sampler when the learner already sits on the other side of the sampler's value
                by more than `flip_margin`: sign(A_t) * g_t < -flip_margin, so a step smaller than
                |g_t| leaves pi on the wrong side of mu (the update, seen from the sampler that
                produced the token, goes the other way).
"""
from __future__ import annotations

import dataclasses
import math

import torch

QUANTILES = (0.5, 0.9, 0.99, 0.999)


def as_batch(logp_sampler, logp_learner, mask=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and promote to float64 [B, T] tensors (1-D inputs become one sequence); mask defaults
    to all True. Raises ValueError naming the mismatched tensor."""
    mu, pi = torch.as_tensor(logp_sampler, dtype=torch.float64), torch.as_tensor(logp_learner, dtype=torch.float64)
    if mu.dim() == 1:
        mu, pi = mu[None], pi[None]
    if mu.dim() != 2 or pi.shape != mu.shape:
        raise ValueError(f"logp_sampler {tuple(mu.shape)} and logp_learner {tuple(pi.shape)} must be one [B, T] shape")
    m = torch.ones(mu.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if m.dim() == 1:
        m = m[None]
    if m.shape != mu.shape:
        raise ValueError(f"mask {tuple(m.shape)} must have the log-prob shape {tuple(mu.shape)}")
    if not torch.isfinite(mu[m]).all() or not torch.isfinite(pi[m]).all():
        raise ValueError("logp_sampler / logp_learner: non-finite values on masked tokens")
    return mu, pi, m


def gap(logp_sampler, logp_learner) -> torch.Tensor:
    """g = logp_learner - logp_sampler, float64, same shape."""
    return torch.as_tensor(logp_learner, dtype=torch.float64) - torch.as_tensor(logp_sampler, dtype=torch.float64)


def gap_metrics(logp_sampler, logp_learner, mask=None) -> dict[str, float]:
    """The token-level metrics of the module docstring over the masked tokens (see `as_batch`)."""
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    g = (pi - mu)[m]
    if g.numel() == 0:
        raise ValueError("mask selects no tokens")
    rho = g.exp()
    a = g.abs()
    out = {"tokens": int(g.numel()), "mean_gap": float(g.mean()), "mean_abs_gap": float(a.mean()),
           "max_abs_gap": float(a.max()), "kl": float(-g.mean()), "k3": float((rho - g - 1).mean()),
           "chi2": float((rho ** 2).mean() - 1), "log_ppl_diff": float(g.mean()),
           "ppl_ratio": math.exp(float(g.mean()))}
    for q in QUANTILES:
        out[f"abs_gap_q{q:g}"] = float(torch.quantile(a, q))
    out["gap_min"], out["gap_max"] = float(g.min()), float(g.max())
    return out


def segment_ids(mask: torch.Tensor, segment: int) -> torch.Tensor:
    """int64 [B, T]: index of the segment each masked token falls in, counting masked tokens of its
    row from 0 (segment = rank // size, offset by row so segments never span rows); -1 where masked out."""
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    rank = mask.long().cumsum(1) - 1                                     # [B, T]
    per_row = (mask.long().sum(1).max().clamp(min=1) + segment - 1) // segment
    seg = rank // segment + torch.arange(mask.shape[0])[:, None] * per_row
    return torch.where(mask, seg, torch.full_like(seg, -1))


@dataclasses.dataclass(frozen=True)
class Segments:
    """Per segment (only segments holding masked tokens), in row-major order."""

    row: torch.Tensor        # int64 [S]   sequence of the segment
    ids: torch.Tensor        # int64 [B, T] segment index (into these arrays) per token, -1 outside
    min_gap: torch.Tensor    # float64 [S]
    mean_gap: torch.Tensor   # float64 [S]
    count: torch.Tensor      # int64 [S]

    @property
    def tail_depth(self) -> torch.Tensor:
        """D_s = max(0, -min g), float64 [S]."""
        return (-self.min_gap).clamp(min=0)


def segments(g: torch.Tensor, mask: torch.Tensor, segment: int) -> Segments:
    """Group masked tokens of g [B, T] into consecutive segments of `segment` tokens per sequence."""
    raw = segment_ids(mask, segment)
    used, ids = torch.unique(raw[mask], return_inverse=True)
    dense = torch.full_like(raw, -1)
    dense[mask] = ids
    s = used.numel()
    gm = g[mask]
    count = torch.zeros(s, dtype=torch.long).index_add_(0, ids, torch.ones_like(ids))
    mean = torch.zeros(s, dtype=torch.float64).index_add_(0, ids, gm) / count.clamp(min=1)
    mn = torch.full((s,), math.inf, dtype=torch.float64).scatter_reduce_(0, ids, gm, "amin")
    rows = torch.arange(g.shape[0])[:, None].expand_as(raw)[mask]
    row = torch.zeros(s, dtype=torch.long).scatter_(0, ids, rows)
    return Segments(row=row, ids=dense, min_gap=mn, mean_gap=mean, count=count)


def broadcast_advantages(advantages, shape: torch.Size) -> torch.Tensor:
    """Advantages [B] (per response) or [B, T] -> float64 [B, T]."""
    a = torch.as_tensor(advantages, dtype=torch.float64)
    if a.dim() == 1 and a.shape[0] == shape[0]:
        return a[:, None].expand(shape)
    if a.shape != shape:
        raise ValueError(f"advantages {tuple(a.shape)} must be [B]={shape[0]} or [B, T]={tuple(shape)}")
    return a


def tail_metrics(logp_sampler, logp_learner, mask=None, *, segment: int = 64, depth_threshold: float = 1.0
                 ) -> dict[str, float]:
    """Negative-tail depth per `segment`-token segment: mean, quantiles, max, and the share of segments
    whose depth reaches `depth_threshold` nats (TRIAGE's 'risky' segments with the same defaults)."""
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    seg = segments(pi - mu, m, segment)
    d = seg.tail_depth
    return {"segment": segment, "segments": int(d.numel()), "tail_depth_mean": float(d.mean()),
            "tail_depth_q0.9": float(torch.quantile(d, 0.9)), "tail_depth_max": float(d.max()),
            "risky_share": float((d >= depth_threshold).double().mean()), "depth_threshold": depth_threshold}


def direction_shares(logp_sampler, logp_learner, advantages, mask=None, *, flip_margin: float = 0.1
                     ) -> dict[str, float]:
    """Shares of masked tokens with A != 0 by (sign A, sign g), and the flip share of the module
    docstring (sign(A) * g < -flip_margin). Tokens with A == 0 have no update direction."""
    mu, pi, m = as_batch(logp_sampler, logp_learner, mask)
    g = pi - mu
    a = broadcast_advantages(advantages, g.shape)
    keep = m & (a != 0)
    n = int(keep.sum())
    if n == 0:
        return {"tokens": 0, "flip_share": 0.0, "pos_adv_pos_gap": 0.0, "pos_adv_neg_gap": 0.0,
                "neg_adv_pos_gap": 0.0, "neg_adv_neg_gap": 0.0, "flip_margin": flip_margin}
    ga, aa = g[keep], a[keep]

    def share(x: torch.Tensor) -> float:
        return float(x.double().sum() / n)

    return {"tokens": n, "flip_share": share(torch.sign(aa) * ga < -flip_margin),
            "pos_adv_pos_gap": share((aa > 0) & (ga >= 0)), "pos_adv_neg_gap": share((aa > 0) & (ga < 0)),
            "neg_adv_pos_gap": share((aa < 0) & (ga >= 0)), "neg_adv_neg_gap": share((aa < 0) & (ga < 0)),
            "flip_margin": flip_margin}
