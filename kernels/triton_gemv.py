"""The decode-size W4A4 NVFP4 GEMV on packed FP16 units (Triton; written for Hopper sm_90), and the
split-K finish it shares with the packed tensor-core kernel (`triton_gemm` imports `_finish_tile`,
`_workspace` and `_gs_strides` from here).

    launch_w4a4_gemv(x [M, K] float, w [N, K] NVFP4, out [M, N])          M <= GEMV_KERNEL_MAX_M
    launch_w4a4_pairs(x [T, K] float, w [E, W_ROWS, K] NVFP4, out [T * topk, N], pair_expert [T * topk])
    gemv_config(m, n, k) -> dict                                           launch configuration

Weights stay packed 4-bit in memory and are read as int64 blocks of 16 codes; shifts and masks turn
codes into FP16 bit patterns and packed FP16 multiply-adds form exact block dot products (see
`_DOT16`), scaled and summed in FP32: no shared memory, no barrier in the K loop. The activation is
quantized inside the launch (FUSED, the spec's float operations, bit-identical codes and scales)
or comes quantized by `triton_quant`. `launch_w4a4_pairs` is the MoE decode: one program row per
(token, expert) pair, SwiGLU and the router weight fused (`triton_moe` calls it for
T * topk <= its PAIRED_MAX_PAIRS). Split-K partial sums go to one FP32 plane per K-slice; the last
program of a tile (atomic counter) adds the planes in a fixed order (bitwise deterministic) and
applies the epilogue, so a call is one launch (two when the activation is quantized first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cuda_mma, triton_quant
from .format import NVFP4Tensor

# The decode-size kernel multiplies 4-bit codes on packed FP16 units, exactly. A code nibble
# s|e1 e0|m placed at FP16 bits 15 | 11..10 | 9 is the FP16 number e2m1(code) * 2^-14 (e = 0 lands
# on the FP16 subnormals, which scale by 2^-14 too), so a weight word of 8 codes becomes 4 FP16x2
# registers with 2 shifts and 2 masks each. Activations are decoded as e2m1 * 2^13. A product is
# then e2m1_w * e2m1_a / 2, a multiple of 2^-3 of magnitude <= 18; the 8 products that meet in one
# FP16 half over a 16-element block sum to <= 144 (<= 1152 * 2^-3, below 2^11 units): every FP16
# multiply-add is exact. Two halves -> FP32 (exact), times (2 * s_w * s_a) (a 12-bit integer of
# 2^-3 units times an 8-bit product: exact in FP32), then one FP32 addition per block.
_DOT16 = tl.constexpr("{\n.reg .b32 h;\n.reg .b16 l, u;\n.reg .f32 fl, fu;\nmul.rn.f16x2 h, $1, $9;\n"
                      + "".join(f"fma.rn.f16x2 h, ${i}, ${i + 8}, h;\n" for i in range(2, 9))
                      + "mov.b32 {l, u}, h;\ncvt.f32.f16 fl, l;\ncvt.f32.f16 fu, u;\nadd.f32 $0, fl, fu;\n}")


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
def _half_times_2pow27(r, HIGH: tl.constexpr):
    """One FP16 half of an FP16x2 register times 2^27 (through fp32), as int32 FP16 bits in [0, 0xFFFF]."""
    return (_half(r, HIGH) * 134217728.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _times_2pow27(r):
    """FP16x2 register of e2m1 * 2^-14 -> e2m1 * 2^13 (exact: |e2m1 * 2^13| <= 49152)."""
    return _half_times_2pow27(r, False) | (_half_times_2pow27(r, True) << 16)

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
def _dot8_half(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, HIGH: tl.constexpr):
    """Sum of the 8 products of the low (or HIGH) FP16 halves of 8 register pairs, in fp32 (exact)."""
    return (_half(w0, HIGH) * _half(a0, HIGH) + _half(w1, HIGH) * _half(a1, HIGH)
            + _half(w2, HIGH) * _half(a2, HIGH) + _half(w3, HIGH) * _half(a3, HIGH)
            + _half(w4, HIGH) * _half(a4, HIGH) + _half(w5, HIGH) * _half(a5, HIGH)
            + _half(w6, HIGH) * _half(a6, HIGH) + _half(w7, HIGH) * _half(a7, HIGH))


@triton.jit
def _dot16(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, USE_ASM: tl.constexpr):
    """Exact sum over a 16-element block of (e2m1_w * 2^-14) * (e2m1_a * 2^13) as fp32 (broadcasting
    operands). USE_ASM: packed FP16 multiply-adds (GPU); else fp32 arithmetic (same exact value)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_DOT16, "=f" + ",r" * 16,
                                         [w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return (_dot8_half(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, False)
                + _dot8_half(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, True))

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


@triton.jit(do_not_specialize=['M'])   # counts of tokens: one compilation for all
def _w4a4_gemv_kernel(
    x, stride_xm,                              # activations [M, K] float (rows of stride_xm, unit column stride)
    amax, stride_amax,                         # fp32 amax override per row (stride 1) or per tensor (stride 0) (GIVEN_AMAX)
    a_codes64, a_scales, a_gs, stride_a_gs,    # or, not FUSED: per-token NVFP4 codes as int64 [M, K/16], scales, S_dec
    w_codes64, w_scales, w_gs, stride_gs_e, stride_gs_n,   # weights [E, W_ROWS, K] NVFP4 (codes as int64 blocks)
    W_ROWS, pair_expert, TOPK,                 # PAIRED: output row p uses expert pair_expert[p] and x row p // TOPK
    out, row_weight, bias, ws, counters,
    combined, GROUP,                           # COMBINE: combined [M / GROUP, N] = each GROUP rows of out summed
    M, N, K,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT_K: tl.constexpr,
    AMAX_B: tl.constexpr,                      # blocks per row read per step of the amax pass
    FUSED: tl.constexpr, GIVEN_AMAX: tl.constexpr, PER_TENSOR: tl.constexpr, PAIRED: tl.constexpr,
    SWIGLU: tl.constexpr, ROW_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
    TE: tl.constexpr,                          # FUSED quantization in TransformerEngine's op order
    GDC_SIGNAL: tl.constexpr,                  # let a launch after us that waits (GDC_WAIT) start now
    GDC_WAIT: tl.constexpr,                    # launched programmatically: read x only once the launch before ends
    COMBINE: tl.constexpr,                     # PAIRED: the last finished pair of a group adds the group's rows
):
    """Decode-size W4A4 GEMM on the packed FP16 units (exact block dots, see `_DOT16`): no shared
    memory, no barrier in the K loop. acc[m, n, b] += dot16(w[n, b], a[m, b]) * (2 s_w s_a).
    FUSED: the activation is quantized here (one launch per linear): every program reduces the
    amax of its rows over all of K (unless GIVEN_AMAX), then quantizes its K-slice block by block
    with the spec's float operations (bit-identical codes and scales); PER_TENSOR: one amax for
    all rows. Not FUSED: the activation comes quantized (a_codes64, a_scales, a_gs).
    PAIRED (MoE decode, M_PAD 1): grid axis 2 runs over the M (token, expert) pairs; SWIGLU: the
    expert's rows are [gate; up] (W_ROWS = 2N) and out = silu(gate) * up; ROW_WEIGHT: times
    row_weight[p] (the router weight); COMBINE: out (fp32) keeps the pair rows and the last pair of each
    group of GROUP to finish a column tile (a ticket of its own, after the pairs' split-K tickets) adds the
    group's rows in order from 0 in fp32, rounded once into combined (`triton_moe.combine`'s arithmetic,
    without its launch). GDC_WAIT: the weights (never written by the launch before) are prefetched before
    the grid-dependency wait, everything else is read or written after it."""
    if GDC_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
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
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
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
    last = _finish_tile(tot, tot_u, a_g, orow, rmask, cols, cmask, e, tile, pid_k, M * N, ws, counters, out,
                        w_gs, stride_gs_e, stride_gs_n, row_weight, bias, N, SPLIT_K, SWIGLU, ROW_WEIGHT, HAS_BIAS)
    if COMBINE:
        if last:                                                  # this pair's row of the tile is stored
            tl.debug_barrier()
            group = pair // GROUP
            ticket = counters + (M + group) * tl.num_programs(0) + pid_n       # after the pairs' split-K tickets
            if tl.atomic_add(ticket, 1, sem="acq_rel") == GROUP - 1:
                sum_ = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for j in range(GROUP):
                    sum_ += tl.load(out + (group * GROUP + j).to(tl.int64) * N + cols, mask=cmask, other=0.0,
                                    cache_modifier=".cg")
                tl.store(combined + group.to(tl.int64) * N + cols, sum_.to(combined.dtype.element_ty), mask=cmask)
                tl.store(ticket, 0)


# ---- split-K finish and launch helpers, shared with the packed kernel (`triton_gemm`) ----
@triton.jit
def _finish_tile(acc, acc_u, a_g, rows, rmask, cols, cmask, e, tile, pid_k, plane, ws, counters, out,
                 w_gs, stride_gs_e, stride_gs_n, row_weight, bias, N, SPLIT_K: tl.constexpr,
                 SWIGLU: tl.constexpr, ROW_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Epilogue of an acc [BLOCK_N, BLOCK_M] tile; a_g fp32 [BLOCK_M]: S_dec of the activation rows;
    rows: output rows. Split-K: each program stores its partial sums in its own plane ws[pid_k]
    (plane = R * N floats; SWIGLU: acc_u in ws[SPLIT_K + pid_k]); the last program of the tile
    (atomic counter) adds the SPLIT_K planes in index order, so the result is bitwise the same run
    to run, and re-zeroes the counter. Then ((acc * S_dec_a) * S_dec_w) [SwiGLU] [* row weight]
    [+ bias] is stored as out[rows, cols]. tile: index of this output tile among the launch's tiles.
    Returns whether this program stored the tile."""
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
            val = triton_quant.swiglu(val, up)
        if ROW_WEIGHT:
            val = val * tl.load(row_weight + rows, mask=rmask, other=0.0)[None, :]
        if HAS_BIAS:
            val = val + tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out + o_off, val.to(out.dtype.element_ty), mask=omask)
    return last


def _workspace(device: torch.device, n_acc: int, n_tiles: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Split-K buffers of one launch: fp32 partial-sum planes (n_acc = SPLIT_K * R * N floats, twice that
    for SwiGLU's two halves; all written before they are read; from torch's caching allocator, so a CUDA
    graph captures buffers that stay valid on replay; None for n_acc 0: tickets only) and n_tiles zeroed
    int32 tile counters: the device's tickets where the backend's load-time `prepare` allocated them
    (`cuda_mma.tickets`: no fill kernel per launch; the last program of a tile re-zeroes its counter), else
    a zeroed buffer of this launch (the CPU interpreter, tests)."""
    shared = cuda_mma.tickets(device.index, allocate=False) if device.type == "cuda" else None
    return (torch.empty(n_acc, dtype=torch.float32, device=device) if n_acc else None,
            shared if shared is not None and shared.numel() >= n_tiles
            else torch.zeros(n_tiles, dtype=torch.int32, device=device))


def _gs_strides(gs: torch.Tensor, rows_dim: int) -> tuple[int, int]:
    """(expert stride, row stride) of a weight global scale [], [N], [E] or [E, N]."""
    if gs.dim() == 0:
        return 0, 0
    if rows_dim == 2:                       # [N, K] weight
        return 0, gs.stride(0)
    if gs.dim() == 1:                       # [E, N, K] weight, per expert
        return gs.stride(0), 0
    return gs.stride(0), gs.stride(1)


GEMV_KERNEL_MAX_M = 16   # rows the kernel serves (`triton_gemm.GEMV_MAX_M`: rows the dispatcher sends it)
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
            out, None, bias, ws, cnt, None, 1, m, n, k, FUSED=fused, GIVEN_AMAX=amax is not None,
            PER_TENSOR=scaling == "per_tensor", PAIRED=False, SWIGLU=False, ROW_WEIGHT=False,
            HAS_BIAS=bias is not None, USE_ASM=use_asm, TE=op_order == "te", GDC_SIGNAL=False, GDC_WAIT=False,
            COMBINE=False, **cfg)
    return out


def launch_w4a4_pairs(x: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, *, pair_expert: torch.Tensor, topk: int,
                      config: dict, swiglu: bool = False, row_weight: torch.Tensor | None = None,
                      op_order: str = "vllm", combined: torch.Tensor | None = None, signal: bool = False,
                      wait: bool = False, use_asm: bool = not triton_quant.INTERPRET) -> torch.Tensor:
    """MoE decode GEMV, one launch: out[p] = linear of x[p // topk] (quantized per token inside the
    launch) with expert pair_expert[p] of w [E, W_ROWS, K] (global_scale [E] or [E, W_ROWS]).

    x [T, K] float (unit column stride); out [P, N], P = T * topk; pair_expert int32 [P].
    swiglu: W_ROWS = 2N (gate rows, then up rows), out = silu(gate) * up. row_weight fp32 [P]
    multiplies each output row (the router weight). op_order: the per-token quantizer's ("vllm" or
    "te"). config: `gemv_config`'s, programs counted over all pairs (`triton_moe._moe_pairs` picks it).
    Split-K partial sums are added in a fixed order. combined [P / G, N] (x's dtype or fp32; out must be
    fp32): also each G = P / combined.shape[0] consecutive rows of out added in order in fp32, rounded once
    (a token's top-k pairs, as `triton_moe.combine` with weighted=False would, in the launch). Programmatic
    dependent launch (CUDA only): signal lets the next launch start early; wait launches this one so, its
    weights prefetched while the launch before ends (that launch must be the producer of x; pair_expert and
    row_weight older than it)."""
    p, n = out.shape
    e, w_rows, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] * topk != p or x.stride(-1) != 1:
        raise ValueError(f"x must be [P / topk, {k}] with unit column stride, got {tuple(x.shape)} for P={p}, topk={topk}")
    if w_rows != (2 * n if swiglu else n) or not w.codes.is_contiguous():
        raise ValueError(f"w must be contiguous [E, {2 * n if swiglu else n}, K], got {tuple(w.shape)}")
    groups = 0 if combined is None else combined.shape[0]
    group = p // groups if groups else 1
    if combined is not None and (out.dtype != torch.float32 or combined.shape != (groups, n) or groups * group != p):
        raise ValueError(f"combined must be [P / G, {n}] beside an fp32 out, got {tuple(combined.shape)} for P={p}")
    cfg = dict(config)
    split_k = cfg["SPLIT_K"]
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    ws = cnt = None
    if split_k > 1 or combined is not None:         # planes for split-K only; tickets: the pairs', the groups'
        ws, cnt = _workspace(out.device, (2 if swiglu else 1) * split_k * p * n if split_k > 1 else 0,
                             (p + groups) * n_tiles)
    gse, gsn = _gs_strides(w.global_scale, 3)
    if p and n:
        _w4a4_gemv_kernel[(n_tiles, split_k, p)](
            x, x.stride(0), None, 0, None, None, None, 0,
            w.codes.view(torch.int64), w.block_scales, w.global_scale, gse, gsn, w_rows, pair_expert, topk,
            out, row_weight, None, ws, cnt, combined, group, p, n, k, FUSED=True, GIVEN_AMAX=False, PER_TENSOR=False,
            PAIRED=True, SWIGLU=swiglu, ROW_WEIGHT=row_weight is not None, HAS_BIAS=False, USE_ASM=use_asm,
            TE=op_order == "te", GDC_SIGNAL=signal, GDC_WAIT=wait, COMBINE=combined is not None, **cfg,
            **({"launch_pdl": True} if wait else {}))
    return out
