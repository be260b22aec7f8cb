"""Learner-vs-sampler diagnostics: where a mismatch comes from and how to weight it away.

Three layers, each usable alone (docs/NUMERICS.md):
  `diagnostics.operators`  operator layer: activation / weight codes and scales, expert outputs and
                           routing of a learner-side forward vs the sampler's, aligned by
                           (sequence, position) and (token, expert id)
  `diagnostics.gaps`       log-prob layer: per-token gap, RL mismatch metrics, per-segment tails
  `diagnostics.weights`    TIS, IcePop, OPSM and TRIAGE-style weights for the learner's loss
`diagnostics.report` combines the last two into one JSON-able report (the sidecar route and the CLI).

Imports `kernels` and `sampler_plugin`, never an engine or `server`.
"""
from .gaps import direction_shares, gap, gap_metrics, tail_metrics
from .weights import icepop, opsm, tis, triage

__all__ = ["direction_shares", "gap", "gap_metrics", "tail_metrics", "icepop", "opsm", "tis", "triage"]
