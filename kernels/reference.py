"""Executable spec of NVFP4 per-token quantization in plain torch (CPU or GPU).

Every other implementation (Triton kernels, engine adapters, converters) is tested against these
functions. The float operations and their order follow vLLM's emulation reference
(`nvfp4_emulation_utils.ref_nvfp4_quant`) so that codes and scales agree bit for bit:

  S_enc  = 2688 / amax                      (fp32; amax == 0 -> 1; clamped to fp32 max)
  S_dec  = 1 / S_enc                        (fp32, the stored `global_scale`)
  s      = e4m3_rn_satfinite(S_enc * (block_amax * (1/6)))
  q      = e2m1_rn_satfinite(x * inv),  inv = min(1 / (float(s) * S_dec), fp32 max), 1/0 := 0
  x'     = e2m1(q) * float(s) * S_dec

All fp32, in this order. The fp32-max caps keep every intermediate finite, so no NaN can appear;
a block whose scale is 0 (all zeros, or underflowed) encodes as signed zeros.

`op_order="te"` (keyword on every quantizer) follows TransformerEngine's NVFP4 quantizer instead,
bit for bit, so a sampler can reproduce a TE learner's codes (docs/FORMAT.md section 7):
  per tensor / weights (1D, 2D)  S_enc = min(2688 / amax, FLT_MAX) (one rounding; 1 if amax == 0)
                                 s = e4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX))
                                 inv = min(1 / (float(s) * (1 / S_enc)), FLT_MAX)   (1/0 -> FLT_MAX)
  per token (row-scaled)         S_enc = min(2688 / max(amax_row, 1e-12), FLT_MAX), s as above,
                                 inv = min(S_enc / float(s), FLT_MAX), 0 where s == 0
(TE `common/cast/nvfp4/core_nvfp4.cuh` and `pytorch/custom_recipes/quantization_nvfp4_per_token.py`).
Non-finite input (NaN, +-Inf) raises ValueError: an amax of Inf or NaN would silently poison every
scale of the row or tensor. docs/FORMAT.md states the format and where vLLM, compressed-tensors and
TransformerEngine differ from it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from nvfp4_sampler.sampler_format import OP_ORDERS, WEIGHT_RECIPES

from .format import (BLOCK, E2M1_MAX, E2M1_VALUES, E4M3_MAX, GLOBAL_ENCODE_NUMERATOR, SWIZZLE_COLS,
                     SWIZZLE_ROWS, NVFP4Tensor)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLT_MAX = torch.finfo(torch.float32).max
_E2M1_MAX_INV = 1.0 / E2M1_MAX            # multiplied into fp32 tensors, so it acts as fp32(1/6)
# E2M1 round-to-nearest-even decision points on |x|: code c+1 starts at _THRESH[c];
# a tie goes to the even code, hence strict '>' above odd codes and '>=' above even ones.
_THRESH = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
NONFINITE_MESSAGE = "{name}: contains NaN or Inf; NVFP4 quantization needs finite input"


def _check_input(x: torch.Tensor, name: str, *, finite: bool = True) -> None:
    """dtype and K % 16 of a quantizer input; with finite=True also NaN/Inf (kernels.cpu_quant checks
    those from its block amax instead)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected one of {_FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}: last dim K={x.shape[-1] if x.dim() else None} must be a multiple of {BLOCK}")
    if finite and not torch.isfinite(x).all():
        raise ValueError(NONFINITE_MESSAGE.format(name=name))


_TE_ROW_AMAX_FLOOR = 1e-12      # TE's per-token kernel divides by fmaxf(row_amax, 1e-12f)


def _check_op_order(op_order: str) -> None:
    if op_order not in OP_ORDERS:
        raise ValueError(f"op_order must be one of {OP_ORDERS}, got {op_order!r}")


def _check_recipe(recipe: str) -> None:
    if recipe not in WEIGHT_RECIPES:
        raise ValueError(f"recipe must be one of {WEIGHT_RECIPES}, got {recipe!r}")


