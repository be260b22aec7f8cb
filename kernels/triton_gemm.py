"""W4A4 NVFP4 linear for CUDA GPUs without FP4 tensor cores (Triton; written for Hopper sm_90): the
packed tensor-core kernel, the large-M exact-BF16 path, and `linear` / `linear_path`, the dispatcher
over all paths.

    linear(x [..., K] float, w [N, K] NVFP4) -> [..., N]        picks a path by `linear_path`
    launch_w4a4(a [Ma, K] NVFP4, w [N, K] or [E, W_ROWS, K] NVFP4, out [R, N])   the packed kernel
    launch_exact(a exact fp16 rows [M, K], w [N, K] or [E, N, K] NVFP4, out [M, N])   the exact GEMM
    dequantize_exact(w [..., K] NVFP4) -> exact BF16 / FP16 [..., K]

Exact emulation: e2m1(q) * float(s) has at most 6 significant bits, so it is exact in FP16 (and
BF16); the tensor cores multiply those exactly and accumulate in FP32; the FP32 second-level
scales (per token for activations, per output row for weights) are applied in the epilogue, in
the reference's order ((acc * S_dec_a) * S_dec_w) + bias. Results differ from `reference.nvfp4_gemm`
only by the order of the FP32 additions.

Four paths, chosen by `linear_path(m, ...)`, and a fifth forced one:
  "mma"     (2 <= M <= 64, per token, bf16/fp16; M = 1 too for "mma_tiled" weights)  `cuda_mma`: CUDA
            C++ on FP16 tensor cores (mma.sync) over the codes (ModelOpt or "mma_tiled" layout) and exact
            FP16 activations; batch-invariant.
  "gemv"    (M = 1, or M <= GEMV_MAX_M without mma)  `triton_gemv`: exact block dots on packed FP16
            units over the 4-bit codes read as int64 blocks, the activation quantized in the launch.
  "packed"  (M <= PACKED_MAX_M)  `_w4a4_kernel`: an inline-PTX `prmt` table decode, then tensor
            cores (tl.dot FP16 x FP16 -> FP32) as W @ A^T so the big operand is the MMA's register operand.
            Split-K partial sums go to one FP32 plane per K-slice; the last program of a tile
            (atomic counter) adds the planes in a fixed order (bitwise deterministic) and applies the
            epilogue (`triton_gemv._finish_tile`), so a call is one launch after the activation quantization.
  "bf16"    (larger M)  the activation is quantized into exact BF16 values (one fused pass), the
            weight is decoded into a transient exact BF16 copy (no persistent cache: memory stays at
            0.28x BF16), cuBLAS multiplies with an FP32 output (`torch.mm(..., out_dtype=float32)`),
            and one Triton pass applies the scales and the bias. "mma_tiled" weights take this path beyond
            MMA_MAX_M, decoded by `cuda_mma.dequantize`.
  "exact"   (forced only until measured) the same exact operands in FP16, multiplied by `launch_exact`'s
            Triton tensor-core GEMM with the scales and bias in its epilogue: no FP32 [M, N] round trip
            (8B gate_up at M = 4096: 0.8 GB written and read again). The MoE's "exact" path runs the
            same kernel over expert tiles.
The packed kernel also serves the MoE grouped GEMM (`kernels.triton_moe`): tiles map to experts through
device-side metadata, activation rows are gathered by index, and the epilogue can fuse SwiGLU and
the router weight.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nvfp4_sampler.sampler_format import ACTIVATION_SCALINGS

from . import cuda_mma, switches, triton_gemv, triton_quant
from .format import NVFP4Tensor

PACKED_MAX_M = 64
GEMV_MAX_M = 4           # the dispatcher's gemv path; the kernel itself serves M <= triton_gemv.GEMV_KERNEL_MAX_M
_MMA_DTYPES = (torch.bfloat16, torch.float16)
# "mma_tiled" weights take the exact Triton GEMM (`exact_small_config`, codes decoded in it) instead of
# `cuda_mma` from this many tokens to MMA_MAX_M; 0: never (the default until the H200 says otherwise: at
# M = 64 on ModelOpt codes it took 26.2 / 22.4 / 63.3 / 42.5 us on the 8B qkv / o / gate_up / down shapes
# where the engines' cuda_mma linear took 32.5 / 23.5 / 73.6 / 67.2, seventh session; tiled codes not yet
# measured). Read at import from NVFP4_SAMPLER_EXACT_MIN_M like cuda_mma's variants, so that a benchmark
# can run whole engines on it (the e2e bench's --exact); not a user setting
EXACT_MIN_M = switches.count("NVFP4_SAMPLER_EXACT_MIN_M", 0, cuda_mma.MMA_MAX_M)


@functools.lru_cache(maxsize=None)
def _mma_supported(device: torch.device) -> bool:
    """cuda_mma can run on this device: probed and prepared once per device (`cuda_mma.prepare`),
    at load time through `dispatch.TritonHopperBackend.prepare`."""
    return cuda_mma.prepare(device)[0]


def _nibble_decode_ptx(shift: int) -> str:
    """PTX for `tl.inline_asm_elementwise(..., "=r,=r,r", pack=4)`: 4 code bytes in $2 -> the fp16
    values e2m1(nibble) of bytes 0, 1 in $0 and of bytes 2, 3 in $1; high nibbles (shift 0) or low
    nibbles (shift 4: moved up to the high nibble's bits first). `prmt` looks each magnitude (3 bits)
    up in an 8-entry table of fp16 high bytes (low bytes are zero); the sign bit goes to fp16 bit 15."""
    def pair(dst: str, sel: str, order: str) -> str:
        sign_up = f"shl.b32 w, w, {shift};\n" if shift else ""
        return (f"{sel}prmt.b32 t, tlo, thi, sel;\nprmt.b32 w, $2, z, {order};\n"
                f"{sign_up}and.b32 w, w, 0x80008000;\nor.b32 {dst}, t, w;\n")
    sel01 = f"shl.b32 sel, $2, {shift};\nand.b32 sel, sel, 0x7070;\n" if shift else "and.b32 sel, $2, 0x7070;\n"
    sel23 = f"shr.b32 sel, $2, {16 - shift};\nand.b32 sel, sel, 0x7070;\n"
    # table: fp16 high bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (tlo) | 2, 3, 4, 6 (thi)
    return ("{\n.reg .b32 sel, t, w, tlo, thi, z;\nmov.b32 tlo, 0x3E3C3800;\nmov.b32 thi, 0x46444240;\n"
            "mov.b32 z, 0;\n" + pair("$0", sel01, "0x1404") + pair("$1", sel23, "0x3424") + "}")


_DECODE_LO = tl.constexpr(_nibble_decode_ptx(4))
_DECODE_HI = tl.constexpr(_nibble_decode_ptx(0))


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


# The exact GEMM's weight decode (ModelOpt codes): each code byte becomes one FP16x2 register, its (low, high)
# nibbles in element order as the MMA's register operand holds them, e2m1 * s * 2^-14 (exact: multiples of 2^-24
# below 0.17), and the epilogue multiplies the FP32 sum by 2^14 (exact: every product and partial sum scaled by
# the same power of two gives the same bits, as `cuda_mma`'s weights). With q the code word rotated right by 4,
# one `prmt` gathers for byte b_j: b_j (low magnitude at bits 0-2), the sign of its low nibble (the top bit of
# q's byte j - 1, replicated over byte 1), q's byte j (high magnitude at bits 16-18) and the sign of b_j's high
# nibble (replicated over byte 3); a shift puts the magnitudes at FP16 bits 9-11 and 25-27 and two masks keep
# them and the signs at 15 and 31. Then one packed multiply by the block scale (s, s): 4 integer-pipe
# instructions a register (the two-table decode's outputs needed 2 `prmt` more a register to pair up).
def _pairs_decode_ptx() -> str:
    """PTX for `tl.inline_asm_elementwise(..., "=r,=r,=r,=r,r,r,r,r,r", pack=4)`: 4 code bytes in $4, the
    duplicated FP16 bits of their block scales in $5-$8 -> the FP16x2 pairs of bytes 0-3 in $0-$3."""
    def sel(j: int) -> int:
        return j | (8 | 4 + (j + 3) % 4) << 4 | (4 + j) << 8 | (8 | j) << 12
    body = "".join(f"prmt.b32 y, $4, q, {sel(j):#x};\nshl.b32 m, y, 9;\nand.b32 m, m, 0x0E000E00;\n"
                   f"and.b32 y, y, 0x80008000;\nor.b32 m, m, y;\nmul.rn.f16x2 ${j}, m, ${5 + j};\n" for j in range(4))
    return "{\n.reg .b32 q, y, m;\nshf.r.wrap.b32 q, $4, $4, 4;\n" + body + "}"


_DECODE_PAIRS = tl.constexpr(_pairs_decode_ptx())
# FP16 scales, two a register -> each one's bits in both halves of a register
_DUP_HALVES = tl.constexpr("prmt.b32 $0, $2, 0, 0x1010;\nprmt.b32 $1, $2, 0, 0x3232;")


@triton.jit
def _decode_pairs(packed, scales, USE_ASM: tl.constexpr):
    """Packed codes uint8 [R, KH] and their e4m3 scales [R, KH/8] -> fp16 [R, 2 KH] in element order,
    e2m1 * s * 2^-14 (exact; see `_pairs_decode_ptx`). USE_ASM: the PTX, else `_e2m1_fp16`'s portable
    decode times 2^-14 and s in fp16 (same values)."""
    R: tl.constexpr = packed.shape[0]
    KH: tl.constexpr = packed.shape[1]
    s = scales.to(tl.float16)
    if USE_ASM:
        dup = tl.inline_asm_elementwise(_DUP_HALVES, "=r,=r,r", [s], dtype=tl.int32, is_pure=True, pack=2)
        dup = tl.reshape(tl.broadcast_to(dup[:, :, None], (R, KH // 8, 8)), (R, KH))
        pairs = tl.inline_asm_elementwise(_DECODE_PAIRS, "=r,=r,=r,=r,r,r,r,r,r", [packed, dup], dtype=tl.int32,
                                          is_pure=True, pack=4)
        lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        b = packed.to(tl.int32)
        sb = tl.reshape(tl.broadcast_to(s[:, :, None], (R, KH // 8, 8)), (R, KH))
        lo = (_e2m1_fp16(b & 15) * 2.0 ** -14) * sb
        hi = (_e2m1_fp16(b >> 4) * 2.0 ** -14) * sb
    return tl.reshape(tl.join(lo, hi), (R, 2 * KH))


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


@triton.jit(do_not_specialize=['R'])   # counts of tokens: one compilation for all
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
        triton_gemv._finish_tile(acc, acc_u, a_g, rows, rmask, cols, cmask, e, pid_m * tl.num_programs(1) + pid_n,
                                 pid_k, R * N, ws, counters, out, w_gs, stride_gs_e, stride_gs_n, row_weight, bias,
                                 N, SPLIT_K, SWIGLU, ROW_WEIGHT, HAS_BIAS)


@triton.jit
def _dequant_exact_kernel(codes, scales, out, ROWS, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_ASM: tl.constexpr):
    """codes uint8 [ROWS, K/2], scales e4m3 [ROWS, K/16] -> out bf16/fp16 [ROWS, K] = e2m1 * s (exact).
    USE_ASM: the decode's PTX table (GPU) or portable arithmetic (the interpreter; same values)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    kb = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    r64 = r.to(tl.int64)
    rmask = r < ROWS
    c = tl.load(codes + r64[:, None] * (K // 2) + kh[None, :], mask=rmask[:, None] & (kh < K // 2)[None, :], other=0)
    s = tl.load(scales + r64[:, None] * (K // 16) + kb[None, :], mask=rmask[:, None] & (kb < K // 16)[None, :], other=0.0)
    lo, hi = _decode(c, s, USE_ASM)
    vals = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_K))
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out + r64[:, None] * K + kk[None, :], vals.to(out.dtype.element_ty),
             mask=rmask[:, None] & (kk < K)[None, :])


@triton.jit(do_not_specialize=['M'])   # counts of tokens: one compilation for all
def _scale_epilogue_kernel(acc, a_gs, w_gs, stride_w_gs, bias, out, stride_out, M, N,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [M, N] (rows stride_out apart) = (acc * a_gs[m]) * w_gs[n] (+ bias[n]) from the FP32 product
    acc [M, N] (contiguous)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m < M)[:, None] & (n < N)[None, :]
    v = tl.load(acc + m.to(tl.int64)[:, None] * N + n[None, :], mask=mask, other=0.0)
    v = v * tl.load(a_gs + m, mask=m < M, other=0.0)[:, None] * tl.load(w_gs + n * stride_w_gs, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m.to(tl.int64)[:, None] * stride_out + n[None, :], v.to(out.dtype.element_ty), mask=mask)


def scale_epilogue(acc: torch.Tensor, a_gs: torch.Tensor, w_gs: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor) -> torch.Tensor:
    """out [M, N] (rows may be strided: a column block of a wider output) = (acc * a_gs[:, None]) *
    w_gs (+ bias), rounded once, from the FP32 product acc [M, N] (contiguous); a_gs fp32 [M], w_gs fp32
    [] or [N], bias [N] or None."""
    m, n = acc.shape
    _scale_epilogue_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 128))](
        acc, a_gs, w_gs, 0 if w_gs.dim() == 0 else w_gs.stride(0), bias, out, out.stride(0), m, n,
        HAS_BIAS=bias is not None, BLOCK_M=64, BLOCK_N=128, num_warps=8)
    return out


