"""Strict (batch-invariant) W4A4 paths of the GPU backends: each output element is summed in an order
fixed by the weight shape and the launch constants, never by the token count M, the other tokens of
the batch, or prefill vs decode; so a token's outputs are the same bits alone, in any batch, in a
decode step and in a whole-sequence recomputation (`SamplerConfig.strict`, docs/NUMERICS.md).

    linear(x [..., K], w [N, K] NVFP4) -> [..., N]      every M on `cuda_mma` (`triton_gemm` path "mma")
    moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], ...) -> [T, H]    `cuda_mma` over expert tiles (`triton_moe._moe_tiled`)
                                                                    where it fits, else per-pair GEMVs

Activation quantization is per token (row-invariant: a row's amax is a max, exact in any order).
linear: `cuda_mma`'s summation order depends on (N, K) only (k16 steps in order, split-K planes added
in plane order); M only sets how many token tiles run, so every M takes it (M = 1 included, where the
default path takes the Triton GEMV), in launches of at most CHUNK_TOKENS tokens because its fp32
split-K planes grow with M x N. moe: every T on `triton_moe._moe_tiled` (bf16/fp16 x, ModelOpt experts of
`cuda_mma`'s shape contract): the same kernel, whose rows keep their order whichever rows share a tile,
row-wise quantizers, and the k expert outputs of a token added in its router's slot order (`combine`);
otherwise one GEMV per (token, expert) pair with the launch configuration of one token's pairs at every
T, the k outputs added one at a time in slot order (the default path sizes split-K by T and switches
paths by size). Both in launches of at most CHUNK_PAIRS pairs (split-K workspace). Cost: docs/NUMERICS.md.
"""
from __future__ import annotations

import torch

from . import triton_gemm, triton_moe
from .format import NVFP4Tensor

CHUNK_TOKENS = 256        # tokens per cuda_mma launch: fp32 split-K planes of S x 256 x N (~100 MiB at N = 24576)
CHUNK_PAIRS = 4096        # (token, expert) pairs per MoE launch: split-K workspace ~100 MiB at I = 768


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None, amax: torch.Tensor | None = None,
           op_order: str = "vllm") -> torch.Tensor:
    """Per-token W4A4 linear, batch-invariant: x [..., K] bf16/fp16, w [N, K] NVFP4 (either layout of
    `triton_gemm.linear`'s mma path) -> [..., N] in x.dtype. amax: per-token override fp32 [...]."""
    x2 = x.reshape(-1, x.shape[-1])
    a2 = None if amax is None else amax.reshape(-1)
    parts = [triton_gemm.linear(x2[i:i + CHUNK_TOKENS], w, bias=bias, op_order=op_order, path="mma",
                                amax=None if a2 is None else a2[i:i + CHUNK_TOKENS], batch_invariant=True)
             for i in range(0, max(x2.shape[0], 1), CHUNK_TOKENS)]
    return _cat(parts).reshape(*x.shape[:-1], w.shape[0])


def moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
        op_order: str = "vllm") -> torch.Tensor:
    """W4A4 SwiGLU MoE, batch-invariant; shapes and result as `triton_moe.moe`."""
    if w13.codes.dim() != 3 or w2.codes.dim() != 3:
        raise ValueError(f"w13 and w2 must be stacked experts [E, N, K], got {tuple(w13.shape)}, {tuple(w2.shape)}")
    tokens = max(1, CHUNK_PAIRS // topk_ids.shape[1])
    mma = triton_moe.mma_fits(x, w13, w2)

    def part(i: int) -> torch.Tensor:
        args = x[i:i + tokens], w13, w2, topk_weights[i:i + tokens], topk_ids[i:i + tokens], op_order
        return triton_moe._moe_tiled(*args) if mma else triton_moe._moe_pairs(*args, strict=True)

    return _cat([part(i) for i in range(0, max(x.shape[0], 1), tokens)])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The launches' outputs in token order (no copy for one launch)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