def encode_scale_from_amax(amax: torch.Tensor, *, op_order: str = "vllm") -> torch.Tensor:
    """S_enc in fp32 (amax == 0 -> 1, clamped to the fp32 max). Any shape.

    op_order "vllm": fp32(1 / amax) * 2688, two roundings, as torch evaluates `2688 / amax`
      (Tensor.__rtruediv__ = reciprocal * scalar), which is how vLLM's and compressed-tensors'
      references compute it. "te": one correctly rounded division 2688 / amax, as TransformerEngine's
      `compute_global_encode_scaling_factor_FP4`.
    """
    _check_op_order(op_order)
    amax = amax.float()
    if op_order == "te":
        s_enc = torch.full_like(amax, GLOBAL_ENCODE_NUMERATOR) / amax
    else:
        s_enc = torch.reciprocal(amax) * GLOBAL_ENCODE_NUMERATOR
    s_enc = torch.clamp(s_enc, max=_FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(s_enc), s_enc)


def decode_scale_from_amax(amax: torch.Tensor, *, op_order: str = "vllm") -> torch.Tensor:
    """S_dec = 1 / S_enc in fp32, the `global_scale` stored with codes. Any shape."""
    return 1.0 / encode_scale_from_amax(amax, op_order=op_order)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 values already in E2M1 range units -> uint8 codes in [0, 15] (unpacked).

    Round to nearest, ties to even, saturate at +-6; bit 3 is the sign bit of x (-0.1 -> 0x8).
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, inclusive in _THRESH:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] (unpacked) -> float32 values (bit 3 is the sign: 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table.index_select(0, codes.flatten().int()).view(codes.shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2] bytes, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] bytes -> uint8 [..., K] codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _quantize_blocks(x: torch.Tensor, block_amax: torch.Tensor, s_enc: torch.Tensor, *,
                     op_order: str = "vllm", per_row: bool = False) -> NVFP4Tensor:
    """x [..., K]; block_amax [..., K/16] fp32; s_enc fp32 whose shape is a prefix of x.shape[:-1].

    op_order/per_row pick the block-scale and element-scale formulas (module docstring)."""
    scale, inv = block_scales(block_amax, s_enc, op_order=op_order, per_row=per_row)
    xb = x.float().unflatten(-1, (-1, BLOCK))                                   # [..., K/16, 16]
    scaled = torch.clamp(xb * inv[..., None], -E2M1_MAX, E2M1_MAX)
    codes = pack_nibbles(e2m1_encode(scaled).flatten(-2))
    return NVFP4Tensor(codes, scale, (1.0 / s_enc.float()).contiguous())


def block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor, *, op_order: str = "vllm",
                 per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales and the fp32 element multipliers `inv`, both [..., K/16], from block_amax
    [..., K/16] fp32 and s_enc fp32 (shape a prefix of block_amax.shape[:-1])."""
    s_enc_b = s_enc.reshape(*s_enc.shape, *([1] * (block_amax.dim() - s_enc.dim())))    # [..., 1]
    if op_order == "te":
        scale = torch.clamp(block_amax * (s_enc_b * _E2M1_MAX_INV), max=_FLT_MAX)
    else:
        scale = s_enc_b * (block_amax * _E2M1_MAX_INV)                          # [..., K/16]
    scale = torch.clamp(scale, min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    if op_order == "te" and per_row:                                            # S_enc / s, 0 for s == 0
        inv = torch.where(scale.float() == 0, 0.0, torch.clamp(s_enc_b / scale.float(), max=_FLT_MAX))
    elif op_order == "te":                                                      # 1/0 := FLT_MAX
        inv = torch.clamp(1.0 / (scale.float() * (1.0 / s_enc_b)), max=_FLT_MAX)
    else:
        dec = scale.float() * (1.0 / s_enc_b)                                   # [..., K/16]
        inv = torch.where(dec == 0, 0.0, torch.clamp(1.0 / dec, max=_FLT_MAX))   # 1/0 := 0
    return scale, inv


def _block_amax_1d(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K/16], amax of each 1x16 block."""
    return x.abs().float().unflatten(-1, (-1, BLOCK)).amax(-1)