EXACT_DENSE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, W_CODES=False, INTERLEAVE=False,
                   num_warps=8, num_stages=3)
EXACT_GROUPED = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=0, SPLIT_K=1, W_CODES=False, INTERLEAVE=False,
                     num_warps=8, num_stages=3)


@triton.jit
def _exact_weight_tile(w, w_scales, wrow, cmask, k0, K, W_CODES: tl.constexpr, USE_ASM: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Rows wrow [BLOCK_N] (int64), elements [k0, k0 + BLOCK_K) of the unscaled weight as exact fp16
    [BLOCK_N, BLOCK_K]: loaded from the fp16 copy (W_CODES 0), or decoded from the codes and e4m3 scales,
    ModelOpt (1) or "mma_tiled" (2, `_tiled_weight_tile`)."""
    if W_CODES == 2:
        tile = _tiled_weight_tile(w, w_scales, wrow, cmask, k0, K, BLOCK_K)
    elif W_CODES == 1:
        c = tl.load(w + wrow[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :], mask=cmask[:, None],
                    other=0)
        s = tl.load(w_scales + wrow[:, None] * tl.multiple_of(K // 16, 4) + (k0 // 16 + tl.arange(0, BLOCK_K // 16))[None, :],
                    mask=cmask[:, None], other=0.0)           # a row's scales: whole 4-byte words (one cp.async)
        tile = _decode_pairs(c, s, USE_ASM)                     # times 2^-14: the epilogue's 2^14
    else:
        tile = tl.load(w + wrow[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=cmask[:, None], other=0.0)
    return tile


@triton.jit
def _fp16_halves(p):
    """uint32 pairs -> (low, high) fp16 halves."""
    return ((p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
            (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def _tiled_weight_tile(w, w_scales, wrow, cmask, k0, K, BLOCK_K: tl.constexpr):
    """`_exact_weight_tile` of a "mma_tiled" weight (`cuda_mma.tile_weight`; k0 and BLOCK_K multiples of
    128): a row's 64 code bytes and 8 scale bytes of a 128-element chunk lie together (unit (row tile,
    chunk, half, g) of the tiled order), its 16 words in element order, each word's codes at
    `cuda_mma._TILED_BITS`, turned into FP16 pairs (e3, e7), (e2, e6), (e1, e5), (e0, e4) * 2^-14 by the
    CUDA kernel's `pairs` arithmetic, then rescaled by 2^14 and the block scale (both exact)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, WORDS)
    chunk = k0 // 128 + j // 16
    r = wrow[:, None]
    unit = (((r // 16) * (K // 128) + chunk[None, :]) * 2 + (r % 16) // 8) * 8 + r % 8
    x = tl.load(w.to(tl.pointer_type(tl.uint32)) + unit * 16 + (j % 16)[None, :], mask=cmask[:, None], other=0)
    s = tl.load(w_scales + unit * 8 + ((j % 16) // 2)[None, :], mask=cmask[:, None], other=0.0).to(tl.float16)
    mask = tl.full((), 0x8E008E00, tl.uint32)
    l3, h3 = _fp16_halves(((x & 0x20072007) * 516) & mask)        # (e0, e4)
    l2, h2 = _fp16_halves(((x & 0x40384038) * 66) & mask)         # (e1, e5)
    l1, h1 = _fp16_halves((x << 3) & mask)                        # (e2, e6)
    l0, h0 = _fp16_halves(x & mask)                               # (e3, e7)
    # [R, WORDS, a, b, c] = element 4a + 2b + c of each word (the last join is the fastest index)
    even = tl.join(tl.join(l3, h3), tl.join(l1, h1))
    odd = tl.join(tl.join(l2, h2), tl.join(l0, h0))
    vals = tl.join(even, odd) * 16384.0
    return tl.reshape(vals * s[:, :, None, None, None], (wrow.shape[0], BLOCK_K))


@triton.jit(do_not_specialize=['Z', 'M'])   # counts of tokens: one compilation for all
def _exact_gemm_kernel(a, a_gs, a_index, w, w_scales, w_gs, stride_gs_e, stride_gs_n, bias, out, ws, counters, sched,
                       Z, M, N, K, GROUPED: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, A_INDEX: tl.constexpr,
                       W_CODES: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, INTERLEAVE: tl.constexpr):
    """out [M, N] = ((a @ w[e].T) * a_gs[m]) * w_gs[e, n] (+ bias[n]), one rounding to out's dtype.

    a: exact fp16 rows [M, K], or (A_INDEX) output row m reads row a_index[m] of a (and of a_gs).
    w: the unscaled weights [E, W_ROWS, K] (E = 1 dense) as exact fp16 values,
    or (W_CODES) as packed codes uint8 [E, W_ROWS, K/2] with e4m3 w_scales [E, W_ROWS, K/16] (1: ModelOpt;
    2: a dense "mma_tiled" weight), decoded in registers each K step. W_ROWS = N, or 2N with SWIGLU (gate
    rows, then up rows: the program also accumulates the up rows of its columns and stores silu(gate) * up,
    `triton_quant.swiglu`; INTERLEAVE: its gate and up rows in one weight tile of 2 BLOCK_N rows, each 16 of them
    8 gate rows and their 8 up rows, one accumulator: the MMA holds rows r and r + 8 in one thread, so the split
    moves nothing, and a K step decodes the same weight bytes for half the accumulator registers, which leaves
    room for 256-row tiles). The products are exact, accumulated in fp32 on the tensor cores as w @ a.T (the
    weight tile is the MMA's first operand). Grid (output tiles, SPLIT_K): the Z row tiles GROUP_M at a time
    per column sweep (L2 reuse of both operands; 0: column tile major, all Z per column tile); the order
    changes no bit. Dense (GROUPED False): Z = cdiv(M, BLOCK_M) row tiles; SPLIT_K K-slices, their fp32
    partial planes in ws added in slice order by the tile's last program (`triton_gemv._finish_tile`,
    counters: one per output tile, zero). Grouped: the Z tiles of `sched` ([3, Z] int32: expert, first
    row, end row; rows sorted by expert, so a group's tiles share experts), SPLIT_K 1."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GROUP_M == 0:                                   # column tile major: every row tile per column tile
        tile = pid % Z
        pid_n = pid // Z
    else:                                              # GROUP_M row tiles at a time per column sweep
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first = (pid // per_group) * GROUP_M
        rows_in_group = tl.minimum(Z - first, GROUP_M)
        tile = first + (pid % per_group) % rows_in_group
        pid_n = (pid % per_group) // rows_in_group
    if GROUPED:
        e = tl.load(sched + tile)
        r0 = tl.load(sched + Z + tile)
        r1 = tl.load(sched + 2 * Z + tile)
        if r0 >= r1:                                   # an unused tile of the schedule
            return
    else:
        e = tl.full((), 0, tl.int32)
        r0 = tile * BLOCK_M
        r1 = M
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < r1
    src = tl.load(a_index + rows, mask=rmask, other=0) if A_INDEX else rows      # the rows of a read
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    wrow = e.to(tl.int64) * (2 * N if SWIGLU else N) + cols
    if INTERLEAVE:                                     # tile row t: column 8 (t // 16) + t % 8, gate or up (t % 16 >= 8)
        t = tl.arange(0, 2 * BLOCK_N)
        tcol = pid_n * BLOCK_N + (t // 16) * 8 + t % 8
        tmask = tcol < N
        trow = e.to(tl.int64) * 2 * N + tcol + tl.where(t % 16 >= 8, N, 0)
    else:
        tmask = cmask
        trow = wrow
    a_row = a + src.to(tl.int64)[:, None] * K
    k_per = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    TILE_ROWS: tl.constexpr = 2 * BLOCK_N if INTERLEAVE else BLOCK_N
    acc = tl.zeros((TILE_ROWS, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):              # K % BLOCK_K == 0: no mask along K
        a_t = tl.trans(tl.load(a_row + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=rmask[:, None], other=0.0))
        acc = tl.dot(_exact_weight_tile(w, w_scales, trow, tmask, k0, K, W_CODES, USE_ASM, BLOCK_K), a_t, acc)
        if SWIGLU and not INTERLEAVE:
            acc_u = tl.dot(_exact_weight_tile(w, w_scales, wrow + N, cmask, k0, K, W_CODES, USE_ASM, BLOCK_K), a_t,
                           acc_u)
    if INTERLEAVE:
        acc, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 8, 2, 8, BLOCK_M)), (0, 2, 3, 1)))
        acc = tl.reshape(acc, (BLOCK_N, BLOCK_M))
        acc_u = tl.reshape(acc_u, (BLOCK_N, BLOCK_M))
    if W_CODES == 1:                                   # `_decode_pairs`' weights are the values * 2^-14
        acc = acc * 16384.0
        acc_u = acc_u * 16384.0
    a_g = tl.load(a_gs + src, mask=rmask, other=0.0)
    triton_gemv._finish_tile(acc, acc_u, a_g, rows, rmask, cols, cmask, e, pid, pid_k, M * N, ws, counters, out, w_gs,
                             stride_gs_e, stride_gs_n, None, bias, N, SPLIT_K, SWIGLU, False, HAS_BIAS)


def exact_small_config(m: int, n: int, k: int, *, block_n: int = 64, block_k: int = 128, num_warps: int | None = None,
                       num_stages: int = 4, min_programs: int = 264) -> dict:
    """`launch_exact`'s configuration at decode sizes (m <= 64, the Triton wgmma route): the tokens as the
    MMA's N (BLOCK_M = m rounded up to 16..64), the codes decoded in the kernel, split-K from the weight
    shape alone (doubled while the column tiles times the slices stay under `min_programs` and each
    slice keeps >= 2 K steps), so no output's summation order depends on m. num_warps: 4, or 8 above 32
    tokens (with 4 the 64-token tile spills: 255 registers, sm_90a, Triton 3.9)."""
    num_warps = num_warps or (4 if m <= 32 else 8)
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split < min_programs and k // (block_k * split * 2) >= 2:
        split *= 2
    return dict(EXACT_DENSE, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                SPLIT_K=split, W_CODES=True, num_warps=num_warps, num_stages=num_stages)


def launch_exact(a: triton_quant.ExactRows, w: NVFP4Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                 schedule: torch.Tensor | None = None, swiglu: bool = False, config: dict | None = None,
                 a_index: torch.Tensor | None = None, use_asm: bool = not triton_quant.INTERPRET) -> None:
    """`_exact_gemm_kernel`: exact fp16 rows a [M, K] (`triton_quant.quantize_per_token_exact(...,
    dtype=float16)`) against w [N, K] (dense; global_scale [] or [N]) or stacked experts w [E, N, K]
    with `schedule` ([3, Z] int32 from `triton_moe.schedule_rows`; global_scale [E] or [E, N]) into
    out [M, N] (fp32 or the activation dtype). The weights are dequantized to exact FP16 for the call (no
    second-level scale, no cache), or with config W_CODES decoded inside the GEMM (ModelOpt layout, or
    "mma_tiled" for dense weights with BLOCK_K % 128 == 0).
    swiglu: w has 2N rows (gate, then up; per expert) and out = silu(gate) * up (the MoE's w13).
    a_index: int32/int64 [M] on a's device: out row m is computed from row a_index[m] of a (the MoE's tokens
    quantized once each, read per (token, expert) pair: no gathered copy of the rows is written)
    config: EXACT_DENSE / EXACT_GROUPED by default (a benchmark override); its INTERLEAVE applies to swiglu
    launches only (gate and up rows 8 by 8 in one tile; the same bits). use_asm: the decodes' PTX (GPU default)
    or portable arithmetic (same values; the interpreter)."""
    grouped = schedule is not None
    if grouped != (w.codes.dim() == 3):
        raise ValueError(f"a schedule goes with stacked experts [E, N, K], got {tuple(w.shape)}, schedule "
                         f"{'given' if grouped else 'missing'}")
    cfg = dict(config or (EXACT_GROUPED if grouped else EXACT_DENSE))
    n, k = w.shape[-2:]
    n //= 2 if swiglu else 1
    if out.shape[-1] != n:
        raise ValueError(f"out has {out.shape[-1]} columns, the weight gives {n} (swiglu={swiglu})")
    if k % cfg["BLOCK_K"]:
        raise ValueError(f"the exact GEMM needs K % {cfg['BLOCK_K']} == 0, got K={k}")
    if cfg["W_CODES"]:                                 # the codes' layout: ModelOpt (1) or "mma_tiled" (2)
        cfg["W_CODES"] = 2 if w.layout == "mma_tiled" else 1
        if cfg["W_CODES"] == 2 and (grouped or cfg["BLOCK_K"] % 128):
            raise ValueError(f"the exact GEMM decodes mma_tiled codes of dense weights in whole 128-element chunks, "
                             f"got BLOCK_K={cfg['BLOCK_K']}{', grouped' if grouped else ''}")
    cfg["INTERLEAVE"] = bool(cfg.get("INTERLEAVE")) and swiglu         # a SwiGLU launch's tile form only
    if cfg["INTERLEAVE"] and cfg["BLOCK_N"] % 8:
        raise ValueError(f"interleaved gate and up rows go 8 by 8, got BLOCK_N={cfg['BLOCK_N']}")
    if grouped and cfg["SPLIT_K"] != 1:
        raise ValueError("the grouped exact GEMM runs without split-K")
    if a_index is not None and (a_index.shape != (out.shape[0],) or a_index.dtype not in (torch.int32, torch.int64)
                                or a_index.device != out.device):
        raise ValueError(f"a_index must be int32/int64 [{out.shape[0]}] on {out.device}, got {a_index.dtype} "
                         f"{tuple(a_index.shape)} on {a_index.device}")
    m = out.shape[0] if a_index is not None else a.values.shape[0]
    z = schedule.shape[1] if grouped else triton.cdiv(m, cfg["BLOCK_M"])
    if m == 0 or z == 0:
        return
    tiles = z * triton.cdiv(n, cfg["BLOCK_N"])
    ws = cnt = None
    if cfg["SPLIT_K"] > 1:
        ws, cnt = triton_gemv._workspace(out.device, cfg["SPLIT_K"] * m * n, tiles)
    weight = (w.codes, w.block_scales) if cfg["W_CODES"] else (dequantize_exact(w, torch.float16), None)
    gse, gsn = triton_gemv._gs_strides(w.global_scale, w.codes.dim())
    _exact_gemm_kernel[(tiles, cfg["SPLIT_K"])](
        a.values, a.global_scale, a_index, *weight, w.global_scale, gse, gsn, bias, out, ws, cnt, schedule, z, m, n,
        k, GROUPED=grouped, SWIGLU=swiglu, HAS_BIAS=bias is not None, A_INDEX=a_index is not None, USE_ASM=use_asm,
        **cfg)


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
        ws, cnt = triton_gemv._workspace(out.device, cfg["SPLIT_K"] * r * n, n_tiles_m * n_tiles_n)
    gse, gsn = triton_gemv._gs_strides(w.global_scale, w.codes.dim())
    grid = (n_tiles_m, n_tiles_n, cfg["SPLIT_K"])
    if r and n:
        _w4a4_kernel[grid](
            a.codes, a.block_scales, a.global_scale, 0 if a.global_scale.dim() == 0 else a.global_scale.stride(0),
            a_index, w.codes, w.block_scales, w.global_scale, gse, gsn, w_rows,
            out, row_weight, bias, tile_expert, tile_start, tile_end, ws, cnt,
            r, n, k, GROUPED=schedule is not None, GATHER=a_index is not None, SWIGLU=swiglu,
            ROW_WEIGHT=row_weight is not None, HAS_BIAS=bias is not None, USE_ASM=use_asm, **cfg)
    return out


# `dequantize_exact`'s launch (H100, twenty-ninth session, 30B-A3B w13 to FP16, us: 16 x 512, 4 warps 381, portable
# decode 447; 8 x 1024 370; 32 x 512, 8 warps 381; 64 x 256 407)
DEQUANT = dict(BLOCK_R=8, BLOCK_K=1024, num_warps=4)


def dequantize_exact(w: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     use_asm: bool = not triton_quant.INTERPRET) -> torch.Tensor:
    """e2m1(q) * float(s) of w [..., K] as exact BF16 or FP16 [..., K] (second-level scale not applied:
    every such product, 2^-10 .. 2688 with <= 6 significant bits, is exact in both). use_asm: the
    decode's PTX table or portable arithmetic (same values)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
    if w.layout == "mma_tiled":
        return cuda_mma.dequantize(w).to(dtype)
    cfg = dict(DEQUANT)
    k = w.shape[-1]
    codes = w.codes.reshape(-1, k // 2)
    out = torch.empty((codes.shape[0], k), dtype=dtype, device=codes.device)
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], triton.next_power_of_2(k))
    if codes.numel():
        _dequant_exact_kernel[(triton.cdiv(codes.shape[0], cfg["BLOCK_R"]), triton.cdiv(k, cfg["BLOCK_K"]))](
            codes, w.block_scales.reshape(-1, k // 16), out, codes.shape[0], k, USE_ASM=use_asm, **cfg)
    return out.reshape(w.shape)


# The "bf16" path's FP32 product [M, N] is written by cuBLAS and read back by the scale epilogue: at 8B
# gate_up, M = 4096, ~0.8 GB of traffic beside the 0.2 GB BF16 output. In column blocks of at most this many
# bytes of FP32 (one buffer, reused) the product can stay in L2 between the two, and the transient buffer is
# 16 MiB instead of M x N x 4 bytes (400 MB there). H100, M = 4096, the four 8B linears (bench_kernels'
# bf16_blocks_ms, docs/BENCHMARKS.md twelfth session): one block 2798 us summed, 8 / 16 / 32 MiB 3108 / 2711 /
# 2724 us; 16 MiB no slower on any shape (gate_up 1465 -> 1379 us). None: one block.
BF16_BLOCK_BYTES: int | None = 16 << 20


def _linear_bf16(x2: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                 amax: torch.Tensor | None, op_order: str, block_bytes: int | None = BF16_BLOCK_BYTES) -> torch.Tensor:
    """cuBLAS on exact BF16 operands (FP32 out), then `scale_epilogue`, over column blocks of at most
    block_bytes of FP32 product (multiples of 128 columns; None: one block)."""
    a = triton_quant.quantize_per_token_exact(x2, amax=amax, op_order=op_order)
    w_bf = dequantize_exact(w)
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    cols = n if block_bytes is None else min(n, max(128, block_bytes // (4 * max(m, 1)) // 128 * 128))
    buf = torch.empty(m * cols, dtype=torch.float32, device=x2.device)
    gs = w.global_scale
    for n0 in range(0, n, cols):
        n1 = min(n, n0 + cols)
        acc = torch.mm(a.values, w_bf[n0:n1].t(), out_dtype=torch.float32, out=buf[:m * (n1 - n0)].view(m, n1 - n0))
        scale_epilogue(acc, a.global_scale, gs if gs.dim() == 0 else gs[n0:n1],
                       None if bias is None else bias[n0:n1], out[:, n0:n1])
    return out


def linear_path(m: int, scaling: str, w: NVFP4Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which GEMM path a linear with m rows of `dtype` and weight w takes: "mma" (MMA_MIN_M <= m <=
    MMA_MAX_M, per token, w on a device where `cuda_mma` runs and of its shape contract, bf16/fp16),
    "gemv", "packed" or "bf16". A "mma_tiled" w (per token only) takes "mma" for every m <= MMA_MAX_M
    (bf16/fp16; "exact" from EXACT_MIN_M tokens where set), else "bf16"."""
    if w is not None and w.layout == "mma_tiled":
        if m > cuda_mma.MMA_MAX_M or dtype not in _MMA_DTYPES:
            return "bf16"
        return "exact" if EXACT_MIN_M and m >= EXACT_MIN_M else "mma"
    if (cuda_mma.MMA_MIN_M <= m <= cuda_mma.MMA_MAX_M and scaling == "per_token" and w is not None
            and dtype in _MMA_DTYPES
            and w.codes.dim() == 2 and cuda_mma.shape_ok(*w.shape) and _mma_supported(w.codes.device)):
        return "mma"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "packed" if m <= PACKED_MAX_M or scaling == "per_tensor" else "bf16"


def _mma_options(m: int, w: NVFP4Tensor, batch_invariant: bool) -> dict:
    """`cuda_mma.launch` overrides of the mma path: none where batch invariance is asked for, else
    `cuda_mma.throughput_options` for this device."""
    dev = w.codes.device
    return {} if batch_invariant else cuda_mma.throughput_options(
        m, *w.shape, warpgroup=cuda_mma.has_wgmma(dev), slices=cuda_mma.small_slices(dev))


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None, scaling: str = "per_token",
           amax: torch.Tensor | None = None, op_order: str = "vllm", path: str | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """W4A4 linear on CUDA: x [..., K] float, w [N, K] NVFP4 (global_scale [] or [N]) -> [..., N]
    in x.dtype. scaling "per_token" (default) or "per_tensor". amax: optional activation amax
    override, fp32 [...] (= x.shape[:-1]) per token or [] per tensor (`reference.linear`).
    op_order: the activation quantizer's, "vllm" (the spec) or "te".
    path forces "mma" (per token, bf16/fp16, `cuda_mma.shape_ok`), "gemv" (M <=
    triton_gemv.GEMV_KERNEL_MAX_M), "packed", "bf16" or "exact" (per token only; "exact": `launch_exact`,
    the scales and bias fused, K % 64 == 0; at M <= MMA_MAX_M with K % 128 == 0 `exact_small_config`'s
    tiles, the codes decoded in the GEMM; forced only until measured); default `linear_path`.
    batch_invariant: the mma path keeps `cuda_mma.config`'s split-K at every M (strict mode) instead of
    `cuda_mma.throughput_options`' faster one from 9 tokens."""
    if w.codes.dim() != 2:
        raise ValueError(f"linear expects a weight [N, K], got shape {tuple(w.shape)}")
    if scaling not in ACTIVATION_SCALINGS:
        raise ValueError(f"scaling must be one of {ACTIVATION_SCALINGS}, got {scaling!r}")
    x2 = x.reshape(-1, x.shape[-1])
    if amax is not None and scaling == "per_token":
        if amax.shape != x.shape[:-1]:
            raise ValueError(f"amax: per-token amax must have shape {tuple(x.shape[:-1])}, got {tuple(amax.shape)}")
        amax = amax.reshape(-1)
    path = path or linear_path(x2.shape[0], scaling, w, x.dtype)
    if w.layout == "mma_tiled" and (path not in ("mma", "bf16", "exact") or scaling != "per_token"):
        raise ValueError(f"a mma_tiled weight takes the mma, bf16 or exact path with per-token scaling, got {path!r}, "
                         f"{scaling!r}")
    if path in ("mma", "bf16", "exact") and scaling != "per_token":
        raise ValueError(f"the {path} path implements per-token scaling only")
    if path == "mma" and cuda_mma.X_CODES:             # the activation's codes and scales, then the kernel
        q = triton_quant.quantize_per_token(x2, amax=amax, op_order=op_order)
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        cuda_mma.launch(q.codes, q.global_scale, w, out, bias=bias, x_scales=q.block_scales,
                        **_mma_options(x2.shape[0], w, batch_invariant))
    elif path in ("mma", "exact"):                     # exact FP16 rows, then the tensor-core kernel
        a = triton_quant.quantize_per_token_exact(x2, amax=amax, op_order=op_order, dtype=torch.float16)
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        if path == "mma":
            cuda_mma.launch(a.values, a.global_scale, w, out, bias=bias, **_mma_options(x2.shape[0], w, batch_invariant))
        else:
            small = x2.shape[0] <= cuda_mma.MMA_MAX_M and w.shape[-1] % 128 == 0    # decode sizes: codes decoded
            launch_exact(a, w, out, bias=bias, config=exact_small_config(x2.shape[0], *w.shape) if small else None)
    elif path == "bf16":
        out = _linear_bf16(x2, w, bias, x.dtype, amax, op_order)
    elif path == "gemv":
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        triton_gemv.launch_w4a4_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, out, bias=bias,
                                     scaling=scaling, amax=amax, op_order=op_order)
    elif path == "packed":
        if scaling == "per_token":
            a = triton_quant.quantize_per_token(x2, amax=amax, op_order=op_order)
        else:
            a = triton_quant.quantize_per_tensor(x2, amax=amax, op_order=op_order)
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        launch_w4a4(a, w, out, bias=bias)
    else:
        raise ValueError(f"path must be 'mma', 'gemv', 'packed', 'bf16' or 'exact', got {path!r}")
    return out.reshape(*x.shape[:-1], w.shape[0])
