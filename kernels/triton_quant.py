"""Fused NVFP4 quantization kernels (Triton; CUDA, written for Hopper sm_90), bit-identical to
`kernels.reference`.

Import this module only where triton is installed (dispatch imports it lazily). One tile helper
(`_quantize_tile`) holds the float operations of the spec, in the spec's order; the kernels around
it differ only in where amax and S_enc come from and where codes and scales go:

  per-token activations  one pass: each program holds whole rows in registers, computes the row
                         amax, S_enc = 2688 / amax, the 1x16 block scales, the codes, and writes
                         packed codes, E4M3 scales (linear or 128x4 swizzled) and S_dec per row
  per-tensor activations the same kernel with S_enc given (from max|x| over the tensor)
  weights                S_enc per tensor or per expert, given or from max|w| (a reduction first, or in
                         the same launch: amax work items ahead of quantize items that re-read their
                         group from L2), 1x16 or 16x16 block amax, tiles of 16 rows x BLOCK_K

Divisions use `tl.div_rn` (IEEE round-to-nearest, as torch); the E4M3 and E2M1 roundings are
computed on the bits (`_e4m3_rne`, `_e2m1_rne`, checked on every fp32 of their ranges under the
interpreter), so no compiler's conversion path enters the results; a multiply-add may be fused only
where its product is exact (the roundings' a * 2^j + 1.5 * 2^23), so fusion never changes a bit.
`op_order="te"` (every quantizer; constexpr `TE` in the kernels) follows TransformerEngine's
formulas instead, as `reference` does with the same keyword (its module docstring lists both).
GPU quantization does not check for NaN/Inf in activations (that would need a host sync per call);
weights are checked (one host sync per tensor, one reduction more where amax is given) unless
`check_finite=False`.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import reference
from .format import BLOCK, SWIZZLE_COLS, SWIZZLE_ROWS, NVFP4Tensor
from .reference import weight_amax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"     # Triton's CPU interpreter (tests): CPU tensors
# programmatic dependent launch: the activation quantizer lets the next kernel (cuda_mma) start and
# prefetch its weights while it runs (a no-op for any other follower)
PDL = not INTERPRET and hasattr(tl.extra.cuda, "gdc_launch_dependents")


class SwizzledNVFP4(NamedTuple):
    """NVFP4 rows with block scales in the 128x4 swizzled layout (`reference.swizzle_scales_128x4`).

    codes         uint8 [..., M, K/2]
    block_scales  float8_e4m3fn [..., roundup(M, 128), roundup(K/16, 4)], zero padded
    global_scale  float32, decode direction, as in NVFP4Tensor
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor


class ExactRows(NamedTuple):
    """Per-token quantized rows in dense form: `values` = e2m1(q) * float(s) (exact in BF16 and
    FP16, [M, K]) and `global_scale` = S_dec per row (float32 [M]); dequantized x' = values * S_dec."""

    values: torch.Tensor
    global_scale: torch.Tensor


