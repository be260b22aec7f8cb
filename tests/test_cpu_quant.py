"""kernels.cpu_quant: bit-identical to kernels.reference.quantize_weight (codes, block scales,
global scale) over awkward shapes, dtypes, extremes, E2M1 ties, 1d/2d recipes, given amax, both op
orders; same errors; CPU weights in kernels.dispatch go through it."""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nvfp4_sampler.kernels import cpu_quant, dispatch, reference


def assert_same(got, want, what: str = ""):
    """Two NVFP4Tensors bit for bit (codes, block scales, global scales); `what` names the case."""
    assert torch.equal(got.codes, want.codes), f"{what}: codes differ"
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8)), f"{what}: block scales differ"
    assert torch.equal(got.global_scale.view(torch.int32), want.global_scale.view(torch.int32)), f"{what}: global scales differ"


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_e2m1_rounding_at_every_decision_point():
    """Each E2M1 value and rounding threshold, +-4 ulps, both signs, zeros, saturation: the magic
    addition rounds exactly like the reference's threshold table (inv = 1 leaves x unchanged)."""
    points = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 1e30]
    vals = {0.0, 1e-45, 1e-38, 3.4e38}
    for p in points:
        for d in range(-4, 5):
            b = _bits(p) + d
            if 0 <= b < 0x7F800000:
                vals.add(_f32(b))
    xs = sorted(vals)
    x = torch.tensor(xs + [-v for v in xs] + [0.0] * ((-2 * len(xs)) % 16), dtype=torch.float32)
    x = x.reshape(-1, 16)
    got, _ = cpu_quant._encode(x.contiguous(), torch.ones(x.shape[0], 1))
    want = reference.pack_nibbles(reference.e2m1_encode(torch.clamp(x, -6.0, 6.0)))
    assert torch.equal(got, want)


_DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])


@st.composite
def weights(draw):
    dtype = draw(_DTYPES)
    experts = draw(st.sampled_from([None, 1, 3]))
    n = draw(st.integers(1, 40))
    k = 16 * draw(st.integers(1, 12))
    shape = (n, k) if experts is None else (experts, n, k)
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    exp_lo, exp_hi = {torch.float16: (-20, 15), torch.bfloat16: (-120, 120), torch.float32: (-120, 120)}[dtype]
    # per-row magnitudes spread over the dtype's range (extremes, subnormal blocks, huge rows)
    mag = 2.0 ** torch.randint(exp_lo, exp_hi, (*shape[:-1], 1), generator=g).double()
    x = torch.randn(shape, generator=g, dtype=torch.float64) * mag
    kind = draw(st.sampled_from(["plain", "zeros", "ties", "mixed"]))
    if kind == "zeros":                          # all-zero blocks and signed zeros
        x[..., :16] = 0.0
        x[..., 16:32] = -0.0
    elif kind == "ties":                         # exact E2M1 grid values and midpoints
        grid = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6], dtype=torch.float64)
        x[..., :16] = grid * draw(st.sampled_from([1.0, 0.5, 2.0 ** -10, 1 / 3]))
    elif kind == "mixed":                        # one huge block next to tiny ones in each row
        x[..., :16] *= 2.0 ** 10
    x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    if draw(st.booleans()) and x.dim() == 2:     # non-contiguous input
        x = x.t().contiguous().t()
    return x


@settings(max_examples=150, deadline=None)
@given(w=weights(), recipe=st.sampled_from(["1d", "2d"]), given_amax=st.booleans(),
       op_order=st.sampled_from(["vllm", "te"]), amax_scale=st.sampled_from([1.0, 2.0, 0.25]))
def test_bit_identical_to_reference(w, recipe, given_amax, op_order, amax_scale):
    amax = None
    if given_amax:                   # e.g. a fused group's shared amax (larger) or a too-small one (saturation)
        amax = w.abs().float().amax(dim=(-2, -1)) * amax_scale
        assume(bool(torch.isfinite(amax).all()))      # an overflowed amax is refused (next test)
    want = reference.quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order)
    got = cpu_quant.quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order)
    assert_same(got, want)


