"""One JSON-able report of the log-prob layer and the weights, from ragged per-sequence lists (what an
RL framework has at hand): the sidecar route `/v1/diagnostics` and `nvfp4-sampler diagnose` both
return it. Parameters and defaults: `Params` (documented in diagnostics.gaps / diagnostics.weights).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from . import gaps, weights


@dataclasses.dataclass(frozen=True)
class Params:
    """Defaults as stated in diagnostics.weights and diagnostics.gaps."""

    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    opsm_delta: float = 0.03
    risk_segment: int = 64
    risk_depth: float = 1.0
    gate_floor: float = 0.0
    repair_segment: int = 128
    repair_bound: float = math.log(2.0)
    flip_margin: float = 0.1


def pad(rows: Sequence[Sequence[float]], *, name: str, lengths: list[int] | None = None,
        dtype=torch.float64) -> torch.Tensor:
    """Ragged rows -> [B, T] zero-padded; with `lengths`, every row must have that length (else ValueError)."""
    if lengths is not None:
        if len(rows) != len(lengths):
            raise ValueError(f"{name}: {len(rows)} sequences, expected {len(lengths)}")
        bad = [i for i, (r, n) in enumerate(zip(rows, lengths)) if len(r) != n]
        if bad:
            raise ValueError(f"{name}: sequence {bad[0]} has {len(rows[bad[0]])} entries, expected {lengths[bad[0]]}")
    out = torch.zeros(len(rows), max((len(r) for r in rows), default=0), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(list(r), dtype=dtype)
    return out


def mismatch_report(logp_sampler: Sequence[Sequence[float]], logp_learner: Sequence[Sequence[float]], *,
                    advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
                    masks: Sequence[Sequence[bool]] | None = None, params: Params = Params()) -> dict:
    """Metrics, segment tails, update-direction shares and the four weight schemes.

    logp_sampler / logp_learner: per sequence, the log-prob of each response token (same lengths);
    advantages: one per sequence or one per token (needed for directions, OPSM and TRIAGE; without
    them those are omitted); masks: per token, True = counted (default all).
    Returns {"metrics", "tail", "directions"?, "weights": {name: per-sequence lists}, "weight_summary"}.
    """
    lengths = [len(r) for r in logp_sampler]
    mu = pad(logp_sampler, name="logp_sampler")
    pi = pad(logp_learner, name="logp_learner", lengths=lengths)
    valid = pad([[1.0] * n for n in lengths], name="mask").bool()
    mask = valid if masks is None else pad(masks, name="masks", lengths=lengths).bool() & valid
    p = params
    out = {"metrics": gaps.gap_metrics(mu, pi, mask),
           "tail": gaps.tail_metrics(mu, pi, mask, segment=p.risk_segment, depth_threshold=p.risk_depth)}
    w = {"tis": weights.tis(mu, pi, mask, cap=p.tis_cap),
         "icepop": weights.icepop(mu, pi, mask, low=p.icepop_low, high=p.icepop_high)}
    if advantages is not None:
        per_token = len(advantages) > 0 and isinstance(advantages[0], Sequence)
        adv = pad(advantages, name="advantages", lengths=lengths) if per_token else torch.tensor(
            list(advantages), dtype=torch.float64)
        if not per_token and adv.shape[0] != len(lengths):
            raise ValueError(f"advantages: {adv.shape[0]} values for {len(lengths)} sequences")
        out["directions"] = gaps.direction_shares(mu, pi, adv, mask, flip_margin=p.flip_margin)
        w["opsm"] = weights.opsm(mu, pi, adv, mask, delta=p.opsm_delta)
        w["triage"] = weights.triage(mu, pi, adv, mask, risk_segment=p.risk_segment, risk_depth=p.risk_depth,
                                     gate_floor=p.gate_floor, repair_segment=p.repair_segment,
                                     repair_bound=p.repair_bound)
    n = mask.sum().clamp(min=1)
    out["weight_summary"] = {k: {"mean": float((v * mask).sum() / n), "zeroed_share": float(((v == 0) & mask).sum() / n)}
                             for k, v in w.items()}
    out["weights"] = {k: [v[i, :m].tolist() for i, m in enumerate(lengths)] for k, v in w.items()}
    return out


def recompute_agreement(decode: Sequence[Sequence[float]], recompute: Sequence[Sequence[float]]) -> dict:
    """How far a sampler's decode log-probs are from its own teacher-forced recomputation of the same
    sequences (what strict mode makes bitwise equal): tokens, max and mean |difference|, share of tokens
    bitwise equal. Both: per sequence, the log-prob of each response token (same lengths)."""
    pairs = [(a, b) for row_a, row_b in zip(decode, recompute, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    if not pairs:
        return {"tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "equal_share": 1.0}
    diffs = [abs(a - b) for a, b in pairs]
    return {"tokens": len(pairs), "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs),
            "equal_share": sum(a == b for a, b in pairs) / len(pairs)}

