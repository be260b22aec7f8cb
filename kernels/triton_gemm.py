"""W4A4 NVFP4 GEMMs for CUDA GPUs without FP4 tensor cores (Triton; written for Hopper sm_90).

Exact emulation: e2m1(q) * float(s) has at most 6 significant bits, so it is exact in FP16 (and
BF16); the tensor cores multiply those exactly and accumulate in FP32; the FP32 second-level
scales (per token for activations, per output row for weights) are applied in the epilogue, in
the reference's order ((acc * S_dec_a) * S_dec_w) + bias. Results differ from `reference.nvfp4_gemm`
only by the order of the FP32 additions.

Four paths, chosen by `linear_path(m, ...)`:
  "mma"     (2 <= M <= 16, per token, bf16/fp16)  `cuda_mma`: CUDA C++ on FP16 tensor cores
            (mma.sync) over the ModelOpt codes and exact FP16 activations; batch-invariant.
  "gemv"    (M = 1, or M <= GEMV_MAX_M without mma)  `_w4a4_gemv_kernel`: weights stay packed 4-bit in memory and are read
            as int64 blocks of 16 codes; shifts and masks turn codes into FP16 bit patterns and packed
            FP16 multiply-adds form exact block dot products (see `_DOT16`), scaled and summed in
            FP32: no shared memory, no barrier in the K loop.
  "packed"  (M <= PACKED_MAX_M)  `_w4a4_kernel`: an inline-PTX `prmt` table decode, then tensor
            cores (tl.dot FP16 x FP16 -> FP32) as W @ A^T so the big operand is the MMA's register operand.
            Both: split-K partial sums go to one FP32 plane per K-slice; the last program of a tile
            (atomic counter) adds the planes in a fixed order (bitwise deterministic) and applies the
            epilogue, so a call is one launch after the activation quantization.
  "bf16"    (larger M)  the activation is quantized into exact BF16 values (one fused pass), the
            weight is decoded into a transient exact BF16 copy (no persistent cache: memory stays at
            0.28x BF16), cuBLAS multiplies with an FP32 output (`torch.mm(..., out_dtype=float32)`),
            and one Triton pass applies the scales and the bias.
The packed kernel also serves the MoE grouped GEMM (`kernels.triton_moe`): tiles map to experts through
device-side metadata, activation rows are gathered by index, and the epilogue can fuse SwiGLU and
the router weight.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import cuda_mma, triton_quant
from .format import NVFP4Tensor

PACKED_MAX_M = 64
_MMA_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _mma_supported(device: torch.device) -> bool:
    """cuda_mma can run on this device: probed and prepared once per device (`cuda_mma.prepare`),
    at load time through `dispatch.TritonHopperBackend.prepare`."""
    return cuda_mma.prepare(device)[0]

# fp16 high bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 (low bytes are zero)
_DECODE_LO = tl.constexpr("""{
.reg .b32 sel, t, w, tlo, thi, z;
mov.b32 tlo, 0x3E3C3800;
mov.b32 thi, 0x46444240;
mov.b32 z, 0;
shl.b32 sel, $2, 4;
and.b32 sel, sel, 0x7070;
prmt.b32 t, tlo, thi, sel;
prmt.b32 w, $2, z, 0x1404;
shl.b32 w, w, 4;
and.b32 w, w, 0x80008000;
or.b32 $0, t, w;
shr.b32 sel, $2, 12;
and.b32 sel, sel, 0x7070;
prmt.b32 t, tlo, thi, sel;
prmt.b32 w, $2, z, 0x3424;
shl.b32 w, w, 4;
and.b32 w, w, 0x80008000;
or.b32 $1, t, w;
}""")
_DECODE_HI = tl.constexpr("""{
.reg .b32 sel, t, w, tlo, thi, z;
mov.b32 tlo, 0x3E3C3800;
mov.b32 thi, 0x46444240;
mov.b32 z, 0;
and.b32 sel, $2, 0x7070;
prmt.b32 t, tlo, thi, sel;
prmt.b32 w, $2, z, 0x1404;
and.b32 w, w, 0x80008000;
or.b32 $0, t, w;
shr.b32 sel, $2, 16;
and.b32 sel, sel, 0x7070;
prmt.b32 t, tlo, thi, sel;
prmt.b32 w, $2, z, 0x3424;
and.b32 w, w, 0x80008000;
or.b32 $1, t, w;
}""")


@triton.jit
def _e2m1_fp16(nib):
    """Codes in [0, 15] (int32) -> fp16 E2M1 values (portable decode, used by the interpreter)."""
    e = (nib >> 1) & 3
    m = (nib & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
    return tl.where((nib & 8) != 0, -mag, mag).to(tl.float16)


@triton.jit
def _decode(packed, scales, USE_ASM: tl.constexpr):
    """Packed codes uint8 [R, KH] and their e4m3 scales [R, KH/8] -> (lo, hi) fp16 [R, KH]:
    lo[r, i] = e2m1(low nibble of byte i) * s, hi[r, i] = e2m1(high nibble) * s (both exact)."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_DECODE_LO, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_DECODE_HI, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        lo = _e2m1_fp16(p & 15)
        hi = _e2m1_fp16(p >> 4)
    R: tl.constexpr = packed.shape[0]
    KH: tl.constexpr = packed.shape[1]
    s = scales.to(tl.float16)[:, :, None]
    lo = tl.reshape(tl.reshape(lo, (R, KH // 8, 8)) * s, (R, KH))
    hi = tl.reshape(tl.reshape(hi, (R, KH // 8, 8)) * s, (R, KH))
    return lo, hi


@triton.jit
def _load_packed(codes, scales, rows64, rmask, k0, k_end, KH: tl.constexpr, KB: tl.constexpr, K):
    """Packed bytes [R, KH] and e4m3 scales [R, KB] of rows (row length K) at element offset k0,
    masked at and beyond element k_end."""
    kh = k0 // 2 + tl.arange(0, KH)
    kb = k0 // 16 + tl.arange(0, KB)
    c = tl.load(codes + rows64[:, None] * (K // 2) + kh[None, :], mask=rmask[:, None] & (kh < k_end // 2)[None, :], other=0)
    s = tl.load(scales + rows64[:, None] * (K // 16) + kb[None, :], mask=rmask[:, None] & (kb < k_end // 16)[None, :],
                other=0.0)
    return c, s


@triton.jit
def _w4a4_kernel(
    # activations, per-token quantized: codes [*, K/2], scales [*, K/16], S_dec [*] (stride 0: per tensor)
    a_codes, a_scales, a_gs, stride_a_gs,
    a_index,                         # int32 [R]: A row of each logical row (GATHER)
    # weights [E, W_ROWS, K/2], scales [E, W_ROWS, K/16], S_dec at e*stride_gs_e + n*stride_gs_n
    w_codes, w_scales, w_gs, stride_gs_e, stride_gs_n, W_ROWS,
    out, row_weight, bias,           # out [R, N]; row_weight fp32 [R] (ROW_WEIGHT); bias [N] (HAS_BIAS)
    tile_expert, tile_start, tile_end,   # int32 [tiles] (GROUPED): expert and row range of each M tile
    ws, counters,                    # split-K: fp32 [SPLIT_K, R, N] planes, int32 [tiles * n_tiles] zeroed
    R, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, ROW_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GROUPED:
        e = tl.load(tile_expert + pid_m)
        r0 = tl.load(tile_start + pid_m)
        r1 = tl.load(tile_end + pid_m)
    else:
        e = pid_m * 0
        r0 = pid_m * BLOCK_M
        r1 = R
    if r0 < r1:
        KH: tl.constexpr = BLOCK_K // 2
        KB: tl.constexpr = BLOCK_K // 16
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < r1
        if GATHER:
            arow = tl.load(a_index + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        wrow = e.to(tl.int64) * W_ROWS + cols
        k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # register prefetch two K steps deep: the packed bytes of steps k+1 and k+2 are in flight
        # while step k is decoded (Triton does not pipeline loads that do not feed tl.dot)
        a_c, a_s = _load_packed(a_codes, a_scales, arow, rmask, k_lo, k_hi, KH, KB, K)
        w_c, w_s = _load_packed(w_codes, w_scales, wrow, cmask, k_lo, k_hi, KH, KB, K)
        a_c1, a_s1 = _load_packed(a_codes, a_scales, arow, rmask, k_lo + BLOCK_K, k_hi, KH, KB, K)
        w_c1, w_s1 = _load_packed(w_codes, w_scales, wrow, cmask, k_lo + BLOCK_K, k_hi, KH, KB, K)
        if SWIGLU:
            u_c, u_s = _load_packed(w_codes, w_scales, wrow + N, cmask, k_lo, k_hi, KH, KB, K)
            u_c1, u_s1 = _load_packed(w_codes, w_scales, wrow + N, cmask, k_lo + BLOCK_K, k_hi, KH, KB, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a_c2, a_s2 = _load_packed(a_codes, a_scales, arow, rmask, k0 + 2 * BLOCK_K, k_hi, KH, KB, K)
            w_c2, w_s2 = _load_packed(w_codes, w_scales, wrow, cmask, k0 + 2 * BLOCK_K, k_hi, KH, KB, K)
            a_lo, a_hi = _decode(a_c, a_s, USE_ASM)
            w_lo, w_hi = _decode(w_c, w_s, USE_ASM)
            acc = tl.dot(w_lo, tl.trans(a_lo), acc)
            acc = tl.dot(w_hi, tl.trans(a_hi), acc)
            if SWIGLU:
                u_c2, u_s2 = _load_packed(w_codes, w_scales, wrow + N, cmask, k0 + 2 * BLOCK_K, k_hi, KH, KB, K)
                u_lo, u_hi = _decode(u_c, u_s, USE_ASM)
                acc_u = tl.dot(u_lo, tl.trans(a_lo), acc_u)
                acc_u = tl.dot(u_hi, tl.trans(a_hi), acc_u)
                u_c, u_s, u_c1, u_s1 = u_c1, u_s1, u_c2, u_s2
            a_c, a_s, a_c1, a_s1 = a_c1, a_s1, a_c2, a_s2
            w_c, w_s, w_c1, w_s1 = w_c1, w_s1, w_c2, w_s2
        a_g = tl.load(a_gs + arow * stride_a_gs, mask=rmask, other=0.0)
        _finish_tile(acc, acc_u, a_g, rows, rmask, cols, cmask, e, pid_m * tl.num_programs(1) + pid_n, pid_k, R * N,
                     ws, counters, out, w_gs, stride_gs_e, stride_gs_n, row_weight, bias, N, SPLIT_K, SWIGLU,
                     ROW_WEIGHT, HAS_BIAS)


# The decode-size kernel multiplies 4-bit codes on packed FP16 units, exactly. A code nibble
# s|e1 e0|m placed at FP16 bits 15 | 11..10 | 9 is the FP16 number e2m1(code) * 2^-14 (e = 0 lands
# on the FP16 subnormals, which scale by 2^-14 too), so a weight word of 8 codes becomes 4 FP16x2
# registers with 2 shifts and 2 masks each. Activations are decoded as e2m1 * 2^13. A product is
# then e2m1_w * e2m1_a / 2, a multiple of 2^-3 of magnitude <= 18; the 8 products that meet in one
# FP16 half over a 16-element block sum to <= 144 (<= 1152 * 2^-3, below 2^11 units): every FP16
# multiply-add is exact. Two halves -> FP32 (exact), times (2 * s_w * s_a) (a 12-bit integer of
# 2^-3 units times an 8-bit product: exact in FP32), then one FP32 addition per block.
_DOT16 = tl.constexpr("""{
.reg .b32 h;
.reg .b16 l, u;
.reg .f32 fl, fu;
mul.rn.f16x2 h, $1, $9;
fma.rn.f16x2 h, $2, $10, h;
fma.rn.f16x2 h, $3, $11, h;
fma.rn.f16x2 h, $4, $12, h;
fma.rn.f16x2 h, $5, $13, h;
fma.rn.f16x2 h, $6, $14, h;
fma.rn.f16x2 h, $7, $15, h;
fma.rn.f16x2 h, $8, $16, h;
mov.b32 {l, u}, h;
cvt.f32.f16 fl, l;
cvt.f32.f16 fu, u;
add.f32 $0, fl, fu;
}""")


# FP16x2 e2m1 * 2^-14 -> e2m1 * 2^13: times 2^14 (exact, subnormals included) then 2^13 (<= 49152)
_TIMES_2POW27 = tl.constexpr("""{
.reg .b32 c;
mov.b32 c, 0x74007400;
mul.rn.f16x2 $0, $1, c;
mov.b32 c, 0x70007000;
mul.rn.f16x2 $0, $0, c;
}""")


@triton.jit
def _word_regs(p):
    """int32 word of 8 codes (element j in bits 4j..4j+3) -> 4 int32 FP16x2 registers holding
    e2m1 * 2^-14 of the element pairs (0, 4), (1, 5), (2, 6), (3, 7) (low half, high half)."""
    mag: tl.constexpr = 0x0E000E00
    sgn: tl.constexpr = -2147450880                                  # 0x80008000
    r0 = ((p << 9) & mag) | ((p << 12) & sgn)
    r1 = ((p << 5) & mag) | ((p << 8) & sgn)
    r2 = ((p << 1) & mag) | ((p << 4) & sgn)
    r3 = ((p >> 3) & mag) | (p & sgn)
    return r0, r1, r2, r3


@triton.jit
def _block_regs(blk):
    """int64 blocks of 16 codes -> 8 FP16x2 registers of e2m1 * 2^-14 (see `_word_regs`)."""
    r0, r1, r2, r3 = _word_regs(blk.to(tl.int32))
    r4, r5, r6, r7 = _word_regs((blk >> 32).to(tl.int32))
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _half(r, HIGH: tl.constexpr):
    """FP16 half of an int32 FP16x2 register as fp32."""
    bits = (r >> 16) if HIGH else r
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _times_2pow27(r):
    """FP16x2 register of e2m1 * 2^-14 -> e2m1 * 2^13 (exact: |e2m1 * 2^13| <= 49152)."""
    lo = (_half(r, False) * 134217728.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (_half(r, True) * 134217728.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (hi << 16)


@triton.jit
def _act_reg(r, USE_ASM: tl.constexpr):
    """FP16x2 register of e2m1 * 2^-14 -> e2m1 * 2^13: two packed FP16 multiplies (GPU) or through fp32."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_TIMES_2POW27, "=r,r", [r], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _times_2pow27(r)


@triton.jit
def _act_block_regs(blk, USE_ASM: tl.constexpr):
    """int64 activation blocks -> 8 FP16x2 registers of e2m1 * 2^13 (the pairing of `_block_regs`)."""
    r0, r1, r2, r3, r4, r5, r6, r7 = _block_regs(blk)
    return (_act_reg(r0, USE_ASM), _act_reg(r1, USE_ASM), _act_reg(r2, USE_ASM), _act_reg(r3, USE_ASM),
            _act_reg(r4, USE_ASM), _act_reg(r5, USE_ASM), _act_reg(r6, USE_ASM), _act_reg(r7, USE_ASM))


@triton.jit
def _dot16(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, USE_ASM: tl.constexpr):
    """Exact sum over a 16-element block of (e2m1_w * 2^-14) * (e2m1_a * 2^13) as fp32 (broadcasting
    operands). USE_ASM: packed FP16 multiply-adds (GPU); else fp32 arithmetic (same exact value)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_DOT16, "=f" + ",r" * 16,
                                         [w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        lo = (_half(w0, False) * _half(a0, False) + _half(w1, False) * _half(a1, False)
              + _half(w2, False) * _half(a2, False) + _half(w3, False) * _half(a3, False)
              + _half(w4, False) * _half(a4, False) + _half(w5, False) * _half(a5, False)
              + _half(w6, False) * _half(a6, False) + _half(w7, False) * _half(a7, False))
        hi = (_half(w0, True) * _half(a0, True) + _half(w1, True) * _half(a1, True)
              + _half(w2, True) * _half(a2, True) + _half(w3, True) * _half(a3, True)
              + _half(w4, True) * _half(a4, True) + _half(w5, True) * _half(a5, True)
              + _half(w6, True) * _half(a6, True) + _half(w7, True) * _half(a7, True))
        return lo + hi


@triton.jit
def _load_blocks(codes64, scales, rows64, rmask, b0, b_end, NB, BLOCK_B: tl.constexpr):
    """Blocks [R, BLOCK_B] of rows (NB blocks per row) from block b0: codes as int64 (16 codes
    each) and the e4m3 scales as fp32, zero at and beyond block b_end."""
    b = b0 + tl.arange(0, BLOCK_B)
    mask = rmask[:, None] & (b < b_end)[None, :]
    off = rows64[:, None] * NB + b[None, :]
    c = tl.load(codes64 + off, mask=mask, other=0)
    s = tl.load(scales + off, mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _load_x(x, stride_xm, rows64, rmask, b0, b_end, BLOCK_B: tl.constexpr):
    """Activations x[rows, 16*b0 : 16*(b0 + BLOCK_B)] as fp32 [R, BLOCK_B, 16], zero at and beyond
    block b_end."""
    b = b0 + tl.arange(0, BLOCK_B)
    cols = b[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    mask = rmask[:, None, None] & (b < b_end)[None, :, None]
    return tl.load(x + rows64[:, None, None] * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_blocks(xb, s_enc, TE: tl.constexpr, PER_ROW: tl.constexpr):
    """The spec's quantizer (`triton_quant._quantize_tile`, op order TE, per-row element scales
    PER_ROW) on xb fp32 [R, BB, 16] with S_enc [R] -> codes as int64 blocks [R, BB] and e4m3
    scales as fp32 [R, BB]."""
    R: tl.constexpr = xb.shape[0]
    BB: tl.constexpr = xb.shape[1]
    packed, scale, _ = triton_quant._quantize_tile(xb, tl.max(tl.abs(xb), axis=2), s_enc, TE, PER_ROW)
    byte_shift = (tl.arange(0, 8) * 8).to(tl.int64)
    blk = tl.sum(tl.reshape(packed, (R, BB, 8)).to(tl.int64) << byte_shift[None, None, :], axis=2)
    return blk, scale.to(tl.float32)


@triton.jit
def _w4a4_gemv_kernel(
    x, stride_xm,                              # activations [M, K] float (rows of stride_xm, unit column stride)
    amax, stride_amax,                         # fp32 amax override per row (stride 1) or per tensor (stride 0) (GIVEN_AMAX)
    a_codes64, a_scales, a_gs, stride_a_gs,    # or, not FUSED: per-token NVFP4 codes as int64 [M, K/16], scales, S_dec
    w_codes64, w_scales, w_gs, stride_gs_e, stride_gs_n,   # weights [E, W_ROWS, K] NVFP4 (codes as int64 blocks)
    W_ROWS, pair_expert, TOPK,                 # PAIRED: output row p uses expert pair_expert[p] and x row p // TOPK
    out, row_weight, bias, ws, counters, M, N, K,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT_K: tl.constexpr,
    AMAX_B: tl.constexpr,                      # blocks per row read per step of the amax pass
    FUSED: tl.constexpr, GIVEN_AMAX: tl.constexpr, PER_TENSOR: tl.constexpr, PAIRED: tl.constexpr,
    SWIGLU: tl.constexpr, ROW_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
    TE: tl.constexpr,                          # FUSED quantization in TransformerEngine's op order
):
    """Decode-size W4A4 GEMM on the packed FP16 units (exact block dots, see `_DOT16`): no shared
    memory, no barrier in the K loop. acc[m, n, b] += dot16(w[n, b], a[m, b]) * (2 s_w s_a).
    FUSED: the activation is quantized here (one launch per linear): every program reduces the
    amax of its rows over all of K (unless GIVEN_AMAX), then quantizes its K-slice block by block
    with the spec's float operations (bit-identical codes and scales); PER_TENSOR: one amax for
    all rows. Not FUSED: the activation comes quantized (a_codes64, a_scales, a_gs).
    PAIRED (MoE decode, M_PAD 1): grid axis 2 runs over the M (token, expert) pairs; SWIGLU: the
    expert's rows are [gate; up] (W_ROWS = 2N) and out = silu(gate) * up; ROW_WEIGHT: times
    row_weight[p] (the router weight)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB = K // 16
    rows = tl.arange(0, M_PAD)
    if PAIRED:
        pair = tl.program_id(2)
        orow = pair + rows
        rmask = rows < 1
        arow = (pair // TOPK + rows).to(tl.int64)
        e = tl.load(pair_expert + pair)
        tile = pair * tl.num_programs(0) + pid_n
    else:
        orow = rows
        rmask = rows < M
        arow = rows.to(tl.int64)
        e = pid_n * 0
        tile = pid_n
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    wrow = e.to(tl.int64) * W_ROWS + cols
    b_per = ((NB + SPLIT_K - 1) // SPLIT_K + BLOCK_B - 1) // BLOCK_B * BLOCK_B
    b_lo = pid_k * b_per
    b_hi = min(b_lo + b_per, NB)
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_B), dtype=tl.float32)
    acc_u = tl.zeros((M_PAD, BLOCK_N, BLOCK_B), dtype=tl.float32)
    # register prefetch two steps deep (Triton pipelines only loads that feed tl.dot); issued
    # before the activation's amax pass so the weight bytes are in flight meanwhile
    w_c, w_s = _load_blocks(w_codes64, w_scales, wrow, cmask, b_lo, b_hi, NB, BLOCK_B)
    w_c1, w_s1 = _load_blocks(w_codes64, w_scales, wrow, cmask, b_lo + BLOCK_B, b_hi, NB, BLOCK_B)
    if SWIGLU:
        u_c, u_s = _load_blocks(w_codes64, w_scales, wrow + N, cmask, b_lo, b_hi, NB, BLOCK_B)
        u_c1, u_s1 = _load_blocks(w_codes64, w_scales, wrow + N, cmask, b_lo + BLOCK_B, b_hi, NB, BLOCK_B)
    if FUSED:
        if GIVEN_AMAX:
            row_amax = tl.load(amax + arow * stride_amax, mask=rmask, other=0.0)
        else:
            row_amax = tl.zeros((M_PAD,), dtype=tl.float32)
            for c0 in range(0, NB, AMAX_B):
                xa = _load_x(x, stride_xm, arow, rmask, c0, NB, AMAX_B)
                row_amax = tl.maximum(row_amax, tl.max(tl.max(tl.abs(xa), axis=2), axis=1))
            if PER_TENSOR:
                row_amax = tl.zeros((M_PAD,), dtype=tl.float32) + tl.max(row_amax, axis=0)
        if not PER_TENSOR:
            row_amax = triton_quant._row_amax_floor(row_amax, TE)
        s_enc = triton_quant._s_enc_from_amax(row_amax, TE)                 # [M_PAD]
        a_g = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
        x0 = _load_x(x, stride_xm, arow, rmask, b_lo, b_hi, BLOCK_B)
        x1 = _load_x(x, stride_xm, arow, rmask, b_lo + BLOCK_B, b_hi, BLOCK_B)
    else:
        a_g = tl.load(a_gs + arow * stride_a_gs, mask=rmask, other=0.0)
        a_c0, a_s0 = _load_blocks(a_codes64, a_scales, arow, rmask, b_lo, b_hi, NB, BLOCK_B)
        a_c1, a_s1 = _load_blocks(a_codes64, a_scales, arow, rmask, b_lo + BLOCK_B, b_hi, NB, BLOCK_B)
    for b0 in range(b_lo, b_hi, BLOCK_B):
        w_c2, w_s2 = _load_blocks(w_codes64, w_scales, wrow, cmask, b0 + 2 * BLOCK_B, b_hi, NB, BLOCK_B)
        if FUSED:
            x2 = _load_x(x, stride_xm, arow, rmask, b0 + 2 * BLOCK_B, b_hi, BLOCK_B)
            a_c, a_s = _quantize_blocks(x0, s_enc, TE, not PER_TENSOR)
            x0, x1 = x1, x2
        else:
            a_c2, a_s2 = _load_blocks(a_codes64, a_scales, arow, rmask, b0 + 2 * BLOCK_B, b_hi, NB, BLOCK_B)
            a_c, a_s = a_c0, a_s0
            a_c0, a_s0, a_c1, a_s1 = a_c1, a_s1, a_c2, a_s2
        a0, a1, a2, a3, a4, a5, a6, a7 = _act_block_regs(a_c[:, None, :], USE_ASM)
        w0, w1, w2, w3, w4, w5, w6, w7 = _block_regs(w_c[None, :, :])
        d = _dot16(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, USE_ASM)
        acc += d * ((w_s * 2.0)[None, :, :] * a_s[:, None, :])
        w_c, w_s, w_c1, w_s1 = w_c1, w_s1, w_c2, w_s2
        if SWIGLU:
            u_c2, u_s2 = _load_blocks(w_codes64, w_scales, wrow + N, cmask, b0 + 2 * BLOCK_B, b_hi, NB, BLOCK_B)
            w0, w1, w2, w3, w4, w5, w6, w7 = _block_regs(u_c[None, :, :])
            d = _dot16(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, USE_ASM)
            acc_u += d * ((u_s * 2.0)[None, :, :] * a_s[:, None, :])
            u_c, u_s, u_c1, u_s1 = u_c1, u_s1, u_c2, u_s2
    tot = tl.trans(tl.sum(acc, axis=2))                                      # [BLOCK_N, M_PAD]
    tot_u = tl.trans(tl.sum(acc_u, axis=2))
    _finish_tile(tot, tot_u, a_g, orow, rmask, cols, cmask, e, tile, pid_k, M * N, ws, counters, out,
                 w_gs, stride_gs_e, stride_gs_n, row_weight, bias, N, SPLIT_K, SWIGLU, ROW_WEIGHT, HAS_BIAS)


@triton.jit
def _finish_tile(acc, acc_u, a_g, rows, rmask, cols, cmask, e, tile, pid_k, plane, ws, counters, out,
                 w_gs, stride_gs_e, stride_gs_n, row_weight, bias, N, SPLIT_K: tl.constexpr,
                 SWIGLU: tl.constexpr, ROW_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Epilogue of an acc [BLOCK_N, BLOCK_M] tile; a_g fp32 [BLOCK_M]: S_dec of the activation rows;
    rows: output rows. Split-K: each program stores its partial sums in its own plane ws[pid_k]
    (plane = R * N floats; SWIGLU: acc_u in ws[SPLIT_K + pid_k]); the last program of the tile
    (atomic counter) adds the SPLIT_K planes in index order, so the result is bitwise the same run
    to run, and re-zeroes the counter. Then ((acc * S_dec_a) * S_dec_w) [SwiGLU] [* row weight]
    [+ bias] is stored as out[rows, cols]. tile: index of this output tile among the launch's tiles."""
    omask = cmask[:, None] & rmask[None, :]
    o_off = rows.to(tl.int64)[None, :] * N + cols[:, None]
    if SPLIT_K > 1:
        tl.store(ws + pid_k * plane + o_off, acc, mask=omask)
        if SWIGLU:                                                  # up-projection planes follow
            tl.store(ws + (SPLIT_K + pid_k) * plane + o_off, acc_u, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            acc_u = tl.zeros_like(acc_u)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(ws + s * plane + o_off, mask=omask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_u += tl.load(ws + (SPLIT_K + s) * plane + o_off, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(counters + tile, 0)
    else:
        last = True
    if last:
        w_g = tl.load(w_gs + e * stride_gs_e + cols * stride_gs_n, mask=cmask, other=0.0)
        val = acc * a_g[None, :] * w_g[:, None]
        if SWIGLU:
            w_su = tl.load(w_gs + e * stride_gs_e + (cols + N) * stride_gs_n, mask=cmask, other=0.0)
            up = acc_u * a_g[None, :] * w_su[:, None]
            val = val / (1.0 + tl.exp(-val)) * up
        if ROW_WEIGHT:
            val = val * tl.load(row_weight + rows, mask=rmask, other=0.0)[None, :]
        if HAS_BIAS:
            val = val + tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out + o_off, val.to(out.dtype.element_ty), mask=omask)


@triton.jit
def _dequant_bf16_kernel(codes, scales, out, ROWS, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """codes uint8 [ROWS, K/2], scales e4m3 [ROWS, K/16] -> out bf16 [ROWS, K] = e2m1 * s (exact)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    kb = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    r64 = r.to(tl.int64)
    rmask = r < ROWS
    c = tl.load(codes + r64[:, None] * (K // 2) + kh[None, :], mask=rmask[:, None] & (kh < K // 2)[None, :], other=0)
    s = tl.load(scales + r64[:, None] * (K // 16) + kb[None, :], mask=rmask[:, None] & (kb < K // 16)[None, :], other=0.0)
    lo, hi = _decode(c, s, False)
    vals = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_K))
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out + r64[:, None] * K + kk[None, :], vals.to(tl.bfloat16), mask=rmask[:, None] & (kk < K)[None, :])


@triton.jit
def _scale_epilogue_kernel(acc, a_gs, w_gs, stride_w_gs, bias, out, M, N,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [M, N] = (acc * a_gs[m]) * w_gs[n] (+ bias[n]) from the FP32 product acc [M, N]."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m < M)[:, None] & (n < N)[None, :]
    off = m.to(tl.int64)[:, None] * N + n[None, :]
    v = tl.load(acc + off, mask=mask, other=0.0)
    v = v * tl.load(a_gs + m, mask=m < M, other=0.0)[:, None] * tl.load(w_gs + n * stride_w_gs, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out + off, v.to(out.dtype.element_ty), mask=mask)


def _workspace(device: torch.device, n_acc: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K buffers of one launch: fp32 partial-sum planes (n_acc = SPLIT_K * R * N floats, all
    written before they are read) and int32 tile counters (zeroed). Allocated per launch from torch's
    caching allocator, so a CUDA graph captures buffers that stay valid on replay (a module-level
    buffer grown after capture would leave captured graphs pointing at freed memory)."""
    return (torch.empty(n_acc, dtype=torch.float32, device=device),
            torch.zeros(n_tiles, dtype=torch.int32, device=device))


def packed_config(m: int, n: int, k: int, *, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                  num_stages: int = 1, min_programs: int = 264) -> dict:
    """Launch configuration of the packed kernel for out [m, n], reduction k.

    Decode sizes are memory bound: BLOCK_N 64 and split-K until about `min_programs` programs
    (2 per SM of an H200) keep enough weight bytes in flight. Tiles stay small because the
    in-register decode is register hungry (16x64x64 with 4 warps: ~90 registers, sm_90)."""
    block_m = 16 if m <= 16 else 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < min_programs and k // (block_k * split_k * 2) >= 2:
        split_k *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                num_warps=num_warps, num_stages=num_stages)


def _gs_strides(gs: torch.Tensor, rows_dim: int) -> tuple[int, int]:
    """(expert stride, row stride) of a weight global scale [], [N], [E] or [E, N]."""
    if gs.dim() == 0:
        return 0, 0
    if rows_dim == 2:                       # [N, K] weight
        return 0, gs.stride(0)
    if gs.dim() == 1:                       # [E, N, K] weight, per expert
        return gs.stride(0), 0
    return gs.stride(0), gs.stride(1)


def launch_w4a4(a: NVFP4Tensor, w: NVFP4Tensor, out: torch.Tensor, *, a_index: torch.Tensor | None = None,
                schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                row_weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                swiglu: bool = False, config: dict | None = None, use_asm: bool = not triton_quant.INTERPRET) -> torch.Tensor:
    """out [R, N] = epilogue(deq(a)[rows] @ deq(w[e]).T) with the packed kernel.

    a: [Ma, K] per-token (global_scale [Ma]) or per-tensor ([]) NVFP4. w: [N, K] or experts
    [E, W_ROWS, K] NVFP4 (global_scale [], [N], [E] or [E, N]). a_index int32 [R]: A row of
    each output row (else row r). schedule (tile_expert, tile_start, tile_end) int32 [tiles]:
    grouped tiles of BLOCK_M rows of one expert each (see triton_moe). swiglu: w rows are
    [gate; up] (W_ROWS = 2N) and out = silu(gate) * up. row_weight fp32 [R] multiplies each row.
    use_asm: decode codes with the inline-PTX table (default on GPU) or portable Triton arithmetic.
    """
    r, n = out.shape
    k = a.shape[-1]
    if w.shape[-1] != k:
        raise ValueError(f"activation K={k} does not match weight K={w.shape[-1]}")
    w_rows = w.codes.shape[-2]
    if w_rows != (2 * n if swiglu else n):
        raise ValueError(f"weight has {w_rows} rows, output has {n} columns (swiglu={swiglu})")
    cfg = dict(config or packed_config(r, n, k))
    if swiglu or schedule is not None:
        cfg["SPLIT_K"] = 1
    bm = cfg["BLOCK_M"]
    n_tiles_n = triton.cdiv(n, cfg["BLOCK_N"])
    if schedule is None:
        n_tiles_m = triton.cdiv(r, bm)
        tile_expert = tile_start = tile_end = None
    else:
        tile_expert, tile_start, tile_end = schedule
        n_tiles_m = tile_expert.numel()
    ws = cnt = None
    if cfg["SPLIT_K"] > 1:
        ws, cnt = _workspace(out.device, cfg["SPLIT_K"] * r * n, n_tiles_m * n_tiles_n)
    gse, gsn = _gs_strides(w.global_scale, w.codes.dim())
    grid = (n_tiles_m, n_tiles_n, cfg["SPLIT_K"])
    if r and n:
        _w4a4_kernel[grid](
            a.codes, a.block_scales, a.global_scale, 0 if a.global_scale.dim() == 0 else a.global_scale.stride(0),
            a_index, w.codes, w.block_scales, w.global_scale, gse, gsn, w_rows,
            out, row_weight, bias, tile_expert, tile_start, tile_end, ws, cnt,
            r, n, k, GROUPED=schedule is not None, GATHER=a_index is not None, SWIGLU=swiglu,
            ROW_WEIGHT=row_weight is not None, HAS_BIAS=bias is not None, USE_ASM=use_asm, **cfg)
    return out


GEMV_MAX_M = 4           # the dispatcher's gemv path; the kernel itself serves M <= GEMV_KERNEL_MAX_M
GEMV_KERNEL_MAX_M = 16
# The gemv quantizes the activation in its own launch for one token and weights of at most
# FUSED_MAX_ELEMENTS: each of its programs re-reads the row for the amax, which costs more than a
# second launch for larger N x K or M (H200, docs/BENCHMARKS.md: fused 8.6 / 7.6 us vs 10.5 / 8.9 us
# separate on 5120x2048 / 2048x4096; 11.8-30.6 vs 10.7-28.6 us on the 8B shapes, >= 4096x4096; M = 4
# up to 58 vs 36 us)
FUSED_MAX_M = 1
FUSED_MAX_ELEMENTS = 12 << 20
# (BLOCK_N, BLOCK_B) by padded M: per step a thread holds few (n, block) pairs for M <= 4 so the
# activation decode is shared by 4 weight rows; fewer for larger M (registers: 128-170, sm_90)
_GEMV_TILES = {1: (64, 16), 2: (64, 16), 4: (64, 16), 8: (32, 4), 16: (32, 8)}


def gemv_config(m: int, n: int, k: int, *, block_n: int | None = None, block_b: int | None = None,
                num_warps: int = 4, min_programs: int = 528) -> dict:
    """Launch configuration of the decode kernel (m <= GEMV_KERNEL_MAX_M): BLOCK_N output columns
    and BLOCK_B 16-element blocks per step, split-K until about `min_programs` programs (4 per SM
    of an H200) keep enough weight bytes in flight, with at least 2 steps per program; the fused
    amax pass reads 4096 / M_PAD elements per row per step."""
    m_pad = max(1, triton.next_power_of_2(m))
    tile_n, tile_b = _GEMV_TILES[m_pad]
    block_n, block_b = block_n or tile_n, block_b or tile_b
    nb = k // 16
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < min_programs and nb // (block_b * split_k * 2) >= 2:
        split_k *= 2
    return dict(M_PAD=m_pad, BLOCK_N=block_n, BLOCK_B=block_b, SPLIT_K=split_k,
                AMAX_B=min(triton.next_power_of_2(nb), max(block_b, 256 // m_pad)), num_warps=num_warps)


def launch_w4a4_gemv(x: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                     scaling: str = "per_token", amax: torch.Tensor | None = None, op_order: str = "vllm",
                     fused: bool | None = None, config: dict | None = None,
                     use_asm: bool = not triton_quant.INTERPRET) -> torch.Tensor:
    """out [M, N] = linear of x [M, K] (float, unit column stride; M <= GEMV_KERNEL_MAX_M) with w [N, K]
    NVFP4 (global_scale [] or [N], codes contiguous), exact packed-FP16 block dots.

    scaling "per_token" / "per_tensor"; amax: override, fp32 [M] per token or [] per tensor;
    op_order: the activation quantizer's, "vllm" or "te" (`reference`). fused: quantize x inside
    the GEMM launch (one launch) or with `triton_quant` first (two); None: fused for
    M <= FUSED_MAX_M and N * K <= FUSED_MAX_ELEMENTS. use_asm: packed FP16 inline PTX (GPU default)
    or portable fp32 arithmetic (same values; the CPU interpreter's path)."""
    m, n = out.shape
    k = x.shape[-1]
    if x.dim() != 2 or m != x.shape[0] or m > GEMV_KERNEL_MAX_M or w.codes.dim() != 2 or w.shape[-1] != k:
        raise ValueError(f"gemv needs x [M <= {GEMV_KERNEL_MAX_M}, K], w [N, K], out [M, N]; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, out {tuple(out.shape)}")
    if not w.codes.is_contiguous() or x.stride(-1) != 1:
        raise ValueError("gemv reads w.codes as contiguous int64 blocks and x rows with unit column stride")
    fused = m <= FUSED_MAX_M and n * k <= FUSED_MAX_ELEMENTS if fused is None else fused
    cfg = dict(config or gemv_config(m, n, k))
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    ws = cnt = None
    if cfg["SPLIT_K"] > 1:
        ws, cnt = _workspace(out.device, cfg["SPLIT_K"] * m * n, n_tiles)
    if fused:
        a_codes = a_scales = a_gs = None
        stride_a_gs = 0
        if amax is not None:
            amax = amax.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    elif scaling == "per_token":
        a = triton_quant.quantize_per_token(x, amax=amax, op_order=op_order)
        a_codes, a_scales, a_gs, stride_a_gs = a.codes.view(torch.int64), a.block_scales, a.global_scale, 1
    else:
        a = triton_quant.quantize_per_tensor(x, amax=amax, op_order=op_order)
        a_codes, a_scales, a_gs, stride_a_gs = a.codes.view(torch.int64), a.block_scales, a.global_scale, 0
    gs = w.global_scale
    if m and n:
        _w4a4_gemv_kernel[(n_tiles, cfg["SPLIT_K"])](
            x, x.stride(0), amax, 0 if amax is None or amax.numel() == 1 and scaling == "per_tensor" else 1,
            a_codes, a_scales, a_gs, stride_a_gs,
            w.codes.view(torch.int64), w.block_scales, gs, 0, 0 if gs.dim() == 0 else gs.stride(0), n, None, 1,
            out, None, bias, ws, cnt, m, n, k, FUSED=fused, GIVEN_AMAX=amax is not None,
            PER_TENSOR=scaling == "per_tensor", PAIRED=False, SWIGLU=False, ROW_WEIGHT=False,
            HAS_BIAS=bias is not None, USE_ASM=use_asm, TE=op_order == "te", **cfg)
    return out


# MoE: up to this many (token, expert) pairs run as per-pair GEMVs (no routing sort); H200
# (docs/BENCHMARKS.md): pairs 174 us vs grouped 321 us at 16 tokens x top-8, 624 vs 458 us at 64
PAIRED_MAX_PAIRS = 128


def launch_w4a4_pairs(x: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, *, pair_expert: torch.Tensor, topk: int,
                      swiglu: bool = False, row_weight: torch.Tensor | None = None, op_order: str = "vllm",
                      config: dict | None = None, use_asm: bool = not triton_quant.INTERPRET) -> torch.Tensor:
    """MoE decode GEMV, one launch: out[p] = linear of x[p // topk] (quantized per token inside the
    launch) with expert pair_expert[p] of w [E, W_ROWS, K] (global_scale [E] or [E, W_ROWS]).

    x [T, K] float (unit column stride); out [P, N], P = T * topk; pair_expert int32 [P].
    swiglu: W_ROWS = 2N (gate rows, then up rows), out = silu(gate) * up. row_weight fp32 [P]
    multiplies each output row (the router weight). op_order: the per-token quantizer's ("vllm" or
    "te"). Split-K partial sums are added in a fixed order."""
    p, n = out.shape
    e, w_rows, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] * topk != p or x.stride(-1) != 1:
        raise ValueError(f"x must be [P / topk, {k}] with unit column stride, got {tuple(x.shape)} for P={p}, topk={topk}")
    if w_rows != (2 * n if swiglu else n) or not w.codes.is_contiguous():
        raise ValueError(f"w must be contiguous [E, {2 * n if swiglu else n}, K], got {tuple(w.shape)}")
    # programs counted over all pairs; 8 blocks per step keep the SwiGLU variant at ~170 registers (sm_90)
    cfg = dict(config or gemv_config(1, n * p, k, block_b=8))
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    ws = cnt = None
    if cfg["SPLIT_K"] > 1:
        ws, cnt = _workspace(out.device, (2 if swiglu else 1) * cfg["SPLIT_K"] * p * n, p * n_tiles)
    gse, gsn = _gs_strides(w.global_scale, 3)
    if p and n:
        _w4a4_gemv_kernel[(n_tiles, cfg["SPLIT_K"], p)](
            x, x.stride(0), None, 0, None, None, None, 0,
            w.codes.view(torch.int64), w.block_scales, w.global_scale, gse, gsn, w_rows, pair_expert, topk,
            out, row_weight, None, ws, cnt, p, n, k, FUSED=True, GIVEN_AMAX=False, PER_TENSOR=False, PAIRED=True,
            SWIGLU=swiglu, ROW_WEIGHT=row_weight is not None, HAS_BIAS=False, USE_ASM=use_asm,
            TE=op_order == "te", **cfg)
    return out


def dequantize_bf16(w: NVFP4Tensor) -> torch.Tensor:
    """e2m1(q) * float(s) of w [..., K] as exact BF16 [..., K] (second-level scale not applied)."""
    k = w.shape[-1]
    codes = w.codes.reshape(-1, k // 2)
    out = torch.empty((codes.shape[0], k), dtype=torch.bfloat16, device=codes.device)
    block_k = min(512, triton.next_power_of_2(k))
    if codes.numel():
        _dequant_bf16_kernel[(triton.cdiv(codes.shape[0], 16), triton.cdiv(k, block_k))](
            codes, w.block_scales.reshape(-1, k // 16), out, codes.shape[0], k, BLOCK_R=16, BLOCK_K=block_k,
            num_warps=4)
    return out.reshape(w.shape)


def _linear_bf16(x2: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                 amax: torch.Tensor | None, op_order: str) -> torch.Tensor:
    a = triton_quant.quantize_per_token_exact(x2, amax=amax, op_order=op_order)
    acc = torch.mm(a.values, dequantize_bf16(w).t(), out_dtype=torch.float32)
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    gs = w.global_scale
    _scale_epilogue_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 128))](
        acc, a.global_scale, gs, 0 if gs.dim() == 0 else gs.stride(0), bias, out, m, n,
        HAS_BIAS=bias is not None, BLOCK_M=64, BLOCK_N=128, num_warps=8)
    return out


def linear_path(m: int, scaling: str, w: NVFP4Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which GEMM path a linear with m rows of `dtype` and weight w takes: "mma" (MMA_MIN_M <= m <=
    MMA_MAX_M, per token, w on a device where `cuda_mma` runs and of its shape contract, bf16/fp16),
    "gemv", "packed" or "bf16"."""
    if (cuda_mma.MMA_MIN_M <= m <= cuda_mma.MMA_MAX_M and scaling == "per_token" and w is not None
            and dtype in _MMA_DTYPES
            and w.codes.dim() == 2 and cuda_mma.shape_ok(*w.shape) and _mma_supported(w.codes.device)):
        return "mma"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "packed" if m <= PACKED_MAX_M or scaling == "per_tensor" else "bf16"


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None, scaling: str = "per_token",
           amax: torch.Tensor | None = None, op_order: str = "vllm", path: str | None = None) -> torch.Tensor:
    """W4A4 linear on CUDA: x [..., K] float, w [N, K] NVFP4 (global_scale [] or [N]) -> [..., N]
    in x.dtype. scaling "per_token" (default) or "per_tensor". amax: optional activation amax
    override, fp32 [...] (= x.shape[:-1]) per token or [] per tensor (`reference.linear`).
    op_order: the activation quantizer's, "vllm" (the spec) or "te".
    path forces "mma" (per token, bf16/fp16, `cuda_mma.shape_ok`), "gemv" (M <= GEMV_KERNEL_MAX_M), "packed" or
    "bf16" (per token only); default `linear_path`."""
    if w.codes.dim() != 2:
        raise ValueError(f"linear expects a weight [N, K], got shape {tuple(w.shape)}")
    if scaling not in ("per_token", "per_tensor"):
        raise ValueError(f"scaling must be 'per_token' or 'per_tensor', got {scaling!r}")
    x2 = x.reshape(-1, x.shape[-1])
    if amax is not None and scaling == "per_token":
        if amax.shape != x.shape[:-1]:
            raise ValueError(f"amax: per-token amax must have shape {tuple(x.shape[:-1])}, got {tuple(amax.shape)}")
        amax = amax.reshape(-1)
    path = path or linear_path(x2.shape[0], scaling, w, x.dtype)
    if path == "mma":
        if scaling != "per_token":
            raise ValueError("the mma path implements per-token scaling only")
        a = triton_quant.quantize_per_token_exact(x2, amax=amax, op_order=op_order, dtype=torch.float16)
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        cuda_mma.launch(a.values, a.global_scale, w, out, bias=bias)
    elif path == "bf16":
        if scaling != "per_token":
            raise ValueError("the bf16 path implements per-token scaling only")
        out = _linear_bf16(x2, w, bias, x.dtype, amax, op_order)
    elif path == "gemv":
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        launch_w4a4_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, out, bias=bias, scaling=scaling, amax=amax,
                         op_order=op_order)
    elif path == "packed":
        if scaling == "per_token":
            a = triton_quant.quantize_per_token(x2, amax=amax, op_order=op_order)
        else:
            a = triton_quant.quantize_per_tensor(x2, amax=amax, op_order=op_order)
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        launch_w4a4(a, w, out, bias=bias)
    else:
        raise ValueError(f"path must be 'mma', 'gemv', 'packed' or 'bf16', got {path!r}")
    return out.reshape(*x.shape[:-1], w.shape[0])
