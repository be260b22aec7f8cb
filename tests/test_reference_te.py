"""kernels.reference with op_order="te" against TransformerEngine's NVFP4 arithmetic, restated here
from TE's source (NVIDIA/TransformerEngine, main, read for this test):

- `transformer_engine/common/cast/nvfp4/core_nvfp4.cuh`:
  `compute_global_encode_scaling_factor_FP4(global_amax)`: S_enc = fminf(448 * 6 / amax, FLT_MAX),
  1 when amax == 0 (or S_enc == 0); `quantization_SF::compute_decoding_scaling_factor` and
  `quantization_and_transposition_SF::compute_decoding_scaling_factor`:
  s = fp8e4m3(block_amax * (S_enc * (1 / 6.0f))) (the latter with fminf(., FLT_MAX) first);
  `core::compute_scaling_coefficient<float>`: S_dec = 1 / S_enc, inv = fminf(1 / (float(s) * S_dec),
  FLT_MAX) (so a zero block gives inv = FLT_MAX); codes by `cvt.rn.satfinite.e2m1x2.f32` of x * inv.
  Used for per-tensor activations, 1D weights and 2D (16x16 tile amax) weights.
- `transformer_engine/pytorch/custom_recipes/quantization_nvfp4_per_token.py`,
  `NVFP4QuantizerPerTokenRef._quantize_2d` (row-scaled activations): S_enc_row =
  min(448 * 6 / max(row_amax, 1e-12), FLT_MAX); s as above; element scale S_enc / float(s)
  (`__fdiv_rn`), 0 for a zero block, min FLT_MAX.

The statement below is independent of kernels.reference (float64 grid search for E2M1 with ties to
even, torch's correctly rounded fp32 division and multiplication); comparisons are exact (every code,
every scale, every global scale).
"""
import pytest
import torch

from nvfp4_sampler.kernels import reference as R

FLT_MAX = torch.finfo(torch.float32).max
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
SIXTH = torch.tensor(1.0, dtype=torch.float32) / 6.0          # fp32(1 / 6.0f)


def e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """fp32 y (already clamped to +-6) -> codes 0..15: nearest grid value, ties to the even code, sign bit kept
    (cvt.rn.satfinite keeps the sign of -0.0 and of negatives that round to 0)."""
    dist = (y.abs().double()[..., None] - GRID).abs()
    idx = dist.argmin(-1)
    up = (idx + 1).clamp(max=7)
    tie = dist.gather(-1, up[..., None])[..., 0] == dist.gather(-1, idx[..., None])[..., 0]
    idx = torch.where(tie & (idx % 2 == 1), up, idx)
    return (idx | (torch.signbit(y).long() << 3)).to(torch.uint8)


