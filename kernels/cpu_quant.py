"""NVFP4 weight quantization on the CPU, bit-identical to `reference.quantize_weight`, ~20x faster.

The reference spells the spec out on fp32 temporaries of the whole tensor. This module computes the
same numbers in chunks of rows that stay in cache, with preallocated buffers and in-place ops:

  block amax   |x| as integer bits (monotone in |x| for IEEE floats), each chunk transposed to
               [rows, 16, K/16] so the max over a block's 16 elements is a vectorised vertical max;
               NaN/Inf show up as an all-ones exponent in the block amax bits (one check, no pass)
  scales       `reference.block_scales` on the [..., K/16] block amax (the spec's own formulas)
  codes        a = |x * inv| clamped to 6 and rounded to E2M1 by ONE fp32 addition a + M, where
               M = 2^(22 + e), e = 0, 1, 2 for a in [0, 2), [2, 4), [4, 6]: the ulp of M is the
               E2M1 step (0.5, 1, 2) of that range, so fp32 round-to-nearest-even of the sum is
               E2M1's round-to-nearest-even; code = (bits(a + M) - bits(M)) + 2 e; sign bit 3
  packing      two int32 codes read as one int64 v: byte = (v | v >> 28) & 0xFF (low nibble even)
  error        optionally (`quantize_weight_with_error`) the quantization error in the same pass:
               |deq| = ((a + M) - M) * s * S_dec as `reference.dequantize` computes it, and
               |deq - x| = ||deq| - |x|| (deq has x's sign), summed per row while the chunk is in cache

Weights only (the converter's and the engines' load-time work); `kernels.dispatch` routes CPU
weights here. Uses torch's intra-op threads (`torch.set_num_threads`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import reference
from .format import BLOCK, E2M1_MAX, NVFP4Tensor

CHUNK_ELEMENTS = 1 << 17        # elements per chunk: ~20 int32/fp32 passes over 512 KiB stay in L2
# integer view and exponent mask (|x| bits >= mask <=> NaN or Inf) per input dtype
_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
         torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}
_EXP_ONE = 127                  # fp32 biased exponent of 1.0
_MAGIC_EXP = 22                 # M = 2^(22 + e): ulp 0.5 for e = 0


class QuantizationError(NamedTuple):
    """Error of a quantized weight against its source, per matrix (shape [] for [N, K], [E] for
    experts), float64: sum of (deq - w)^2, sum of w^2, max |deq - w| (deq = `reference.dequantize`)."""

    err_sq: torch.Tensor
    ref_sq: torch.Tensor
    max_abs: torch.Tensor


def quantize_weight(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                    op_order: str = "vllm") -> NVFP4Tensor:
    """`reference.quantize_weight` on a CPU tensor: w [N, K] or [E, N, K] bf16/fp16/fp32 ->
    NVFP4Tensor (codes uint8 [..., K/2], block_scales e4m3 [..., K/16], global_scale fp32 [] or [E]).
    Same arguments, results (bit for bit) and errors as the reference; a given amax must be finite."""
    return _quantize(w, recipe=recipe, amax=amax, op_order=op_order, error=False)[0]


def quantize_weight_with_error(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                               op_order: str = "vllm") -> tuple[NVFP4Tensor, QuantizationError]:
    """`quantize_weight` and its error against w (`QuantizationError`), computed in the same pass
    (the converter's report without a dequantization pass)."""
    return _quantize(w, recipe=recipe, amax=amax, op_order=op_order, error=True)


def _quantize(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None, op_order: str,
              error: bool) -> tuple[NVFP4Tensor, QuantizationError | None]:
    reference._check_input(w, "weight", finite=False)
    reference._check_op_order(op_order)
    if w.device.type != "cpu":
        raise ValueError(f"weight: kernels.cpu_quant runs on CPU tensors, got device {w.device}")
    if w.dim() not in (2, 3):
        raise ValueError(f"weight must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    reference._check_recipe(recipe)
    if amax is not None and not bool(torch.isfinite(amax).all()):
        raise ValueError(f"amax: must be finite, got {amax.tolist()} (an infinite amax makes the reference's "
                         f"block scales 0 * inf = NaN)")
    rows = w.contiguous().reshape(-1, w.shape[-1])                           # [R, K]
    block_amax = _block_amax(rows).reshape(*w.shape[:-1], -1)                # fp32 [..., N, K/16]
    if amax is None:
        amax = block_amax.amax(dim=(-2, -1))                                 # max|w|, [] or [E]
    row_amax = block_amax.reshape(rows.shape[0], -1).amax(-1) if error else None   # [R], before 2d tiling
    if recipe == "2d":
        block_amax = reference.tile_amax_2d(block_amax)
    s_enc = reference.encode_scale_from_amax(amax, op_order=op_order)
    scales, inv = reference.block_scales(block_amax, s_enc, op_order=op_order)
    gs = (1.0 / s_enc.float()).contiguous()
    stats = None
    if error:            # dequantization factors and 2^-exponent(max|row|) of each row
        rows_gs = gs.reshape(-1, 1).expand(-1, w.shape[-2]).reshape(-1)
        unit = torch.ldexp(torch.ones_like(row_amax), -torch.frexp(row_amax).exponent)
        stats = (scales.float().reshape(rows.shape[0], -1), rows_gs, unit)
    codes, per_row = _encode(rows, inv.reshape(rows.shape[0], -1), stats)
    q = NVFP4Tensor(codes.reshape(*w.shape[:-1], -1), scales, gs)
    if not error:
        return q, None
    lead = w.shape[:-2]
    err, ref, max_abs = (t.double().reshape(*lead, -1) for t in per_row)
    unit = stats[2].double().reshape(*lead, -1)
    return q, QuantizationError((err / unit).square().sum(-1), (ref / unit).square().sum(-1), max_abs.amax(-1))


def _chunk_rows(k: int) -> int:
    return max(1, CHUNK_ELEMENTS // k)


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] contiguous float -> fp32 [R, K/16], max|x| per 1x16 block; ValueError on NaN/Inf."""
    r_total, k = x.shape
    int_type, abs_mask, nonfinite = _BITS[x.dtype]
    bits = x.view(int_type)
    out = torch.empty(r_total, k // BLOCK, dtype=int_type)
    step = _chunk_rows(k)
    mag = torch.empty(step, k, dtype=int_type)
    transposed = torch.empty(step, BLOCK, k // BLOCK, dtype=int_type)
    for r0 in range(0, r_total, step):
        r = min(step, r_total - r0)
        torch.bitwise_and(bits[r0:r0 + r], abs_mask, out=mag[:r])
        transposed[:r].copy_(mag[:r].view(r, k // BLOCK, BLOCK).transpose(1, 2))
        torch.amax(transposed[:r], dim=1, out=out[r0:r0 + r])
    if out.numel() and int(out.max()) >= nonfinite:
        raise ValueError(reference.NONFINITE_MESSAGE.format(name="weight"))
    return out.view(x.dtype).float()


def _encode(x: torch.Tensor, inv: torch.Tensor,
            stats: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, tuple | None]:
    """x [R, K] contiguous float, inv fp32 [R, K/16] -> (packed E2M1 codes uint8 [R, K/2] of
    clamp(x * inv, -6, 6), rounded to nearest even (module docstring), per-row error sums).

    stats: (block scales as fp32 [R, K/16], S_dec per row fp32 [R], a power of two per row fp32 [R]
    that brings the row's max to [0.5, 1)) to also return, per row (fp32 [R] each): ||deq - x|| and
    ||x|| in units of that power of two (the fp32 squares neither overflow nor underflow), and
    max |deq - x|; None: no error (second item None)."""
    r_total, k = x.shape
    step = _chunk_rows(k)
    codes = torch.empty(r_total, k // 2, dtype=torch.uint8)
    if stats is not None:
        dq = torch.empty(step, k, dtype=torch.float32)         # |x| in row units, then |deq|, then |deq - x|
        xa = torch.empty(step, k, dtype=x.dtype)               # |x|
        per_row = tuple(torch.empty(r_total, dtype=torch.float32) for _ in range(3))
    f = torch.empty(step, k, dtype=torch.float32)              # x * inv, then |x * inv|
    sign = torch.empty(step, k, dtype=torch.int32)             # bit 3 = sign
    magic = torch.empty(step, k, dtype=torch.int32)            # bits of M = 2^(22 + e)
    total = torch.empty(step, k, dtype=torch.float32)          # a + M, then the code
    packed = torch.empty(step, k // 2, dtype=torch.int64)
    for r0 in range(0, r_total, step):
        r = min(step, r_total - r0)
        fr, sg, m, t, p = f[:r], sign[:r], magic[:r], total[:r], packed[:r]
        fb, tb = fr.view(torch.int32), t.view(torch.int32)
        fr.copy_(x[r0:r0 + r])
        fr.view(r, -1, BLOCK).mul_(inv[r0:r0 + r, :, None])
        fr.clamp_(-E2M1_MAX, E2M1_MAX)
        torch.bitwise_right_shift(fb, 28, out=sg).bitwise_and_(8)
        fr.abs_()
        torch.bitwise_right_shift(fb, 23, out=m)                # biased exponent of a
        m.clamp_(min=_EXP_ONE).add_(_MAGIC_EXP).bitwise_left_shift_(23)
        torch.add(fr, m.view(torch.float32), out=t)              # the one rounding
        if stats is not None:
            _row_errors(x[r0:r0 + r], t, m, *(st[r0:r0 + r] for st in stats), dq[:r], xa[:r],
                        [p_[r0:r0 + r] for p_ in per_row])
        tb.sub_(m)                                               # k = round(a / ulp(M))
        m.bitwise_right_shift_(22).sub_(2 * (_EXP_ONE + _MAGIC_EXP))   # 2 e
        tb.add_(m).bitwise_or_(sg)
        pairs = tb.view(torch.int64)                             # [r, K/2]: even code low, odd high
        torch.bitwise_right_shift(pairs, 28, out=p).bitwise_or_(pairs).bitwise_and_(0xFF)
        codes[r0:r0 + r].copy_(p)
    return codes, (per_row if stats is not None else None)


def _row_errors(x: torch.Tensor, t: torch.Tensor, m: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor,
                unit: torch.Tensor, dq: torch.Tensor, xa: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Per-row error of one chunk (see `_encode`): t = a + M and m = bits(M) as `_encode` holds them."""
    r = x.shape[0]
    torch.abs(x, out=xa)
    torch.mul(xa, unit[:, None], out=dq)                         # exact: a power of two
    torch.linalg.vector_norm(dq, 2, dim=1, out=out[1])
    torch.sub(t, m.view(torch.float32), out=dq)                  # the E2M1 magnitude, exact
    dq.view(r, -1, BLOCK).mul_(scales[:, :, None])               # e2m1 * s, exact
    dq.mul_(gs[:, None])                                         # * S_dec: the reference's one rounding
    dq.sub_(xa).abs_()
    torch.amax(dq, dim=1, out=out[2])
    torch.linalg.vector_norm(dq.mul_(unit[:, None]), 2, dim=1, out=out[0])
