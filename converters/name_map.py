"""Learner tensor names -> sampler checkpoint names: a declarative map plus one explicit split.

Sampler names are the unfused Hugging Face module names (docs/ARCHITECTURE.md), so most names map
to themselves. What changes:
  * wrapper prefixes added by DDP (`module.`) and torch.compile (`_orig_mod.`) are stripped;
  * buffers that are not weights are dropped (`None` in NAME_MAP), and so is the output head of a
    model with tied embeddings (`lm_head.weight` is `embed_tokens.weight`; HF does not save it either);
  * transformers 5 keeps MoE experts fused in memory (and in `save_pretrained(save_original_format=False)`):
    `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows, see `Qwen3MoeExperts.forward`)
    and `...mlp.experts.down_proj` [E, H, I]. They are split into the per-expert names vLLM and
    SGLang load: `...mlp.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H],
    `.down_proj.weight` [H, I]. Per-expert source names are already sampler names.
"""
from __future__ import annotations

import dataclasses
import re

# (pattern, replacement); replacement None drops the tensor. Applied in order, each at most once.
NAME_MAP: tuple[tuple[str, str | None], ...] = (
    (r"^(?:module\.|_orig_mod\.)+", ""),              # DDP / torch.compile wrappers
    (r"\.rotary_emb\.inv_freq$", None),               # recomputed by every engine
)

TIED_HEAD = "lm_head.weight"              # dropped when the config has tie_word_embeddings

# Fused expert tensor leaf -> per-expert module leaves, in the row order of dim 1.
FUSED_EXPERTS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_FUSED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<leaf>" + "|".join(FUSED_EXPERTS) + r")$")


@dataclasses.dataclass(frozen=True)
class Mapped:
    """One sampler tensor cut from a source tensor: `value[index]` (index None = the whole tensor)."""

    name: str
    index: tuple[int, slice] | None = None


def rename(name: str, *, tied_embeddings: bool = False) -> str | None:
    """Apply NAME_MAP to a source name; None if the tensor is dropped."""
    for pattern, replacement in NAME_MAP:
        if re.search(pattern, name):
            if replacement is None:
                return None
            name = re.sub(pattern, replacement, name)
    return None if tied_embeddings and name == TIED_HEAD else name


def expand(name: str, shape: tuple[int, ...], *, tied_embeddings: bool = False) -> list[Mapped]:
    """The sampler tensors a source tensor `name` of logical `shape` becomes (empty if dropped).

    Raises ValueError for a fused expert tensor that is not [E, parts * R, C].
    """
    name = rename(name, tied_embeddings=tied_embeddings)
    if name is None:
        return []
    m = _FUSED.match(name)
    if m is None:
        return [Mapped(name)]
    parts = FUSED_EXPERTS[m["leaf"]]
    if len(shape) != 3 or shape[1] % len(parts):
        raise ValueError(f"{name}: fused expert tensor must be [E, {len(parts)} * rows, cols], got shape {tuple(shape)}")
    rows = shape[1] // len(parts)
    return [Mapped(f"{m['experts']}.{e}.{part}.weight", (e, slice(i * rows, (i + 1) * rows)))
            for e in range(shape[0]) for i, part in enumerate(parts)]