@settings(max_examples=60, deadline=None)
@given(w=weights(), recipe=st.sampled_from(["1d", "2d"]), op_order=st.sampled_from(["vllm", "te"]))
def test_error_in_the_same_pass_equals_the_dequantized_error(w, recipe, op_order):
    """quantize_weight_with_error: the same codes, and per matrix the error of `reference.dequantize`
    against w (sums within fp32 reordering)."""
    got, err = cpu_quant.quantize_weight_with_error(w, recipe=recipe, op_order=op_order)
    assert_same(got, reference.quantize_weight(w, recipe=recipe, op_order=op_order))
    diff = (reference.dequantize(got) - w.float()).double()
    dims = (-2, -1)
    assert err.err_sq.shape == got.global_scale.shape
    torch.testing.assert_close(err.err_sq, diff.square().sum(dims), rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(err.ref_sq, w.double().square().sum(dims), rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(err.max_abs, diff.abs().amax(dims), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(300, 512), (2, (1 << 17) + 16), (5, 1000 * 16)])
def test_many_chunks_and_rows_longer_than_a_chunk(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for recipe in ("1d", "2d"):
        assert_same(cpu_quant.quantize_weight(w, recipe=recipe), reference.quantize_weight(w, recipe=recipe))
    _, err = cpu_quant.quantize_weight_with_error(w)
    deq = reference.dequantize(reference.quantize_weight(w)).double()
    torch.testing.assert_close(err.err_sq, (deq - w.double()).square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("default_dtype", [torch.bfloat16, torch.float16])
def test_independent_of_the_default_dtype(default_dtype):
    """Engines set torch's default dtype to the model's (vLLM workers: bf16/fp16); scratch buffers
    must not follow it (a bf16 scratch viewed as int32 halves its last dim)."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = reference.quantize_weight(w)
    old = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        got = cpu_quant.quantize_weight(w)
    finally:
        torch.set_default_dtype(old)
    assert_same(got, want)


def test_dispatch_quantizes_cpu_weights_with_it(monkeypatch):
    """The dispatcher runs this quantizer (not the reference, which gives the same bits) on CPU weights."""
    w = torch.randn(64, 256).to(torch.bfloat16)
    calls, real = [], cpu_quant.quantize_weight
    monkeypatch.setattr(cpu_quant, "quantize_weight", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert_same(dispatch.quantize_weight_on(w, recipe="2d"), reference.quantize_weight(w, recipe="2d"))
    assert len(calls) == 1 and calls[0]["recipe"] == "2d"


def test_infinite_amax_is_refused():
    """The reference turns an infinite given amax into NaN scale products (0 * inf); refused here."""
    with pytest.raises(ValueError, match="amax: must be finite"):
        cpu_quant.quantize_weight(torch.ones(4, 32), amax=torch.tensor(float("inf")))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_raises_like_the_reference(bad, dtype):
    w = torch.randn(33, 64).to(dtype)
    w[17, 40] = bad
    with pytest.raises(ValueError) as want:
        reference.quantize_weight(w)
    with pytest.raises(ValueError) as got:
        cpu_quant.quantize_weight(w)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("w, kwargs, error", [
    (torch.zeros(4, 32, dtype=torch.int32), {}, TypeError),
    (torch.zeros(4, 24), {}, ValueError),
    (torch.zeros(32), {}, ValueError),
    (torch.zeros(2, 2, 2, 32), {}, ValueError),
    (torch.zeros(4, 32), {"recipe": "3d"}, ValueError),
    (torch.zeros(4, 32), {"op_order": "cuda"}, ValueError),
])
def test_bad_arguments_raise_like_the_reference(w, kwargs, error):
    with pytest.raises(error) as want:
        reference.quantize_weight(w, **kwargs)
    with pytest.raises(error) as got:
        cpu_quant.quantize_weight(w, **kwargs)
    assert str(got.value) == str(want.value)
