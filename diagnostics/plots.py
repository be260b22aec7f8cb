"""PNG plots of a mismatch report (matplotlib, Agg backend): gap histogram, per-segment negative-tail
depth, update-direction shares."""
from __future__ import annotations

from pathlib import Path

import torch

from . import gaps


def write_plots(logp_sampler: torch.Tensor, logp_learner: torch.Tensor, mask: torch.Tensor, out_dir: str | Path, *,
                advantages: torch.Tensor | None = None, segment: int = 64, depth_threshold: float = 1.0,
                flip_margin: float = 0.1, label: str = "") -> list[Path]:
    """[B, T] float log-probs and bool mask (advantages [B] or [B, T]) -> the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mu, pi, m = gaps.as_batch(logp_sampler, logp_learner, mask)
    g = pi - mu
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(g[m].numpy(), bins=80, color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel("gap  log p_learner - log p_sampler  (nats)")
    ax.set_ylabel("tokens")
    ax.set_title(f"per-token gap {label}".strip())
    paths.append(_save(fig, out_dir / "gap_hist.png"))

    seg = gaps.segments(g, m, segment)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(range(seg.tail_depth.numel()), seg.tail_depth.numpy(), color="tab:red")
    ax.axhline(depth_threshold, color="k", ls="--", lw=1, label=f"risk threshold {depth_threshold:g}")
    ax.set_xlabel(f"{segment}-token segment (sequences in order)")
    ax.set_ylabel("negative-tail depth (nats)")
    ax.legend()
    ax.set_title(f"negative-tail depth per segment {label}".strip())
    paths.append(_save(fig, out_dir / "tail_depth.png"))

    if advantages is not None:
        d = gaps.direction_shares(mu, pi, advantages, m, flip_margin=flip_margin)
        keys = ["pos_adv_pos_gap", "pos_adv_neg_gap", "neg_adv_pos_gap", "neg_adv_neg_gap", "flip_share"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar(range(len(keys)), [d[k] for k in keys], color=["tab:green", "tab:orange", "tab:purple", "tab:red", "k"])
        ax.set_xticks(range(len(keys)), ["A>0 g>=0", "A>0 g<0", "A<0 g>=0", "A<0 g<0", f"flip (>{flip_margin:g})"])
        ax.set_ylabel("share of tokens")
        ax.set_title(f"update-direction shares {label}".strip())
        paths.append(_save(fig, out_dir / "directions.png"))
    return paths


def _save(fig, path: Path) -> Path:
    """Write `fig` to `path` (PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
