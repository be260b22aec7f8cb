"""Spec tests for kernels.reference (docs/FORMAT.md): agreement with vLLM's emulation,
compressed-tensors and TransformerEngine's NVFP4 formula, batch invariance, round-trip bounds,
exactness on the NVFP4 grid, the 2D weight recipe, errors, the GEMM and the MoE."""
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from nvfp4_sampler import kernels
from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.kernels.format import NVFP4Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_DECISIONS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_VALUES = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()  # 0..448
E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2


# ---------------------------------------------------------------- inputs

def random_input(m, k, dtype, seed):
    """[m, k] heavy-tailed rows (magnitudes spread over e^+-6), about 10% zero blocks, one zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g)).clamp(max=400)
    keep = (torch.rand(m, k // 16, 1, generator=g) > 0.1).float()
    x = (x.unflatten(-1, (-1, 16)) * keep).flatten(-2)
    if m > 2:
        x[m // 2] = 0
    return x.to(dtype)


def adversarial_input(dtype, e):
    """[6, 128] tensor whose per-tensor encode scale is exactly 2**e (amax 2688 * 2**-e, row 0).

    Blocks of scale s (powers of two, other E4M3 values, E4M3 subnormals) have amax 6*s*2**-e and
    elements exactly on every E2M1 decision point (x / (s * S_dec) in 0.25 .. 5, both signs), or one
    ulp of `dtype` above or below; plus -0.0, a zero block, a zero row, a block whose scale
    underflows to 0 and fp32-subnormal values.
    """
    unit = 2.0 ** -e
    blocks = [torch.tensor([2688.0 * unit] + [0.0] * 15)]
    for s in (1.0, 2.0 ** -3, 4.0, 256.0, 1.125, 1.875, 0.8125, 2.0 ** -7, 3 * 2.0 ** -9):
        ties = torch.tensor(E2M1_DECISIONS, dtype=torch.float64) * s * unit
        base = torch.cat([torch.tensor([6.0 * s * unit]), ties, -ties, torch.tensor([-0.0])]).to(dtype)
        for direction in (0.0, math.inf, -math.inf):
            b = base if direction == 0 else torch.nextafter(base, torch.full_like(base, direction))
            b[0] = base[0]                                  # keep the block amax, so the scale stays s
            blocks.append(b.float())
    blocks.append(torch.zeros(16))
    blocks.append(torch.linspace(-1e-3, 1e-3, 16) * unit)  # scale underflows to 0 in E4M3
    blocks.append(torch.tensor([1e-40, -3e-42, 1e-45] + [0.0] * 13))
    flat = torch.cat(blocks)
    flat = torch.cat([flat, torch.zeros(5 * 128 - flat.numel())])
    return torch.cat([flat.reshape(5, 128), torch.zeros(1, 128)]).to(dtype)


ADVERSARIAL = [(torch.float32, 0), (torch.float32, -90), (torch.float32, 100), (torch.float32, 120),
               (torch.bfloat16, 0), (torch.bfloat16, -90), (torch.bfloat16, 100), (torch.float16, 0),
               (torch.float16, 3)]
SHAPES = [(1, 16), (100, 48), (200, 256), (384, 64)]


def decoded(t: NVFP4Tensor) -> torch.Tensor:
    """E2M1 values of t's codes (float32, signed zeros kept)."""
    return R.e2m1_decode(R.unpack_nibbles(t.codes))