def te_quantize(x: torch.Tensor, *, tile_rows: int = 1, per_row: bool = False):
    """TE's NVFP4 forward quantizer of x [M, K] -> (codes [M, K] unpacked, scales e4m3 [M, K/16], S_enc).

    tile_rows 16: the 2D weight recipe (block amax over 16x16 tiles, rows zero-padded)."""
    xf = x.float()
    m, k = xf.shape
    if per_row:
        amax = xf.abs().amax(-1, keepdim=True)
        s_enc = torch.full_like(amax, 2688.0) / amax.clamp(min=1e-12)
    else:
        amax = xf.abs().amax().reshape(1, 1)
        s_enc = torch.full_like(amax, 2688.0) / amax
    s_enc = s_enc.clamp(max=FLT_MAX)
    s_enc = torch.where((amax.clamp(min=1e-12 if per_row else 0) == 0) | (s_enc == 0), 1.0, s_enc)
    pad = torch.cat([xf.abs(), xf.new_zeros((-m) % tile_rows, k)])
    block_amax = pad.reshape(-1, tile_rows, k // 16, 16).amax(dim=(1, 3)).repeat_interleave(tile_rows, 0)[:m]
    s = (block_amax * (s_enc * SIXTH)).clamp(max=FLT_MAX).clamp(-448, 448).to(torch.float8_e4m3fn)
    sf = s.float()
    if per_row:
        inv = torch.where(sf == 0, 0.0, (s_enc / torch.where(sf == 0, 1.0, sf)).clamp(max=FLT_MAX))
    else:
        inv = (1.0 / (sf * (1.0 / s_enc))).clamp(max=FLT_MAX)
    y = (xf.unflatten(-1, (-1, 16)) * inv[..., None]).clamp(-6, 6).flatten(-2)
    return e2m1_rne(y), s, s_enc


def heavy_tailed(m, k, dtype, seed):
    """[m, k] rows with magnitudes spread over e^+-6, about 10% zero blocks, one zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g)).clamp(max=400)
    x = (x.unflatten(-1, (-1, 16)) * (torch.rand(m, k // 16, 1, generator=g) > 0.1)).flatten(-2)
    x[m // 2] = 0
    return x.to(dtype)


def assert_equal_to_te(t, x, **kw):
    codes, s, s_enc = te_quantize(x, **kw)
    assert torch.equal(R.unpack_nibbles(t.codes), codes)
    assert torch.equal(t.block_scales.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(t.row_global_scale().reshape(-1), (1.0 / s_enc).expand(x.shape[0], 1).reshape(-1))


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_per_tensor_and_1d_weights_equal_te(dtype, seed):
    x = heavy_tailed(96, 256, dtype, seed)
    assert_equal_to_te(R.quantize_per_tensor(x, op_order="te"), x)
    assert_equal_to_te(R.quantize_weight(x, recipe="1d", op_order="te"), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(40, 64), (17, 16), (256, 256)])
def test_2d_weights_equal_te(dtype, n, k):
    w = heavy_tailed(n, k, dtype, n + k)
    assert_equal_to_te(R.quantize_weight(w, recipe="2d", op_order="te"), w, tile_rows=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_row_scaled_activations_equal_te(dtype, seed):
    x = heavy_tailed(128, 512, dtype, 100 + seed)
    x[3, :16] = 1e-13                      # a row below TE's 1e-12 amax floor
    assert_equal_to_te(R.quantize_per_token(x, op_order="te"), x, per_row=True)
    assert_equal_to_te(R.quantize_activations(x, scaling="per_token", op_order="te"), x, per_row=True)


def test_te_order_resolves_the_known_e4m3_tie():
    """amax 10, block amax 3.75: S_enc * b / 6 = 168 exactly, the E4M3 midpoint of 160 and 176.
    The spec (vLLM order) gives 176, TE 160; op_order="te" gives TE's."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 16] = 10.0, 3.75
    assert R.quantize_per_tensor(x).block_scales.float()[0, 1] == 176.0
    assert R.quantize_per_tensor(x, op_order="te").block_scales.float()[0, 1] == 160.0


def test_te_order_divides_once_for_s_enc():
    """An amax where fp32(1/amax) * 2688 is one ulp away from the correctly rounded 2688 / amax."""
    amax = torch.linspace(0.1, 100.0, 20001)
    vllm, te = R.encode_scale_from_amax(amax), R.encode_scale_from_amax(amax, op_order="te")
    exact = (2688.0 / amax.double()).float()               # fp64 division rounded once to fp32
    assert torch.equal(te, exact)
    assert 0.05 < (vllm != te).double().mean() < 0.6       # the documented ~25% of amax values


def test_te_zero_scale_block_saturates_per_tensor_and_zeroes_per_row():
    """A block whose E4M3 scale underflows to 0: TE per tensor multiplies by FLT_MAX (codes saturate
    to +-6, decoding to 0 all the same), TE per row multiplies by 0."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0
    x[0, 16:] = 1e-6
    pt = R.quantize_per_tensor(x, op_order="te")
    assert pt.block_scales.float()[0, 1] == 0 and (R.unpack_nibbles(pt.codes)[0, 16:] == 7).all()
    pr = R.quantize_per_token(x, op_order="te")
    assert (R.unpack_nibbles(pr.codes)[0, 16:] == 0).all()
    assert (R.dequantize(pt)[0, 16:] == 0).all() and (R.dequantize(pr)[0, 16:] == 0).all()


def test_unknown_op_order_is_refused():
    with pytest.raises(ValueError, match="op_order"):
        R.quantize_per_token(torch.ones(1, 16), op_order="cuda")


@pytest.mark.parametrize("op_order", ["vllm", "te"])
def test_fused_group_shares_one_scale(op_order):
    """q/k/v quantized as one fused group: one global scale (the max over the group); with the 1d
    recipe the shards concatenated equal quantizing the fused [Nq+Nk+Nv, K] tensor."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 64, generator=g).to(torch.bfloat16) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.5)))
    parts = R.quantize_weight_group([q, k, v], op_order=op_order)
    assert all(torch.equal(p.global_scale, parts[1].global_scale) for p in parts)
    fused = R.quantize_weight(torch.cat([q, k, v]), op_order=op_order)
    assert torch.equal(torch.cat([p.codes for p in parts]), fused.codes)
    assert torch.equal(torch.cat([p.block_scales for p in parts]).view(torch.uint8), fused.block_scales.view(torch.uint8))
    assert torch.equal(parts[0].global_scale, fused.global_scale)
    own = R.quantize_weight(q, op_order=op_order)          # q alone has a smaller amax: a finer scale
    assert own.global_scale < parts[0].global_scale


def test_fused_group_experts_share_per_expert_and_reject_mixed_k():
    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(4, 32, 64, generator=g), torch.randn(4, 32, 64, generator=g) * 2
    a, b = R.quantize_weight_group([gate, up])
    assert a.global_scale.shape == (4,) and torch.equal(a.global_scale, b.global_scale)
    with pytest.raises(ValueError, match="fused group"):
        R.quantize_weight_group([torch.ones(16, 32), torch.ones(16, 64)])