def _block_amax_2d(w: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] -> fp32 [..., N, K/16]: amax of the 16x16 tile each 1x16 block lies in.

    N need not be a multiple of 16: the last tile is padded with zeros (as TransformerEngine does).
    """
    return tile_amax_2d(_block_amax_1d(w))


def tile_amax_2d(a: torch.Tensor) -> torch.Tensor:
    """1x16 block amax [..., N, K/16] -> the amax of the 16x16 tile each block lies in (same shape)."""
    n = a.shape[-2]
    pad = (-n) % BLOCK
    if pad:
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], dim=-2)
    tiles = a.unflatten(-2, (-1, BLOCK)).amax(-2, keepdim=True)              # [..., N/16, 1, K/16]
    return tiles.expand(*tiles.shape[:-2], BLOCK, a.shape[-1]).flatten(-3, -2)[..., :n, :]


def quantize_per_token(x: torch.Tensor, *, row_amax: torch.Tensor | None = None,
                       op_order: str = "vllm") -> NVFP4Tensor:
    """Per-token NVFP4: x [..., K] float -> codes [..., K/2], scales [..., K/16], global_scale [...].

    Each row has its own S_dec = amax_row / 2688, so a row's codes do not depend on other rows.
    row_amax: optional fp32 [...] used instead of max|x| per row: the amax of the whole token row
      when x holds only a K-slice of it (a tensor-parallel rank of a row-parallel layer).
    op_order: "vllm" (default, the spec) or "te" (TransformerEngine's row-scaled quantizer).
    """
    _check_input(x, "x")
    _check_op_order(op_order)
    amax = x.abs().float().amax(-1) if row_amax is None else row_amax.float().reshape(x.shape[:-1])
    if op_order == "te":
        amax = amax.clamp(min=_TE_ROW_AMAX_FLOOR)
    return _quantize_blocks(x, _block_amax_1d(x), encode_scale_from_amax(amax, op_order=op_order),
                            op_order=op_order, per_row=True)


def quantize_per_tensor(x: torch.Tensor, *, amax: torch.Tensor | None = None, op_order: str = "vllm") -> NVFP4Tensor:
    """Per-tensor NVFP4: one S_dec for the whole tensor (global_scale shape []).

    amax: optional fp32 scalar (a calibrated or shared amax) used instead of max|x|.
    op_order: "vllm" (default, the spec) or "te" (TransformerEngine's quantizer).
    """
    _check_input(x, "x")
    _check_op_order(op_order)
    amax = x.abs().float().amax() if amax is None else amax.float().reshape(())
    return _quantize_blocks(x, _block_amax_1d(x), encode_scale_from_amax(amax, op_order=op_order), op_order=op_order)


def quantize_activations(x: torch.Tensor, *, scaling: str = "per_token",
                         amax: torch.Tensor | None = None, op_order: str = "vllm") -> NVFP4Tensor:
    """Quantize activations x [..., K] with scaling "per_token" (default) or "per_tensor".

    amax: optional second-level amax instead of the one x gives: fp32 [...] per token, [] per
    tensor (e.g. all-reduced over the tensor-parallel ranks that each hold a K-slice of x).
    op_order: "vllm" (default) or "te".
    """
    if scaling == "per_token":
        return quantize_per_token(x, row_amax=amax, op_order=op_order)
    if scaling == "per_tensor":
        return quantize_per_tensor(x, amax=amax, op_order=op_order)
    raise ValueError(f"scaling must be 'per_token' or 'per_tensor', got {scaling!r}")


def quantize_weight(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                    op_order: str = "vllm") -> NVFP4Tensor:
    """Quantize a weight [N, K] (global_scale []) or stacked experts [E, N, K] (global_scale [E]).

    recipe: "1d" (1x16 blocks) or "2d" (16x16 tiles, TransformerEngine's weight recipe: every tile
      shares one scale, so the transposed weight quantizes to the same values).
    amax: optional fp32 [] or [E] overriding max|w| (e.g. the max over a fused q/k/v group).
    op_order: "vllm" (default, the spec) or "te" (TransformerEngine's quantizer, bit for bit).
    """
    _check_input(w, "weight")
    _check_op_order(op_order)
    if w.dim() not in (2, 3):
        raise ValueError(f"weight must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    _check_recipe(recipe)
    block_amax = _block_amax_2d(w) if recipe == "2d" else _block_amax_1d(w)
    if amax is None:
        amax = w.abs().float().amax(dim=(-2, -1))
    s_enc = encode_scale_from_amax(amax, op_order=op_order)                   # [] or [E]
    return _quantize_blocks(w, block_amax, s_enc, op_order=op_order)


def weight_amax(w: torch.Tensor, share: int = 1) -> torch.Tensor:
    """max|w| as fp32: [] for a weight [N, K], [E / share] for stacked experts [E, N, K], one per `share`
    consecutive experts (1: the amax `quantize_weight` takes by default; 2: an expert's gate and up stored as
    two matrices with one scale). One read of w, no temporary; NaN and Inf propagate, so
    `torch.isfinite(weight_amax(w))` checks the whole weight without another pass."""
    if share < 1 or (w.shape[0] if w.dim() == 3 else 1) % share:
        raise ValueError(f"share (experts per amax) must divide the experts of {tuple(w.shape)}, got {share}")
    amax = torch.linalg.vector_norm(w, ord=float("inf"), dim=(-2, -1)).float()
    return amax if share == 1 else amax.view(-1, share).amax(1)


def quantize_weight_group(ws: list[torch.Tensor], *, recipe: str = "1d", op_order: str = "vllm") -> list[NVFP4Tensor]:
    """Quantize the shards of a fused group (q/k/v, gate/up: each [N_i, K], or experts [E, N_i, K])
    with ONE shared second-level scale: amax = max over the whole group (per expert when stacked),
    as learners that quantize a fused QKV / gate-up tensor do (Megatron + TE). Every returned
    tensor has the same global_scale; concatenated along N they equal quantizing the fused tensor
    with the 1d recipe (the 2d recipe tiles each shard on its own, as the shards are stored)."""
    if not ws or len({(w.dim(), w.shape[-1], *w.shape[:-2]) for w in ws}) != 1:
        raise ValueError(f"a fused group needs >= 1 shards of one K (and expert count), got "
                         f"{[tuple(w.shape) for w in ws]}")
    for i, w in enumerate(ws):
        _check_input(w, f"shard {i}")
    amax = torch.stack([weight_amax(w) for w in ws]).amax(0)
    return [quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order) for w in ws]


def dequantize(t: NVFP4Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Tensor -> dense [..., K] in dtype: e2m1(q) * float(s) * S_dec (computed in fp32)."""
    return (dequantize_unscaled(t) * t.row_global_scale()[..., None]).to(dtype)


def dequantize_unscaled(t: NVFP4Tensor) -> torch.Tensor:
    """e2m1(q) * float(s) as fp32 [..., K]: at most 6 significant bits, so exact in BF16 too."""
    vals = e2m1_decode(unpack_nibbles(t.codes)).unflatten(-1, (-1, BLOCK))
    return (vals * t.block_scales.float()[..., None]).flatten(-2)


def nvfp4_gemm(a: NVFP4Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, accumulate: str = "fp32") -> torch.Tensor:
    """out [M, N] = (deq(a) @ deq(w).T): a [M, K] (global_scale [M] or []), w [N, K] ([N] or []).

    The block products e2m1*e4m3 are exact (BF16-representable); accumulation is FP32 and the
    second-level scales are applied per row (a) and per column (w) in the epilogue.
    accumulate "fp64" (strict mode): the sum is taken in float64, where it is exact unless a row
    spans more than 2^53 between its smallest and largest product, then rounded once to fp32: a
    result that does not depend on the summation order, so a row gives the same bits alone or in
    any batch (decode and teacher-forced agree). "fp32" (default): the BLAS order, M-dependent.
    """
    if a.codes.dim() != 2 or w.codes.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"nvfp4_gemm expects a [M, K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    if accumulate == "fp64":
        acc = (dequantize_unscaled(a).double() @ dequantize_unscaled(w).double().T).float()
    elif accumulate == "fp32":
        acc = dequantize_unscaled(a) @ dequantize_unscaled(w).T                # [M, N] fp32
    else:
        raise ValueError(f"accumulate must be 'fp32' or 'fp64', got {accumulate!r}")
    out = acc * a.row_global_scale()[:, None] * w.row_global_scale()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None,
           scaling: str = "per_token", amax: torch.Tensor | None = None, accumulate: str = "fp32",
           op_order: str = "vllm") -> torch.Tensor:
    """W4A4 linear: x [..., K] (float) quantized per token, times w [N, K] -> [..., N] in x.dtype.

    amax: optional activation amax as in `quantize_activations` (fp32 [...] or []).
    accumulate: as in `nvfp4_gemm` ("fp64" = strict, batch-invariant).
    op_order: the activation quantizer's, "vllm" (default) or "te".
    """
    if amax is not None and scaling == "per_token":
        amax = amax.reshape(-1)
    a = quantize_activations(x.reshape(-1, x.shape[-1]), scaling=scaling, amax=amax, op_order=op_order)
    return nvfp4_gemm(a, w, bias=bias, out_dtype=x.dtype, accumulate=accumulate).reshape(*x.shape[:-1], w.shape[0])


def moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, *, accumulate: str = "fp32", op_order: str = "vllm",
        row_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """W4A4 SwiGLU MoE with per-token activations. Routing is done by the caller.
    accumulate: as in `nvfp4_gemm` ("fp64" = strict, batch-invariant). op_order: the activation
    quantizer's, "vllm" (default) or "te". row_amax: on a tensor-parallel rank, which holds a slice of
    the intermediate size I (w13's gate and up rows, w2's K), the whole SwiGLU rows' amax from this
    rank's: fp32 [T, k] -> [T, k] (an all-reduce MAX over the ranks); None: this rank holds all of I.

    x [T, H] float; w13 [E, 2I, H] (gate rows then up rows, global_scale [E]); w2 [E, H, I];
    topk_weights [T, k] float; topk_ids [T, k] int. Returns [T, H] in x.dtype.
    Each token is quantized once for w13; the SwiGLU output of each (token, expert) pair is
    quantized per row for w2; expert outputs are summed in fp32 weighted by topk_weights.
    """
    a = quantize_per_token(x, op_order=op_order)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    experts = [(e, *(topk_ids == e).nonzero(as_tuple=True)) for e in topk_ids.unique().tolist()]
    act = torch.empty((*topk_ids.shape, inter), dtype=x.dtype, device=x.device)       # [T, k, I]
    for e, tok, slot in experts:
        h = nvfp4_gemm(_rows(a, tok), _expert(w13, e), out_dtype=torch.float32, accumulate=accumulate)  # [t, 2I]
        act[tok, slot] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
    amax = act.abs().float().amax(-1)
    if row_amax is not None:
        amax = row_amax(amax)
    for e, tok, slot in experts:
        y = nvfp4_gemm(quantize_per_token(act[tok, slot], row_amax=amax[tok, slot], op_order=op_order),
                       _expert(w2, e), out_dtype=torch.float32, accumulate=accumulate)
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def _expert(w: NVFP4Tensor, e: int) -> NVFP4Tensor:
    """Expert e of a stacked [E, N, K] weight as an [N, K] NVFP4Tensor."""
    gs = w.global_scale[e] if w.global_scale.dim() else w.global_scale
    return NVFP4Tensor(w.codes[e], w.block_scales[e], gs)


def _rows(a: NVFP4Tensor, idx: torch.Tensor) -> NVFP4Tensor:
    """Rows idx of a per-token [M, K] NVFP4Tensor."""
    return NVFP4Tensor(a.codes[idx], a.block_scales[idx], a.global_scale[idx])


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear block scales [M, Ksf] -> swizzled [roundup(M,128), roundup(Ksf,4)] (zero padded).

    Element (m, k) lands at flat offset (m//128)*(Kp*128) + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4
    + k%4, the layout CUTLASS / cuBLAS / FlashInfer FP4 GEMMs read (Kp = roundup(Ksf, 4)).
    """
    m, k = scales.shape
    mp, kp = -(-m // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-k // SWIZZLE_COLS) * SWIZZLE_COLS
    padded = torch.zeros((mp, kp), dtype=scales.dtype, device=scales.device)
    padded[:m, :k] = scales
    tiles = padded.view(torch.uint8).reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(mp, kp).view(scales.dtype)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales_128x4: [Mp, Kp] swizzled -> linear [rows, cols]."""
    mp, kp = swizzled.shape
    tiles = swizzled.view(torch.uint8).reshape(mp // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(mp, kp)[:rows, :cols].view(swizzled.dtype).contiguous()