@triton.jit
def _e4m3_rne(x):
    """fp32 in [0, 448] -> float8e4nv, round to nearest even, computed on the bits (so it does not
    depend on the compiler's conversion path): normals keep 3 mantissa bits, values under 2^-6
    round to multiples of 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    sub = (x * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000     # rint(x * 2^9)
    return tl.where(x < 0.015625, sub, normal).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_TE_ROW_AMAX_FLOOR = tl.constexpr(1e-12)    # TE's per-token quantizer divides by max(amax_row, 1e-12)


@triton.jit
def _s_enc_from_amax(amax, TE: tl.constexpr = False):
    """S_enc = 2688 / amax clamped to the fp32 max; amax == 0 -> 1. Default: as the spec computes it
    in torch (scalar / tensor is reciprocal(amax) * 2688: two roundings); TE: one division."""
    if TE:
        s_enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), _FLT_MAX)
    else:
        s_enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * 2688.0, _FLT_MAX)
    return tl.where(amax == 0.0, 1.0, s_enc)


@triton.jit
def _row_amax_floor(amax, TE: tl.constexpr):
    """A per-token amax as the op order uses it: TE floors it at 1e-12, the spec does not."""
    if TE:
        amax = tl.maximum(amax, _TE_ROW_AMAX_FLOOR)
    return amax


@triton.jit
def _e2m1_rne(v):
    """fp32 v (any shape) -> (code int32: the E2M1 code of v, round to nearest even, saturated at 6,
    sign in bit 3; q fp32: its value e2m1(code), signed), as `reference.e2m1_encode` / `e2m1_decode`.

    Without comparisons or a float-to-int conversion: with a = min(|v|, 6), the grid's step is
    2^(e - 1) on [2^e, 2^(e + 1)), e = max(floor(log2 a), 0), so with m = 2^(1 - e) (built from a's
    exponent bits) rint(a * m) comes from adding 1.5 * 2^23 (exact: m is a power of two); the code is
    rint(a * m) + 2e, the value rint(a * m) / m. Checked on every fp32 from 2^-12 to 6 and samples
    below and above (tests/test_triton_interpret.py `check_roundings`).
    """
    bits = v.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(v), 6.0)
    # m's bits: the complement of the exponent field of max(a, 1) (biased 127 + e -> 128 - e)
    m = ~tl.maximum(a.to(tl.int32, bitcast=True), 0x3F800000) & 0x7F800000
    f = a * m.to(tl.float32, bitcast=True) + 12582912.0                  # 1.5 * 2^23 + rint(a * m)
    # m >> 22 = 2 (128 - e); 1 / m has 254 - (128 - e) in its exponent field
    code = (f.to(tl.int32, bitcast=True) - (m >> 22) + (256 - 0x4B400000)) | ((bits >> 28) & 8)
    q = (f - 12582912.0) * (0x7F000000 - m).to(tl.float32, bitcast=True)
    return code, (q.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _block_scales(bamax, s_enc, TE: tl.constexpr = False, PER_ROW: tl.constexpr = False):
    """The spec's block scales of a tile: bamax fp32 [R, NB] (block amax, 1x16 or 16x16), s_enc fp32 [R] (S_enc
    of each row) -> (scales float8e4nv [R, NB], their fp32 values, the element multipliers `inv` fp32 [R, NB]).
    TE: TransformerEngine's block-scale and element-scale formulas, PER_ROW selecting its row-scaled (per-token)
    element scale (`reference.block_scales`)."""
    if TE:
        scale = _e4m3_rne(tl.minimum(bamax * (s_enc[:, None] * 0.1666666716337204), 448.0))
    else:
        scale = _e4m3_rne(tl.minimum(s_enc[:, None] * (bamax * 0.1666666716337204), 448.0))
    s = scale.to(tl.float32)
    if TE and PER_ROW:                                               # S_enc / s, 0 for s == 0
        inv = tl.where(s == 0.0, 0.0, tl.minimum(tl.div_rn(tl.broadcast_to(s_enc[:, None], s.shape), s), _FLT_MAX))
    else:
        dec = s * tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)[:, None]
        inv = tl.minimum(tl.div_rn(tl.full(dec.shape, 1.0, tl.float32), dec), _FLT_MAX)
        if not TE:                                                   # 1/0 := 0 (TE: FLT_MAX)
            inv = tl.where(dec == 0.0, 0.0, inv)
    return scale, s, inv


@triton.jit
def _pack_codes(code):
    """E2M1 codes int32 [R, NB, W] (W even) -> uint8 [R, NB, W / 2]: consecutive pairs, the even element low."""
    R: tl.constexpr = code.shape[0]
    NB: tl.constexpr = code.shape[1]
    W: tl.constexpr = code.shape[2]
    lo, hi = tl.split(tl.reshape(code, (R, NB, W // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _quantize_tile(x, bamax, s_enc, TE: tl.constexpr = False, PER_ROW: tl.constexpr = False):
    """The spec's block quantizer on one tile.

    x fp32 [R, NB, 16]; bamax fp32 [R, NB] (block amax, 1x16 or 16x16); s_enc fp32 [R] (S_enc of
    each row). Returns (packed codes uint8 [R, NB*8], scales float8e4nv [R, NB], values fp32
    [R, NB, 16] = e2m1(q) * float(s), signed and exact: the block dequantized without S_dec). TE,
    PER_ROW: as `_block_scales`.
    """
    scale, s, inv = _block_scales(bamax, s_enc, TE, PER_ROW)
    code, q = _e2m1_rne(x * inv[:, :, None])
    R: tl.constexpr = x.shape[0]
    NB: tl.constexpr = x.shape[1]
    return tl.reshape(_pack_codes(code), (R, NB * 8)), scale, q * s[:, :, None]


@triton.jit
def _scale_offsets(rows, blocks, n_blocks, SWIZZLE: tl.constexpr):
    """Offsets of block scales (rows [R, 1], blocks [1, NB]) in the linear or 128x4 swizzled layout."""
    if SWIZZLE:
        kp = (n_blocks + 3) // 4 * 4
        return ((rows // 128) * (kp * 128) + (blocks // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + blocks % 4)
    else:
        return rows * n_blocks + blocks


@triton.jit
def swiglu(gate, up):
    """silu(gate) * up in fp32, the MoE intermediate (`reference.moe`) of every Triton MoE path."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _act_tile(tile, x_ptr, stride_xm, index_ptr, amax_ptr, codes_ptr, scales_ptr, gs_ptr, deq_ptr, M, K,
              ROWS: tl.constexpr, NB_PAD: tl.constexpr, AMAX_MODE: tl.constexpr, SWIZZLE: tl.constexpr,
              WRITE_CODES: tl.constexpr, WRITE_DEQ: tl.constexpr, TE: tl.constexpr,
              GATHER: tl.constexpr, SWIGLU: tl.constexpr, ACT_BF16: tl.constexpr):
    """Quantize rows [tile*ROWS, tile*ROWS + ROWS) (whole rows in registers). GATHER: output row r
    reads input row index[r]. SWIGLU: an input row is [gate (K) | up (K)] and the row quantized is
    silu(gate) * up in fp32, rounded to bf16 (ACT_BF16) or fp16, as `reference.moe` computes it."""
    rows = tile * ROWS + tl.arange(0, ROWS)                                  # [R]
    blocks = tl.arange(0, NB_PAD)                                            # [NB]
    cols = blocks[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]      # [1, NB, 16]
    rmask = rows < M
    mask = rmask[:, None, None] & (cols < K)
    rows64 = rows.to(tl.int64)
    src = tl.load(index_ptr + rows, mask=rmask, other=0).to(tl.int64) if GATHER else rows64
    ptrs = x_ptr + src[:, None, None] * stride_xm + cols
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = swiglu(x, up).to(tl.bfloat16 if ACT_BF16 else tl.float16, fp_downcast_rounding="rtne")
        x = x.to(tl.float32)
    bamax = tl.max(tl.abs(x), axis=2)                                        # [R, NB]
    if AMAX_MODE == 1:                                                       # one amax for the tensor: a scalar
        s_enc = tl.broadcast_to(_s_enc_from_amax(tl.load(amax_ptr), TE), [ROWS])
        gs_mask = rows == 0
        gs_off = rows * 0
    else:
        if AMAX_MODE == 2:                                                   # given amax per row
            row_amax = tl.load(amax_ptr + src, mask=rmask, other=0.0)
        else:                                                                # max|x| of the row
            row_amax = tl.max(bamax, axis=1)
        s_enc = _s_enc_from_amax(_row_amax_floor(row_amax, TE), TE)          # [R]
        gs_mask = rmask
        gs_off = rows
    tl.store(gs_ptr + gs_off, tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc), mask=gs_mask)
    packed, scale, value = _quantize_tile(x, bamax, s_enc, TE, AMAX_MODE != 1)
    n_blocks = K // 16
    if WRITE_CODES:
        bytes_ = tl.arange(0, NB_PAD * 8)
        tl.store(codes_ptr + rows64[:, None] * (K // 2) + bytes_[None, :], packed,
                 mask=rmask[:, None] & (bytes_[None, :] < K // 2))
        sc_off = _scale_offsets(rows64[:, None], blocks[None, :], n_blocks, SWIZZLE)
        tl.store(scales_ptr + sc_off, scale, mask=rmask[:, None] & (blocks[None, :] < n_blocks))
    if WRITE_DEQ:
        tl.store(deq_ptr + rows64[:, None, None] * K + cols, value.to(deq_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=['M', 'n_tiles'])   # counts of tokens: one compilation for all
def _act_quant_kernel(
    x_ptr, stride_xm,                      # input [M, K] float, row stride ([*, 2K] for SWIGLU)
    index_ptr,                             # int [M]: input row of each output row (GATHER)
    amax_ptr,                              # fp32 amax: [1] of the tensor (AMAX_MODE 1), [M] per row (2)
    codes_ptr, scales_ptr, gs_ptr,         # outputs: uint8 [M, K/2], e4m3 scales, fp32 S_dec [M] (or [1])
    deq_ptr,                               # output bf16 / fp16 [M, K] exact e2m1*s (WRITE_DEQ)
    M, K, n_tiles,
    ROWS: tl.constexpr, NB_PAD: tl.constexpr,
    AMAX_MODE: tl.constexpr,               # 0: max|x| per row, 1: given per tensor, 2: given per row
    SWIZZLE: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_DEQ: tl.constexpr,
    PERSIST_STAGES: tl.constexpr,          # 0: one tile per program; else a persistent, pipelined loop
    TE: tl.constexpr,                      # TransformerEngine's op order (module docstring)
    PDL: tl.constexpr,                     # let a dependent launch (cuda_mma) start now: it waits for our results
    GATHER: tl.constexpr, SWIGLU: tl.constexpr, ACT_BF16: tl.constexpr,    # `_act_tile`
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PERSIST_STAGES == 0:
        _act_tile(tl.program_id(0), x_ptr, stride_xm, index_ptr, amax_ptr, codes_ptr, scales_ptr, gs_ptr, deq_ptr,
                  M, K, ROWS, NB_PAD, AMAX_MODE, SWIZZLE, WRITE_CODES, WRITE_DEQ, TE, GATHER, SWIGLU, ACT_BF16)
    else:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=PERSIST_STAGES):
            _act_tile(tile, x_ptr, stride_xm, index_ptr, amax_ptr, codes_ptr, scales_ptr, gs_ptr, deq_ptr, M, K,
                      ROWS, NB_PAD, AMAX_MODE, SWIZZLE, WRITE_CODES, WRITE_DEQ, TE, GATHER, SWIGLU, ACT_BF16)


@triton.jit
def _weight_tile_load(tile, w_ptr, N, K, n_row_tiles, n_k_tiles, BLOCK_KB: tl.constexpr):
    """Tile `tile` = (e * n_row_tiles + row tile) * n_k_tiles + k tile of w [E, N, K]: (the first and second
    halves of its 16 rows x BLOCK_KB blocks as fp32 [16, BLOCK_KB, 8] each, zero past the edges; e; row tile;
    k tile). Two loads of one layout, so each thread holds whole blocks: their amax and scales without a
    shuffle or a second thread repeating them (tests/test_triton_sm90.py counts the instructions)."""
    kt = tile % n_k_tiles
    rt = (tile // n_k_tiles) % n_row_tiles
    e = tile // (n_k_tiles * n_row_tiles)
    rows = rt * 16 + tl.arange(0, 16)                                         # [16] rows of this expert
    cols = (kt * BLOCK_KB + tl.arange(0, BLOCK_KB))[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    mask = (rows < N)[:, None, None] & (cols < K)
    ptrs = w_ptr + (e.to(tl.int64) * N + rows)[:, None, None] * K + cols
    lo = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(ptrs + 8, mask=mask, other=0.0).to(tl.float32)
    return lo, hi, e, rt, kt


@triton.jit
def _weight_tile_store(lo, hi, s_enc, e, rt, kt, codes_ptr, scales_ptr, gs_ptr, gs_index, N, K,
                       BLOCK_KB: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr, TE: tl.constexpr):
    """Quantize a loaded tile (`_weight_tile_load`) with its expert's S_enc (a scalar: loaded and inverted
    once, not per row a thread holds); codes and block scales stored, S_dec at gs_ptr[gs_index] by the
    expert's first tile."""
    rows = rt * 16 + tl.arange(0, 16)
    blocks = kt * BLOCK_KB + tl.arange(0, BLOCK_KB)                           # [NB]
    n_blocks = K // 16
    rmask = rows < N
    grow = e.to(tl.int64) * N + rows                                          # global row
    bamax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))    # [16, NB]
    if TWO_D:
        bamax = tl.broadcast_to(tl.max(bamax, axis=0)[None, :], (16, BLOCK_KB))
    tl.store(gs_ptr + gs_index, tl.div_rn(1.0, s_enc), mask=(rt + kt) == 0)
    scale, _, inv = _block_scales(bamax, tl.broadcast_to(s_enc, [16]), TE, False)
    code_lo, _ = _e2m1_rne(lo * inv[:, :, None])
    code_hi, _ = _e2m1_rne(hi * inv[:, :, None])
    ptrs = codes_ptr + grow[:, None, None] * (K // 2) + blocks[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    bmask = rmask[:, None, None] & (blocks < n_blocks)[None, :, None]
    tl.store(ptrs, _pack_codes(code_lo), mask=bmask)                        # a block's first 4 bytes, then its last
    tl.store(ptrs + 4, _pack_codes(code_hi), mask=bmask)
    if SWIZZLE:
        n_pad = (N + 127) // 128 * 128
        k_pad = (n_blocks + 3) // 4 * 4
        base = e.to(tl.int64) * n_pad * k_pad
        sc_off = base + _scale_offsets(rows[:, None].to(tl.int64), blocks[None, :], n_blocks, True)
    else:
        sc_off = grow[:, None] * n_blocks + blocks[None, :]
    tl.store(scales_ptr + sc_off, scale, mask=rmask[:, None] & (blocks < n_blocks)[None, :])


@triton.jit
def _weight_tile(tile, w_ptr, amax_ptr, stride_amax, codes_ptr, scales_ptr, gs_ptr, N, K, n_row_tiles, n_k_tiles,
                 BLOCK_KB: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr, TE: tl.constexpr):
    """Quantize 16 rows x BLOCK_KB blocks of one expert with its given amax."""
    lo, hi, e, rt, kt = _weight_tile_load(tile, w_ptr, N, K, n_row_tiles, n_k_tiles, BLOCK_KB)
    s_enc = _s_enc_from_amax(tl.load(amax_ptr + e * stride_amax), TE)
    _weight_tile_store(lo, hi, s_enc, e, rt, kt, codes_ptr, scales_ptr, gs_ptr, e * stride_amax, N, K,
                       BLOCK_KB, TWO_D, SWIZZLE, TE)


@triton.jit
def _weight_quant_kernel(
    w_ptr,                                  # input [E, N, K] float, contiguous
    amax_ptr, stride_amax,                  # fp32 amax per expert (stride 0: one per tensor)
    codes_ptr, scales_ptr, gs_ptr,          # uint8 [E, N, K/2]; e4m3 [E, N, K/16] or swizzled [E, Np, Kp]; S_dec like amax
    N, K, n_row_tiles, n_k_tiles, n_tiles,
    BLOCK_KB: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr, PERSIST_STAGES: tl.constexpr,
    TE: tl.constexpr,
):
    if PERSIST_STAGES == 0:
        _weight_tile(tl.program_id(0), w_ptr, amax_ptr, stride_amax, codes_ptr, scales_ptr, gs_ptr, N, K,
                     n_row_tiles, n_k_tiles, BLOCK_KB, TWO_D, SWIZZLE, TE)
    else:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=PERSIST_STAGES):
            _weight_tile(tile, w_ptr, amax_ptr, stride_amax, codes_ptr, scales_ptr, gs_ptr, N, K,
                         n_row_tiles, n_k_tiles, BLOCK_KB, TWO_D, SWIZZLE, TE)


# Launch configurations, chosen from the sweep in bench/bench_kernels.py (docs/BENCHMARKS.md):
# elements per program, warps, persistent pipelining depth (0 = off).
ACT_CONFIG = dict(elements=4096, num_warps=4, persist_stages=0)
DECODE_M = 64            # up to this many rows a launch is a decode step's (more warps per row)
# Without a given amax, a reduction (`weight_amax`) runs before the quantizer: two reads of w. A one-launch
# form (amax items ahead of quantize items re-reading their group from L2, one atomic queue) read 25-40% of
# copy against the two passes' 45.9% at six schedules (H100, sixteenth and seventeenth sessions): removed.
WEIGHT_CONFIG = dict(block_kb=16, num_warps=4, persist_stages=0)
_PROGRAMS_PER_SM = 4


def _grid(n_tiles: int, persist_stages: int, device: torch.device) -> int:
    if not persist_stages:
        return n_tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, sms * _PROGRAMS_PER_SM))


def _check_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., K] float on CUDA -> a 2D view/copy [M, K] with unit column stride."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected float32/bfloat16/float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}: last dim K={x.shape[-1] if x.dim() else None} must be a multiple of {BLOCK}")
    if not x.is_cuda and not INTERPRET:
        raise ValueError(f"{name}: the Triton kernels need a CUDA tensor, got device {x.device}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_amax(amax: torch.Tensor | None, x: torch.Tensor, name: str = "amax") -> torch.Tensor | None:
    """A per-token amax override fp32 [...] (= x.shape[:-1]) as a contiguous fp32 [M] on x's device."""
    if amax is None:
        return None
    if amax.shape != x.shape[:-1]:
        raise ValueError(f"{name}: per-token amax must have shape {tuple(x.shape[:-1])}, got {tuple(amax.shape)}")
    return amax.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()


def _act_launch(x2: torch.Tensor, *, amax: torch.Tensor | None, swizzle: bool, codes: bool, deq: bool,
                config: dict | None = None, per_row_amax: bool = False, op_order: str = "vllm",
                deq_dtype: torch.dtype = torch.bfloat16, index: torch.Tensor | None = None,
                swiglu: torch.dtype | None = None):
    """amax: None (max|x| per row), fp32 [1] for the tensor, or fp32 [M] per row (per_row_amax).
    index: int [R], quantize rows x2[index] (R rows out); swiglu: x2 rows are [gate | up] and the rows
    quantized are silu(gate) * up rounded to this dtype (`_act_tile`)."""
    reference._check_op_order(op_order)
    cfg = config or ACT_CONFIG
    m = x2.shape[0] if index is None else index.numel()
    k = x2.shape[1] // 2 if swiglu else x2.shape[1]
    nb_pad = triton.next_power_of_2(k // BLOCK)
    rows = max(1, min(64, cfg["elements"] // (nb_pad * BLOCK)))
    dev = x2.device
    out_codes = torch.empty((m, k // 2), dtype=torch.uint8, device=dev) if codes else None
    if swizzle:
        mp, kp = -(-m // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-(k // BLOCK) // SWIZZLE_COLS) * SWIZZLE_COLS
        scales = torch.zeros((mp, kp), dtype=torch.float8_e4m3fn, device=dev)
    else:
        scales = torch.empty((m, k // BLOCK), dtype=torch.float8_e4m3fn, device=dev) if codes else None
    gs = torch.empty((m if amax is None or per_row_amax else 1,), dtype=torch.float32, device=dev)
    out_deq = torch.empty((m, k), dtype=deq_dtype, device=dev) if deq else None
    n_tiles = triton.cdiv(m, rows)
    warps = max(cfg["num_warps"], nb_pad * BLOCK // 1024)                       # long rows: more warps
    if m <= DECODE_M:           # a few programs, latency-bound: <= 8 elements a thread (H200: K = 2048 3.2 -> 2.6 us)
        warps = max(warps, rows * nb_pad * BLOCK // 256)
    if m:
        _act_quant_kernel[(_grid(n_tiles, cfg["persist_stages"], dev),)](
            x2, x2.stride(0), index, amax, out_codes, scales, gs, out_deq, m, k, n_tiles,
            ROWS=rows, NB_PAD=nb_pad, AMAX_MODE=0 if amax is None else (2 if per_row_amax else 1), SWIZZLE=swizzle,
            WRITE_CODES=codes, WRITE_DEQ=deq, PERSIST_STAGES=cfg["persist_stages"], TE=op_order == "te",
            PDL=PDL, GATHER=index is not None, SWIGLU=swiglu is not None, ACT_BF16=swiglu == torch.bfloat16,
            num_warps=min(16, warps))
    return out_codes, scales, gs, out_deq


def quantize_per_token(x: torch.Tensor, *, amax: torch.Tensor | None = None, op_order: str = "vllm",
                       config: dict | None = None) -> NVFP4Tensor:
    """Per-token NVFP4 of x [..., K] (CUDA, float): codes [..., K/2], scales [..., K/16] (linear),
    global_scale [...] = S_dec per row. Bit-identical to `reference.quantize_per_token`.
    amax: optional fp32 [...] (= x.shape[:-1]) used instead of max|x| per row (the all-reduced
    amax of a tensor-parallel row-parallel layer, `row_amax` in the reference).
    op_order: "vllm" (the spec) or "te" (TransformerEngine's row-scaled quantizer).
    config: launch override (keys of ACT_CONFIG), for tuning."""
    x2 = _check_rows(x, "x")
    codes, scales, gs, _ = _act_launch(x2, amax=_row_amax(amax, x), swizzle=False, codes=True, deq=False,
                                       config=config, per_row_amax=True, op_order=op_order)
    lead = x.shape[:-1]
    return NVFP4Tensor(codes.reshape(*lead, -1), scales.reshape(*lead, -1), gs.reshape(lead))


def quantize_per_token_swizzled(x: torch.Tensor) -> SwizzledNVFP4:
    """Per-token NVFP4 of x [M, K] with 128x4 swizzled block scales (see SwizzledNVFP4)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] for swizzled scales, got shape {tuple(x.shape)}")
    x2 = _check_rows(x, "x")
    codes, scales, gs, _ = _act_launch(x2, amax=None, swizzle=True, codes=True, deq=False)
    return SwizzledNVFP4(codes, scales, gs)


def quantize_per_token_exact(x: torch.Tensor, *, amax: torch.Tensor | None = None, op_order: str = "vllm",
                             dtype: torch.dtype = torch.bfloat16, rows: torch.Tensor | None = None,
                             swiglu: torch.dtype | None = None) -> ExactRows:
    """Per-token quantization of x [M, K] written as exact values e2m1(q)*s in `dtype` (bf16 for the
    large-M cuBLAS path, fp16 for `cuda_mma`) plus S_dec [M]: a tensor-core GEMM over them computes
    the exact block products. amax, op_order: as in `quantize_per_token`.
    rows: int [R] on x's device: quantize x[rows] ([R, K] out) without writing the gathered copy.
    swiglu (bf16/fp16): x is [M, 2K] fp32 (gate | up) and the rows quantized are
    (silu(gate) * up).to(swiglu), the MoE intermediate of `reference.moe` (amax not taken)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if swiglu is not None and (swiglu not in (torch.bfloat16, torch.float16) or x.dtype != torch.float32
                               or x.shape[1] % (2 * BLOCK) or amax is not None):
        raise ValueError(f"swiglu takes fp32 [M, 2K] rows, no amax, and rounds to bf16/fp16; got {x.dtype} "
                         f"{tuple(x.shape)}, swiglu={swiglu}, amax given: {amax is not None}")
    if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device):
        raise ValueError(f"rows must be int32/int64 [R] on {x.device}, got {rows.dtype} {tuple(rows.shape)}")
    x2 = _check_rows(x, "x")
    _, _, gs, deq = _act_launch(x2, amax=_row_amax(amax, x), swizzle=False, codes=False, deq=True,
                                per_row_amax=True, op_order=op_order, deq_dtype=dtype, index=rows, swiglu=swiglu)
    return ExactRows(deq, gs)


def quantize_per_tensor(x: torch.Tensor, *, amax: torch.Tensor | None = None, op_order: str = "vllm") -> NVFP4Tensor:
    """Per-tensor NVFP4 of x [..., K] (one S_dec, shape []); bit-identical to
    `reference.quantize_per_tensor`. amax: optional fp32 scalar instead of max|x|; op_order: "vllm"
    or "te"."""
    x2 = _check_rows(x, "x")
    amax = torch.linalg.vector_norm(x2, ord=float("inf")) if amax is None else amax
    amax = amax.to(device=x2.device, dtype=torch.float32).reshape(1)
    codes, scales, gs, _ = _act_launch(x2, amax=amax, swizzle=False, codes=True, deq=False, op_order=op_order)
    lead = x.shape[:-1]
    return NVFP4Tensor(codes.reshape(*lead, -1), scales.reshape(*lead, -1), gs.reshape(()))


def _weight_launch(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None, check_finite: bool,
                   swizzle: bool, config: dict | None = None, op_order: str = "vllm",
                   out: NVFP4Tensor | None = None, share: int = 1):
    """(codes, scales, S_dec, the amax used) of w [N, K] or [E, N, K]. amax None: one amax per `share`
    consecutive experts (fp32 [E / share], [] for [N, K]), computed by a reduction before the quantizer;
    check_finite: NaN/Inf raise before anything is written."""
    reference._check_op_order(op_order)
    cfg = {**WEIGHT_CONFIG, **(config or {})}
    if w.dim() not in (2, 3):
        raise ValueError(f"weight must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    reference._check_recipe(recipe)
    _check_rows(w, "weight")
    w3 = (w if w.dim() == 3 else w[None]).contiguous()
    e, n, k = w3.shape
    if share < 1 or e % share or (share > 1 and amax is not None):
        raise ValueError(f"share (experts per computed amax) must divide the {e} experts and needs amax=None, got {share}")
    used = None                                                 # an amax computed here, one per `share` experts
    if check_finite or amax is None:
        full = weight_amax(w, share)
        if check_finite and not bool(torch.isfinite(full).all()):
            raise ValueError(reference.NONFINITE_MESSAGE.format(name="weight"))
        if amax is None:
            used, amax = full, full if share == 1 else full.repeat_interleave(share)
    amax = amax.to(device=w.device, dtype=torch.float32)
    if amax.numel() not in (1, e) or amax.dim() > 1:
        raise ValueError(f"amax must have shape [] or [{e}], got {tuple(amax.shape)}")
    n_scales = amax.numel()
    nb = k // BLOCK
    if out is not None:
        codes, scales, gs = _out_views(out, e, n, k, n_scales, w.device)
    else:
        gs = torch.empty(n_scales, dtype=torch.float32, device=w.device)
        codes = torch.empty((e, n, k // 2), dtype=torch.uint8, device=w.device)
        if swizzle:
            npad, kpad = -(-n // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-nb // SWIZZLE_COLS) * SWIZZLE_COLS
            scales = torch.zeros((e, npad, kpad), dtype=torch.float8_e4m3fn, device=w.device)
        else:
            scales = torch.empty((e, n, nb), dtype=torch.float8_e4m3fn, device=w.device)
    block_kb = min(cfg["block_kb"], triton.next_power_of_2(nb))
    n_row_tiles, n_k_tiles = triton.cdiv(n, 16), triton.cdiv(nb, block_kb)
    n_tiles = e * n_row_tiles * n_k_tiles
    consts = dict(BLOCK_KB=block_kb, TWO_D=recipe == "2d", SWIZZLE=swizzle, TE=op_order == "te",
                  num_warps=cfg["num_warps"])
    amax_flat = amax.reshape(-1).contiguous()
    if n_tiles:
        _weight_quant_kernel[(_grid(n_tiles, cfg["persist_stages"], w.device),)](
            w3, amax_flat, 0 if amax_flat.numel() == 1 else 1, codes, scales, gs, n, k, n_row_tiles, n_k_tiles,
            n_tiles, PERSIST_STAGES=cfg["persist_stages"], **consts)
    gs = gs.reshape(amax.shape)
    if w.dim() == 2:
        codes, scales = codes[0], scales[0]
    return codes, scales, gs, amax if used is None else used


def _out_views(out: NVFP4Tensor, e: int, n: int, k: int, n_scales: int, device: torch.device):
    """`out`'s tensors as the kernel writes them: codes uint8 [E, N, K/2], linear block scales e4m3
    [E, N, K/16], decode scales fp32 [n_scales] (views, no copy); ValueError if they do not fit."""
    want = ((out.codes, torch.uint8, e * n * (k // 2)), (out.block_scales, torch.float8_e4m3fn, e * n * (k // BLOCK)),
            (out.global_scale, torch.float32, n_scales))
    for t, dtype, numel in want:
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != device:
            raise ValueError(f"out: expected contiguous {dtype} of {numel} elements on {device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    return out.codes.view(e, n, k // 2), out.block_scales.view(e, n, k // BLOCK), out.global_scale.view(n_scales)


def quantize_weight(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                    op_order: str = "vllm", check_finite: bool = True, config: dict | None = None) -> NVFP4Tensor:
    """Quantize a weight [N, K] (global_scale []) or experts [E, N, K] (global_scale [E]) on CUDA;
    bit-identical to `reference.quantize_weight`.

    recipe: "1d" (1x16 blocks) or "2d" (16x16 tiles). amax: optional fp32 [] or [E] (e.g. the
    learner's); without it max|w| per expert, reduced before the quantizer.
    op_order: "vllm" (the spec) or "te" (TransformerEngine's quantizer). check_finite: raise on NaN/Inf
    (one host sync; one extra read of w when amax is given); the converter's fast path passes False
    after checking amax itself. config: launch override (keys of WEIGHT_CONFIG), for tuning.
    """
    codes, scales, gs, _ = _weight_launch(w, recipe=recipe, amax=amax, check_finite=check_finite, swizzle=False,
                                          config=config, op_order=op_order)
    return NVFP4Tensor(codes, scales, gs)


def quantize_weight_into(w: torch.Tensor, out: NVFP4Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                         share: int = 1, op_order: str = "vllm") -> torch.Tensor:
    """`quantize_weight` written into `out` (contiguous codes, linear block scales and decode scales of the
    result's sizes, e.g. views of a send buffer), no host sync and no NaN/Inf check: returns the
    amax used, given or computed (fp32 [E / share]: one amax for each `share` consecutive
    experts, their global scales alike; [] for [N, K]); NaN or Inf in w make it non-finite."""
    return _weight_launch(w, recipe=recipe, amax=amax, check_finite=False, swizzle=False, op_order=op_order,
                          out=out, share=share)[3]


def quantize_weight_swizzled(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                             op_order: str = "vllm", check_finite: bool = True) -> SwizzledNVFP4:
    """As `quantize_weight`, with block scales in the 128x4 swizzled layout per expert:
    [roundup(N,128), roundup(K/16,4)] (or [E, ...])."""
    codes, scales, gs, _ = _weight_launch(w, recipe=recipe, amax=amax, check_finite=check_finite, swizzle=True,
                                          op_order=op_order)
    return SwizzledNVFP4(codes, scales, gs)