def deq64(t: NVFP4Tensor) -> torch.Tensor:
    """Exact dequantization in float64 from an independent table: e2m1 * s * S_dec."""
    codes = R.unpack_nibbles(t.codes).long()
    vals = E2M1_GRID[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    s = t.block_scales.double().repeat_interleave(16, -1)
    return vals * s * t.row_global_scale().double()[..., None]


def expand(block_values: torch.Tensor) -> torch.Tensor:
    """[..., K/16] -> [..., K] (one value per element of each block)."""
    return block_values.repeat_interleave(16, -1)


def near(values: torch.Tensor, points: torch.Tensor, rel: float = 2.0 ** -20) -> torch.Tensor:
    """Where float64 `values` lie within `rel` (relative) of one of `points`: fp32 rounding ties."""
    v = values.double()[..., None]
    return ((v - points).abs() <= rel * points.abs()).any(-1)


# ---------------------------------------------------------------- vLLM's emulation

@pytest.fixture(scope="module")
def vllm_emu():
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils
    return nvfp4_emulation_utils


def assert_matches_vllm(vllm_emu, x, t, *, per_token):
    """Codes and scales of t equal vLLM's ref_nvfp4_quant(x, S_enc) bit for bit, except its three
    quirks (docs/FORMAT.md section 7): a scaled value of -0.0 (from -0.0, or a negative input whose scaled value
    underflows) gives +0 (torch.sign(-0.0) == 0; ours keeps the input's sign, like hardware); a
    block whose scale is 0 is multiplied by 1e-8 instead of 0, so there |x| > 2.5e7 gives nonzero
    codes (ours: signed zeros); and where 1 / (s * S_dec) overflows (amax < 2688 / FLT_MAX, where
    S_enc saturates) vLLM gets Inf and NaN, we cap it at FLT_MAX."""
    xf = x.float()
    s_enc = R.encode_scale_from_amax(xf.abs().amax(-1, keepdim=True) if per_token else xf.abs().amax())
    assert torch.equal(t.global_scale, (1.0 / s_enc).reshape(t.global_scale.shape))
    q, s = vllm_emu.ref_nvfp4_quant(x, s_enc[..., None] if per_token else s_enc, 16)
    assert torch.equal(t.block_scales.float(), s)
    ours = decoded(t)
    assert torch.isfinite(ours).all()
    overflow = expand(torch.isinf(1.0 / (s * (1.0 / s_enc))))
    quirk = (expand(s == 0) & (xf.abs() * 1e-8 > 0.25)) | overflow
    assert torch.equal(ours[~quirk], q[~quirk])
    nonzero, zero = ~quirk & (ours != 0), ~quirk & (ours == 0)
    assert torch.equal(torch.signbit(ours[nonzero]), torch.signbit(q[nonzero]))
    assert torch.equal(torch.signbit(ours[zero]), torch.signbit(xf[zero]))
    assert not (torch.signbit(q[zero]) & ~torch.signbit(ours[zero])).any()
    assert (ours[quirk & ~overflow] == 0).all() and (q[quirk & ~overflow].abs() > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k", SHAPES)
def test_per_tensor_matches_vllm_on_random_inputs(vllm_emu, m, k, dtype):
    x = random_input(m, k, dtype, seed=m + k)
    t = kernels.quantize_activations(x, scaling="per_tensor")
    assert t.global_scale.shape == ()
    assert_matches_vllm(vllm_emu, x, t, per_token=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k", SHAPES)
def test_per_token_matches_vllm_with_row_scales(vllm_emu, m, k, dtype):
    x = random_input(m, k, dtype, seed=7 * m + k)
    t = kernels.quantize_activations(x, scaling="per_token")
    assert t.global_scale.shape == (m,)
    assert_matches_vllm(vllm_emu, x, t, per_token=True)


@pytest.mark.parametrize("dtype, e", ADVERSARIAL)
def test_adversarial_inputs_match_vllm(vllm_emu, dtype, e):
    x = adversarial_input(dtype, e)
    t = R.quantize_per_tensor(x)
    assert t.global_scale == 2.0 ** -e                              # S_enc is exactly 2**e
    assert_matches_vllm(vllm_emu, x, t, per_token=False)
    assert_matches_vllm(vllm_emu, x, R.quantize_per_token(x), per_token=True)


def test_adversarial_ties_round_to_even():
    """Block of scale 1 with S_enc = 1: x / (s * S_dec) is exactly each decision point."""
    t = R.quantize_per_tensor(adversarial_input(torch.float32, 0))
    block = R.unpack_nibbles(t.codes)[0, 16:32]               # second block: s == 1, exact ties
    assert t.block_scales[0, 1].float() == 1.0
    assert block.tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8]


def test_huge_magnitudes_hit_vllms_zero_scale_quirk(vllm_emu):
    """The quirk masked in assert_matches_vllm is real: amax 3.3e30 and a block of 1e24 values."""
    x = adversarial_input(torch.float32, -90)
    q, s = vllm_emu.ref_nvfp4_quant(x, R.encode_scale_from_amax(x.abs().amax()), 16)
    t = R.quantize_per_tensor(x)
    underflow = (t.block_scales.float() == 0) & (x.unflatten(-1, (-1, 16)).abs().amax(-1) > 0)
    assert underflow.any()
    assert (q[expand(underflow)].abs() == 6).any() and (decoded(t)[expand(underflow)] == 0).all()
    assert torch.equal(R.dequantize(t)[expand(underflow)], torch.zeros(int(expand(underflow).sum())))


# ---------------------------------------------------------------- dequantization

@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
def test_dequantize_is_correctly_rounded_and_within_one_ulp_of_vllm(vllm_emu, scaling):
    """Ours rounds the exact e2m1*s*S_dec once; vLLM's dequantize_to_dtype rounds s*S_dec first
    (docs/FORMAT.md), so it may be one fp32 ulp away, never more."""
    x = random_input(200, 256, torch.bfloat16, seed=3)
    t = kernels.quantize_activations(x, scaling=scaling)
    ours = kernels.dequantize(t)
    assert torch.equal(ours, deq64(t).float())
    gs = t.global_scale[:, None] if scaling == "per_token" else t.global_scale
    theirs = vllm_emu.dequantize_to_dtype(t.codes, t.block_scales, gs, torch.float32, swizzle=False)
    ulp = torch.finfo(torch.float32).eps * ours.abs()
    assert ((ours - theirs).abs() <= ulp).all()
    assert not torch.equal(ours, theirs)          # the double rounding does show on 51k values
    sw = R.swizzle_scales_128x4(t.block_scales)
    swizzled = vllm_emu.dequantize_to_dtype(t.codes, sw, gs, torch.float32, swizzle=True)
    assert torch.equal(swizzled, theirs)


def test_dequantize_dtype_and_experts():
    w = random_input(3 * 40, 64, torch.float32, seed=5).reshape(3, 40, 64)
    t = kernels.quantize_weight(w)
    assert t.global_scale.shape == (3,)
    for e in range(3):
        assert torch.equal(t.global_scale[e], R.decode_scale_from_amax(w[e].abs().amax()))
    out = kernels.dequantize(t, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, deq64(t).float().to(torch.bfloat16))


def test_weight_amax_per_share_of_experts():
    """weight_amax: max|w| per matrix, per `share` consecutive experts (an expert's gate and up), NaN kept;
    a share that does not divide the experts is refused."""
    w = random_input(4 * 8, 32, torch.float32, seed=6).reshape(4, 8, 32)
    w[2, 3, 5] = float("nan")
    per = torch.stack([w[e].abs().amax() for e in range(4)])
    assert torch.equal(R.weight_amax(w[0]), per[0]) and R.weight_amax(w[0]).shape == ()
    assert torch.allclose(R.weight_amax(w), per, rtol=0, atol=0, equal_nan=True)
    pairs = R.weight_amax(w, 2)
    assert pairs.shape == (2,) and pairs[0] == per[:2].max() and pairs[1].isnan()
    for bad in (0, 3):
        with pytest.raises(ValueError, match="must divide"):
            R.weight_amax(w, bad)


# ---------------------------------------------------------------- compressed-tensors

def ct_quantize(x):
    """compressed-tensors' NVFP4 (llm-compressor's path): global scale, group scales, FP4 values, packing."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam
    args = NVFP4["weights"]
    x = x.float()      # compressed-tensors computes amax/6 in the input dtype: compare on exact fp32 copies
    gs = generate_gparam(x.min(), x.max())
    scale, _ = compute_dynamic_scales_and_zp(value=x, args=args, module=None, global_scale=gs)
    with torch.compiler.set_stance("force_eager"):     # its cast_to_fp4 is torch.compile'd: same function, eager
        q = quantize(x, scale, zero_point=None, args=args, global_scale=gs)
    return pack_fp4_to_uint8(q), scale.float(), gs


def assert_matches_compressed_tensors(x):
    """Decoded values and codes agree except where docs/FORMAT.md says they differ, each counted."""
    t = R.quantize_per_tensor(x)
    packed, scale, gs = ct_quantize(x)
    s_enc = R.encode_scale_from_amax(x.abs().float().amax())
    assert torch.equal(gs, s_enc.reshape(1))
    ours_s, xf = t.block_scales.float(), x.float()
    # (1) a zero block scale is stored as E4M3's eps (0.125) by compressed-tensors
    # (2) block-scale ties: S_enc * amax_b / 6 within fp32 rounding of an E4M3 midpoint
    v = s_enc.double() * xf.abs().unflatten(-1, (-1, 16)).amax(-1).double() / 6
    scale_tie = near(v, E4M3_MIDPOINTS)
    zero = (ours_s == 0) & ~scale_tie
    assert (scale[zero] == 0.125).all()
    assert torch.equal(scale[~zero & ~scale_tie], ours_s[~zero & ~scale_tie])
    # (3) E2M1 ties: x / (s * S_dec) within fp32 rounding of a decision point (division vs reciprocal)
    y = xf.double().abs() * s_enc.double() / expand(ours_s).double()
    code_tie = near(y, torch.tensor(E2M1_DECISIONS, dtype=torch.float64))
    # (4) scaled values of -0.0 (-0.0 inputs, or negative ones whose scaled value underflows):
    # compressed-tensors' torch.sign(-0.0) == 0 makes code 0; ours keeps 0x8
    y_theirs = xf.double().abs() * s_enc.double() / expand(scale).double()
    neg_zero = torch.signbit(xf) & ((xf == 0) | (y_theirs <= 2.0 ** -150))   # rounds to -0.0 in fp32
    ours_c, theirs_c = R.unpack_nibbles(t.codes), R.unpack_nibbles(packed)
    free = ~expand(scale_tie) & ~code_tie & ~neg_zero
    assert torch.equal(ours_c[free], theirs_c[free])
    assert (ours_c[neg_zero] == 8).all() and (theirs_c[neg_zero] == 0).all()
    return int(scale_tie.sum()), int((code_tie & (ours_c != theirs_c)).sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_compressed_tensors_on_random_inputs(dtype):
    scale_ties, code_ties = assert_matches_compressed_tensors(random_input(100, 256, dtype, seed=11))
    if dtype == torch.float32:
        assert scale_ties == 0 and code_ties == 0      # ties need the few mantissa bits of bf16/fp16


@pytest.mark.parametrize("dtype, e", ADVERSARIAL)
def test_adversarial_inputs_match_compressed_tensors(dtype, e):
    assert_matches_compressed_tensors(adversarial_input(dtype, e))


def test_compressed_tensors_differs_only_at_fp32_ties_concrete():
    """amax 98, block amax 50.75: S_enc*b/6 = 232 exactly, the midpoint of E4M3 224 and 240."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 98.0, 50.75
    _, scale, _ = ct_quantize(x)
    assert R.quantize_per_tensor(x).block_scales.float()[0, 1] == 240.0 and scale[0, 1] == 224.0


# ---------------------------------------------------------------- TransformerEngine's formula

def te_reference(x, *, tile_rows, per_row=False):
    """Independent statement of TransformerEngine's NVFP4 quantizer (core_nvfp4.cuh):
    S_enc = min(2688 / amax, FLT_MAX) (one correctly rounded division; 1 if amax == 0);
    s = e4m3(block_amax * (S_enc * fp32(1/6))); inv = min(1 / (s * (1 / S_enc)), FLT_MAX);
    q = RNE(clamp(x * inv, +-6)), sign kept. Tiles of tile_rows x 16 (rows padded with zeros).
    Returns (codes [M, K], scales [M, K/16], S_enc)."""
    xf = x.float()
    m = xf.shape[0]
    amax = xf.abs().amax(-1, keepdim=True) if per_row else xf.abs().amax()
    s_enc = torch.where(amax == 0, 1.0, torch.clamp(torch.div(torch.tensor(2688.0), amax), max=FLT_MAX))
    pad = torch.cat([xf.abs(), xf.new_zeros((-m) % tile_rows, xf.shape[1])])
    tiles = pad.reshape(-1, tile_rows, xf.shape[1] // 16, 16).amax(dim=(1, 3))
    block_amax = tiles.repeat_interleave(tile_rows, 0)[:m]
    s = torch.clamp(block_amax * (s_enc * torch.tensor(1 / 6, dtype=torch.float32)), max=FLT_MAX)
    s = torch.clamp(s, -448, 448).to(torch.float8_e4m3fn)
    inv = torch.clamp(1.0 / (s.float() * (1.0 / s_enc)), max=FLT_MAX)
    y = torch.clamp(xf * expand(inv), -6, 6)
    dist = (y.abs().double()[..., None] - E2M1_GRID).abs()
    idx = dist.argmin(-1)                                   # the lower code on a tie
    up = (idx + 1).clamp(max=7)
    tie = dist.gather(-1, up[..., None])[..., 0] == dist.gather(-1, idx[..., None])[..., 0]
    idx = torch.where(tie & (idx % 2 == 1), up, idx)        # ties to the even code
    return (idx | (torch.signbit(y).long() << 3)).to(torch.uint8), s, s_enc


def assert_matches_te(x, t, *, tile_rows, per_row=False):
    """Equal codes and scales, except at fp32 rounding ties: S_enc may be one ulp apart (TE divides
    once, we take fp32(1 / amax) * 2688 as torch, vLLM and compressed-tensors do), (a) blocks whose
    S_enc*amax_b/6 is a tie of E4M3 rounding (TE multiplies block_amax * (S_enc/6), we
    S_enc * (block_amax/6)) and (b) elements whose x/(s*S_dec) is a tie of E2M1 rounding. Blocks of
    scale 0 with nonzero values TE saturates (inv = FLT_MAX), we zero: both decode to 0.
    Returns (blocks of kind (a), differing elements of kind (b))."""
    codes, s, te_s_enc = te_reference(x, tile_rows=tile_rows, per_row=per_row)
    ours_s = t.block_scales.float()
    xf = x.float()
    s_enc = R.encode_scale_from_amax(xf.abs().amax(-1, keepdim=True) if per_row else xf.abs().amax())
    assert ((s_enc - te_s_enc).abs() <= torch.finfo(torch.float32).eps * s_enc).all()
    pad = torch.cat([xf.abs(), xf.new_zeros((-xf.shape[0]) % tile_rows, xf.shape[1])])
    b = pad.reshape(-1, tile_rows, xf.shape[1] // 16, 16).amax(dim=(1, 3)).repeat_interleave(tile_rows, 0)
    tie = near(s_enc.double() * b[: xf.shape[0]].double() / 6, E4M3_MIDPOINTS)
    assert torch.equal(ours_s[~tie], s.float()[~tie])
    ours_c = R.unpack_nibbles(t.codes)
    zero = expand(ours_s == 0)
    code_tie = near(xf.double().abs() * s_enc.double() / expand(ours_s).double(),
                    torch.tensor(E2M1_DECISIONS, dtype=torch.float64))
    free = ~expand(tie) & ~zero & ~code_tie
    assert torch.equal(ours_c[free], codes[free])
    saturated = zero & (xf.abs() * FLT_MAX > 5)
    assert ((codes[saturated] & 7) == 7).all() and (ours_c[zero] & 7 == 0).all()
    return int(tie.sum()), int((code_tie & (ours_c != codes)).sum())


@pytest.mark.parametrize("n, k", [(40, 64), (100, 128), (256, 256), (17, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_2d_weights_match_te_recipe(n, k, dtype):
    w = random_input(n, k, dtype, seed=n * k)
    t = kernels.quantize_weight(w, recipe="2d")
    ties = assert_matches_te(w, t, tile_rows=16)
    if dtype == torch.float32:
        assert ties == (0, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_1d_weights_and_per_token_activations_match_te(dtype):
    x = random_input(200, 256, dtype, seed=21)
    assert_matches_te(x, kernels.quantize_weight(x, recipe="1d"), tile_rows=1)
    ties = assert_matches_te(x, R.quantize_per_token(x), tile_rows=1, per_row=True)
    if dtype == torch.float32:
        assert ties == (0, 0)


def test_te_block_scale_order_differs_at_an_exact_e4m3_tie():
    """amax 10, block amax 3.75 (bf16-exact): S_enc*b/6 = 168, the midpoint of E4M3 160 and 176;
    fp32 rounding in our (vLLM's) order lands above it (176), in TE's below (160)."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 16] = 10.0, 3.75
    _, te_s, _ = te_reference(x, tile_rows=1)
    assert R.quantize_per_tensor(x).block_scales.float()[0, 1] == 176.0 and te_s.float()[0, 1] == 160.0


def test_2d_tiles_share_one_scale():
    w = random_input(100, 96, torch.bfloat16, seed=4)          # N = 100: the last tile has 4 rows
    s = kernels.quantize_weight(w, recipe="2d").block_scales.float()
    for r0 in range(0, 100, 16):
        assert (s[r0:r0 + 16] == s[r0]).all()
    assert len(torch.unique(s)) > 10


def test_2d_transposed_weight_quantizes_to_the_same_values():
    w = random_input(48, 64, torch.bfloat16, seed=6)
    t = kernels.quantize_weight(w, recipe="2d")
    tt = kernels.quantize_weight(w.T.contiguous(), recipe="2d")
    assert torch.equal(tt.block_scales.float()[::16].T, t.block_scales.float()[::16])
    assert torch.equal(kernels.dequantize(tt).T, kernels.dequantize(t))


def test_2d_differs_from_1d():
    w = random_input(64, 64, torch.float32, seed=8)
    assert not torch.equal(kernels.quantize_weight(w, recipe="2d").block_scales.float(),
                           kernels.quantize_weight(w, recipe="1d").block_scales.float())


# ---------------------------------------------------------------- batch invariance

@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_per_token_row_is_batch_invariant(data):
    m = data.draw(st.integers(1, 10), label="rows")
    k = 16 * data.draw(st.integers(1, 6), label="blocks")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    limit = 60000.0 if dtype == torch.float16 else 1e30
    vals = data.draw(arrays(np.float32, (m, k), elements=st.floats(
        -1e6, 1e6, width=32, allow_subnormal=True)), label="values")
    exps = data.draw(st.lists(st.integers(-40, 40), min_size=m, max_size=m), label="row exponents")
    x = torch.from_numpy(vals) * torch.tensor([2.0 ** e for e in exps])[:, None]
    x = x.clamp(-limit, limit).to(dtype)
    batch = R.quantize_per_token(x)
    perm = torch.tensor(data.draw(st.permutations(range(m)), label="order"))
    shuffled = R.quantize_per_token(x[perm])
    for i in range(m):
        alone = R.quantize_per_token(x[i:i + 1])
        j = int((perm == i).nonzero())
        for t, r in ((batch, i), (shuffled, j)):
            assert torch.equal(t.codes[r], alone.codes[0])
            assert torch.equal(t.block_scales[r].view(torch.uint8), alone.block_scales[0].view(torch.uint8))
            assert torch.equal(t.global_scale[r], alone.global_scale[0])


def test_per_tensor_is_not_batch_invariant():
    row = torch.linspace(-1.0, 1.0, 32)[None]
    loud = torch.full((1, 32), 1000.0)
    alone = R.quantize_per_tensor(row)
    inside = R.quantize_per_tensor(torch.cat([row, loud]))
    assert torch.equal(alone.global_scale, R.decode_scale_from_amax(torch.tensor(1.0)))
    assert torch.equal(inside.global_scale, R.decode_scale_from_amax(torch.tensor(1000.0)))
    assert alone.block_scales.float().tolist() == [[448.0, 448.0]]
    assert inside.block_scales.float()[0].tolist() == [0.4375, 0.4375]
    assert not torch.equal(alone.codes, inside.codes[:1])
    assert not torch.equal(kernels.dequantize(alone), kernels.dequantize(inside)[:1])
    # per token the same row does not notice its loud neighbour
    assert torch.equal(R.quantize_per_token(torch.cat([row, loud])).codes[:1], R.quantize_per_token(row).codes)


# ---------------------------------------------------------------- round trip

def half_step(u):
    """Half the distance between E2M1 neighbours around u = |x| / d (d the block's decode scale)."""
    return torch.where(u < 2, 0.25, torch.where(u < 4, 0.5, torch.where(u <= 6, 1.0, u - 6)))


@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_bound(scaling, dtype):
    """|x - x'| <= d * half_step(|x|/d) per element, d = s * S_dec; |x|/d <= 6/(1 - 2^-4) = 6.4 for
    normal E4M3 scales (s rounds by at most 2^-4 relative) and 6 (s + 2^-10)/s for subnormal ones;
    a block whose scale underflows to 0 has |x| <= 6 * 2^-10 * S_dec and decodes to 0."""
    x = random_input(384, 256, dtype, seed=13)
    t = kernels.quantize_activations(x, scaling=scaling)
    xd = x.double()
    err = (xd - kernels.dequantize(t).double()).abs()
    s = expand(t.block_scales.double())
    s_dec = t.row_global_scale().double()[..., None].expand_as(xd)
    d = s * s_dec
    live = s > 0
    u = xd.abs()[live] / d[live]
    slack = 1 + 2.0 ** -20
    normal = s[live] >= 2.0 ** -6
    assert (u[normal] <= 6 / (1 - 2.0 ** -4) * slack).all()
    assert (u[~normal] <= 6 * (s[live][~normal] + 2.0 ** -10) / s[live][~normal] * slack).all()
    bound = d[live] * half_step(u) * slack + d[live] * 6 * 2.0 ** -22
    assert (err[live] <= bound).all()
    assert (err[~live] == xd.abs()[~live]).all()
    assert (xd.abs()[~live] <= 6 * 2.0 ** -10 * s_dec[~live] * slack).all()
    assert (err[live] / bound).max() > 0.9                     # the bound is tight, not vacuous


def grid_input(m, k, *, exps, dtype, seed, tile_rows=1):
    """x = e2m1(q) * s * 2**-e exactly, with one +-6 code per block (block amax 6 s) and one block of
    scale 448 per row (row amax 2688 * 2**-e). Returns (x, codes [m, k], scales [m, k/16])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (m, k), generator=g, dtype=torch.uint8)
    n_tiles = -(-m // tile_rows)
    bits = torch.randint(1, 127, (n_tiles, k // 16), generator=g, dtype=torch.uint8)
    bits[:, 0] = 0x7E                                          # 448
    scales = bits.view(torch.float8_e4m3fn).repeat_interleave(tile_rows, 0)[:m]
    first_rows = torch.arange(m) % tile_rows == 0
    codes.unflatten(-1, (-1, 16))[first_rows, :, 0] |= 7       # 6 or -6 at the start of each tile
    unit = torch.tensor([2.0 ** -e for e in exps])[:, None]
    x = R.e2m1_decode(codes) * expand(scales.float()) * unit
    return x.to(dtype), codes, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_on_the_grid_round_trip_exactly_per_token(dtype):
    exps = list(range(-20, 20, 2)) * 5
    x, codes, scales = grid_input(100, 128, exps=exps, dtype=dtype, seed=1)
    t = R.quantize_per_token(x)
    assert torch.equal(R.unpack_nibbles(t.codes), codes)
    assert torch.equal(t.block_scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(t.global_scale, torch.tensor([2.0 ** -e for e in exps]))     # S_enc = 2**e exactly
    assert torch.equal(kernels.dequantize(t), x.float())


@pytest.mark.parametrize("recipe, tile_rows", [("1d", 1), ("2d", 16)])
def test_weights_on_the_grid_round_trip_exactly(recipe, tile_rows):
    x, codes, scales = grid_input(72, 64, exps=[3] * 72, dtype=torch.bfloat16, seed=2, tile_rows=tile_rows)
    t = kernels.quantize_weight(x, recipe=recipe)
    assert torch.equal(R.unpack_nibbles(t.codes), codes)
    assert torch.equal(t.block_scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(kernels.dequantize(t), x.float())


def test_tiny_amax_stays_finite():
    """amax below 2688 / FLT_MAX: S_enc saturates at FLT_MAX; no NaN, no Inf, zeros stay +0."""
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([1e-38, 3.3e-39, -1e-40])
    x[1, 0] = 1e-44
    for t in (R.quantize_per_token(x), R.quantize_per_tensor(x)):
        out = kernels.dequantize(t)
        assert torch.isfinite(out).all() and torch.isfinite(t.block_scales.float()).all()
        assert (R.unpack_nibbles(t.codes)[x == 0] == 0).all()
        assert ((out - x).abs() <= x.abs().amax(-1, keepdim=True)).all()


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("fn", [lambda x: kernels.quantize_activations(x, scaling="per_token"),
                                lambda x: kernels.quantize_activations(x, scaling="per_tensor"),
                                lambda x: kernels.quantize_weight(x, recipe="1d"),
                                lambda x: kernels.quantize_weight(x, recipe="2d")])
def test_bad_inputs_raise(fn):
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(torch.zeros(4, 24))
    for dtype in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(TypeError, match="expected one of"):
            fn(torch.zeros(4, 32, dtype=dtype))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.zeros(4, 32, dtype=torch.bfloat16)
        x[2, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            fn(x)


def test_bad_option_names_raise():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="scaling must be"):
        kernels.quantize_activations(x, scaling="per_row")
    with pytest.raises(ValueError, match="recipe must be"):
        kernels.quantize_weight(x, recipe="16x16")
    with pytest.raises(ValueError, match=r"\[N, K\] or \[E, N, K\]"):
        kernels.quantize_weight(torch.zeros(16))
    with pytest.raises(ValueError, match="K=None"):
        kernels.quantize_activations(torch.tensor(1.0))
    with pytest.raises(TypeError):
        kernels.quantize_activations(x, "per_tensor")              # flags are keyword-only
    w = kernels.quantize_weight(torch.ones(8, 32))
    with pytest.raises(ValueError, match="nvfp4_gemm expects"):
        kernels.nvfp4_gemm(kernels.quantize_activations(torch.ones(2, 16)), w)


def test_amax_overrides():
    x = random_input(8, 64, torch.float32, seed=9)
    amax = x.abs().amax() * 2
    t = R.quantize_per_tensor(x, amax=amax)
    assert torch.equal(t.global_scale, R.decode_scale_from_amax(amax))
    w = random_input(2 * 16, 32, torch.float32, seed=9).reshape(2, 16, 32)
    amaxes = torch.tensor([50.0, 60.0])
    tw = kernels.quantize_weight(w, amax=amaxes)
    assert torch.equal(tw.global_scale, R.decode_scale_from_amax(amaxes))
    assert torch.equal(tw.global_scale, 1.0 / (2688.0 / amaxes))


# ---------------------------------------------------------------- GEMM and MoE

def gemm_bound(a64, w64, k):
    """FP32 accumulation of k exact products plus two epilogue scalings: (k + 3) u sum|a_i w_i|."""
    return (k + 3) * 2.0 ** -24 * (a64.abs() @ w64.abs().T)


@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
@pytest.mark.parametrize("w_scales", ["tensor", "row"])
def test_gemm_matches_float64(scaling, w_scales):
    m, n, k = 37, 48, 512
    x = random_input(m, k, torch.bfloat16, seed=17)
    wt = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 3, n)[:, None]
    a = kernels.quantize_activations(x, scaling=scaling)
    w = kernels.quantize_weight(wt) if w_scales == "tensor" else R.quantize_per_token(wt)  # gs [] / [N]
    assert w.global_scale.shape == (() if w_scales == "tensor" else (n,))
    a64, w64 = deq64(a), deq64(w)
    ref = a64 @ w64.T
    out = kernels.nvfp4_gemm(a, w, out_dtype=torch.float32)
    assert ((out.double() - ref).abs() <= gemm_bound(a64, w64, k)).all()
    bias = torch.randn(n, dtype=torch.bfloat16)
    out_bf16 = kernels.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.bfloat16)
    ref_b = ref + bias.double()
    tol = gemm_bound(a64, w64, k) + 2.0 ** -24 * ref_b.abs() + 2.0 ** -8 * ref_b.abs()
    assert out_bf16.dtype == torch.bfloat16 and ((out_bf16.double() - ref_b).abs() <= tol).all()


def test_linear_quantizes_per_token_and_keeps_leading_dims():
    x = random_input(2 * 5, 64, torch.bfloat16, seed=19).reshape(2, 5, 64)
    w = kernels.quantize_weight(torch.randn(24, 64, generator=torch.Generator().manual_seed(1)))
    y = R.linear(x, w)
    assert y.shape == (2, 5, 24) and y.dtype == torch.bfloat16
    expect = kernels.nvfp4_gemm(R.quantize_per_token(x.reshape(10, 64)), w, out_dtype=torch.bfloat16)
    assert torch.equal(y.reshape(10, 24), expect)


def expert(w: NVFP4Tensor, e: int) -> NVFP4Tensor:
    return NVFP4Tensor(w.codes[e], w.block_scales[e], w.global_scale[e])


def fused_gate_up(gate: NVFP4Tensor, up: NVFP4Tensor) -> NVFP4Tensor:
    """[E, I, H] gate and up, each with its own per-expert scale -> w13 [E, 2I, H], global_scale [E, 2I]."""
    gs = torch.cat([gate.global_scale[:, None].expand(-1, gate.codes.shape[1]),
                    up.global_scale[:, None].expand(-1, up.codes.shape[1])], 1)
    return NVFP4Tensor(torch.cat([gate.codes, up.codes], 1), torch.cat([gate.block_scales, up.block_scales], 1),
                       gs.contiguous())


@pytest.mark.parametrize("per_shard", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_float64_loop(dtype, per_shard):
    """Per (token, slot): h = deq(a_t) @ deq(w13_e).T; act = silu(gate) * up, cast to x.dtype and
    quantized per token (the spec's quantization points); y = deq(act) @ deq(w2_e).T, summed with
    the routing weights. Everything else in float64. per_shard: gate and up keep their own
    weight_scale_2 (global_scale [E, 2I]), as a converted checkpoint loads."""
    g = torch.Generator().manual_seed(23)
    t_, h, inter, e_, topk = 24, 64, 32, 4, 2
    x = (torch.randn(t_, h, generator=g)).to(dtype)
    gate_up = torch.randn(e_, 2 * inter, h, generator=g) * 0.2
    gate_up[:, inter:] *= 3
    if per_shard:
        w13 = fused_gate_up(kernels.quantize_weight(gate_up[:, :inter]), kernels.quantize_weight(gate_up[:, inter:]))
        assert w13.global_scale.shape == (e_, 2 * inter)
    else:
        w13 = kernels.quantize_weight(gate_up)
    w2 = kernels.quantize_weight(torch.randn(e_, h, inter, generator=g) * 0.2)
    ids = torch.stack([torch.randperm(e_, generator=g)[:topk] for _ in range(t_)])
    weights = torch.softmax(torch.randn(t_, topk, generator=g), -1)
    out = R.moe(x, w13, w2, weights, ids)
    a64 = deq64(R.quantize_per_token(x))
    ref = torch.zeros(t_, h, dtype=torch.float64)
    for t in range(t_):
        for j in range(topk):
            e = int(ids[t, j])
            hh = a64[t] @ deq64(expert(w13, e)).T
            act = torch.nn.functional.silu(hh[:inter]) * hh[inter:]
            y = deq64(R.quantize_per_token(act.to(dtype)[None]))[0] @ deq64(expert(w2, e)).T
            ref[t] += float(weights[t, j]) * y
    assert out.dtype == dtype
    tol = 1e-5 * ref.abs().max() + (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -22) * ref.abs()
    assert ((out.double() - ref).abs() <= tol).all()


# ---------------------------------------------------------------- the spec on CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_on_cuda_equals_cpu(dtype):
    """The spec is device independent: codes, scales and global scales bit-identical on CUDA."""
    x = random_input(384, 2048, dtype, seed=29)
    adv = adversarial_input(dtype, 3 if dtype == torch.float16 else 100)
    cases = [(R.quantize_per_token, x), (R.quantize_per_tensor, x), (R.quantize_per_token, adv),
             (R.quantize_per_tensor, adv), (functools.partial(kernels.quantize_weight, recipe="1d"), x),
             (functools.partial(kernels.quantize_weight, recipe="2d"), x[:200])]
    for quantize, v in cases:
        cpu, gpu = quantize(v), quantize(v.cuda()).to("cpu")
        assert torch.equal(cpu.codes, gpu.codes)
        assert torch.equal(cpu.block_scales.view(torch.uint8), gpu.block_scales.view(torch.uint8))
        assert torch.equal(cpu.global_scale, gpu.global_scale)
        assert torch.equal(kernels.dequantize(cpu), kernels.dequantize(gpu.to("cuda")).cpu())
    sw = R.swizzle_scales_128x4(R.quantize_per_token(x).block_scales)
    assert torch.equal(sw.view(torch.uint8), R.swizzle_scales_128x4(
        R.quantize_per_token(x.cuda()).block_scales).cpu().view(torch.uint8))
    a, w = R.quantize_per_token(x[:100]), kernels.quantize_weight(x[100:300])
    out = kernels.nvfp4_gemm(a.to("cuda"), w.to("cuda"), out_dtype=torch.float32).cpu()
    a64, w64 = deq64(a), deq64(w)
    assert ((out.double() - a64 @ w64.T).abs() <= gemm_bound(a64, w64, 2048)).all()
