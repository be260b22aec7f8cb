"""GPU kernels against the executable spec (`kernels.reference`), on the H200 (skipped without CUDA).

Quantization must be bit-identical (codes, scales, global scales; atol = rtol = 0) to the
reference run on the CPU (the spec, checked against vLLM's emulation there). GEMMs may
differ from the reference only by the order of FP32 additions; MoE additionally re-quantizes its
BF16 SwiGLU output, where a 1-ulp difference can move a code, so it is checked by relative error.
Run: `python3 -m pytest -q -m gpu tests/test_gpu_kernels.py` (README "GPU tests and benchmarks").
"""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.kernels import dispatch, reference
from nvfp4_sampler.kernels.format import NVFP4Tensor

pytestmark = pytest.mark.gpu

M_SIZES = (1, 3, 100, 200, 384, 4096)
K_SIZES = (16, 48, 2048, 4112, 7168)


@pytest.fixture(scope="module")
def tk():
    """The Triton modules (imported only on a GPU machine)."""
    from nvfp4_sampler.kernels import triton_gemm, triton_moe, triton_quant
    return triton_quant, triton_gemm, triton_moe


@pytest.fixture(scope="module")
def tv():
    """The decode GEMV module (imported only on a GPU machine)."""
    from nvfp4_sampler.kernels import triton_gemv
    return triton_gemv


def _activations(m: int, k: int, *, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows with magnitudes over many decades, a zero block, an all-zero row, ties and extremes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    span = 6 if dtype == torch.float16 else 20
    x = torch.randn(m, k, device="cuda", generator=g)
    x = x * torch.exp2(torch.randint(-span, span, (m, 1), device="cuda", generator=g).float())
    x[:, :16] = 0.0
    if m > 2 and k >= 32:
        x[1] = 0.0
        x[2, 16:32] = torch.tensor([6.0, -6.0, 0.25, -0.25, 0.75, 2.5, 5.0, -5.0, 1.25, 1.75, 3.5, 448.0,
                                    -448.0, 1e-30, -0.0, 3.0], device="cuda")
    return x.to(dtype)


def _assert_same(got: NVFP4Tensor, want: NVFP4Tensor) -> None:
    got, want = got.to("cpu"), want.to("cpu")
    assert torch.equal(got.codes, want.codes), f"codes differ at {(got.codes != want.codes).nonzero()[:5].tolist()}"
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8)), "block scales differ"
    assert torch.equal(got.global_scale, want.global_scale), "global scales differ"


@pytest.mark.parametrize("m", M_SIZES)
@pytest.mark.parametrize("k", K_SIZES)
def test_per_token_quantization_is_bit_exact(tk, m, k):
    tq = tk[0]
    x = _activations(m, k, seed=m * 131 + k)
    want = reference.quantize_per_token(x.cpu())
    _assert_same(tq.quantize_per_token(x), want)
    sw = tq.quantize_per_token_swizzled(x)
    assert torch.equal(sw.codes.cpu(), want.codes)
    assert torch.equal(sw.block_scales.view(torch.uint8).cpu(),
                       reference.swizzle_scales_128x4(want.block_scales).view(torch.uint8))
    assert torch.equal(sw.global_scale.cpu(), want.global_scale)
    exact = tq.quantize_per_token_exact(x)
    assert torch.equal(exact.values.float().cpu(), reference.dequantize_unscaled(want))
    assert torch.equal(exact.global_scale.cpu(), want.global_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_other_dtypes_and_strided_rows(tk, dtype):
    tq = tk[0]
    wide = _activations(200, 2048 + 64, seed=7, dtype=dtype)
    x = wide[:, 32:2048 + 32]                           # row stride != K
    _assert_same(tq.quantize_per_token(x), reference.quantize_per_token(x.cpu()))
    x3 = _activations(24, 512, seed=8, dtype=dtype).reshape(2, 12, 512)
    _assert_same(tq.quantize_per_token(x3), reference.quantize_per_token(x3.cpu()))


@pytest.mark.parametrize("m", (1, 100, 4096))
def test_per_tensor_quantization_is_bit_exact(tk, m):
    tq = tk[0]
    x = _activations(m, 2048, seed=m)
    _assert_same(tq.quantize_per_tensor(x), reference.quantize_per_tensor(x.cpu()))
    amax = torch.tensor(3.0)
    _assert_same(tq.quantize_per_tensor(x, amax=amax.cuda()), reference.quantize_per_tensor(x.cpu(), amax=amax))


@pytest.mark.parametrize("shape", [(100, 48), (384, 2048), (200, 7168), (4, 40, 64), (8, 768, 2048), (3, 2048, 768)])
@pytest.mark.parametrize("recipe", ["1d", "2d"])
def test_weight_quantization_is_bit_exact(tk, shape, recipe):
    tq = tk[0]
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    w = (torch.randn(shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w[..., 0, :16] = 0.0
    want = reference.quantize_weight(w.cpu(), recipe=recipe)
    _assert_same(tq.quantize_weight(w, recipe=recipe), want)
    _assert_same(dispatch.quantize_weight_on(w, recipe=recipe), want)
    amax = w.abs().float().amax(dim=(-2, -1)) * 2
    _assert_same(tq.quantize_weight(w, recipe=recipe, amax=amax, check_finite=False),
                 reference.quantize_weight(w.cpu(), recipe=recipe, amax=amax.cpu()))
    sw = tq.quantize_weight_swizzled(w, recipe=recipe)
    scales = want.block_scales if w.dim() == 3 else want.block_scales[None]
    swz = torch.stack([reference.swizzle_scales_128x4(s) for s in scales])
    assert torch.equal(sw.block_scales.view(torch.uint8).cpu(), swz.view(torch.uint8).reshape(sw.block_scales.shape))
    assert torch.equal(sw.codes.cpu(), want.codes)


@pytest.mark.parametrize("share", [1, 2])
def test_weight_into_computes_the_amax_of_many_experts(tk, share):
    """quantize_weight_into without an amax (reduced first, one per `share` experts) on many experts, twice in
    a row: the bits of the given-amax kernel with reference.weight_amax's amax, and that amax returned."""
    tq = tk[0]
    from nvfp4_sampler.kernels.format import NVFP4Tensor
    g = torch.Generator(device="cuda").manual_seed(share)
    w = (torch.randn(64, 768, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w[7] *= 1000.0
    w[9] = 0.0
    amax = reference.weight_amax(w).view(-1, share).amax(1)
    want = tq.quantize_weight(w, amax=amax.repeat_interleave(share), check_finite=False)
    for _ in range(2):
        out = NVFP4Tensor(torch.empty_like(want.codes), torch.empty_like(want.block_scales),
                          torch.empty_like(want.global_scale))
        assert torch.equal(tq.quantize_weight_into(w, out, share=share), amax)
        _assert_same(out, want)


def test_weight_quantization_rejects_non_finite(tk):
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        tk[0].quantize_weight(w)


def _weight(n: int, k: int, *, seed: int, per_row: bool) -> NVFP4Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = reference.quantize_weight((torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16))
    if per_row:
        w = w.replace(global_scale=w.global_scale * (0.5 + torch.rand(n, device="cuda", generator=g)))
    return w


def _assert_fp32_reorder_close(got: torch.Tensor, a: NVFP4Tensor, w: NVFP4Tensor, want: torch.Tensor,
                               bias: torch.Tensor) -> None:
    """|got - want| within the bound of reordered FP32 sums: K * 2^-23 * (|a| @ |w|^T), plus one
    rounding of the bias addition."""
    mag = reference.dequantize(a).abs() @ reference.dequantize(w).abs().T
    bound = a.shape[1] * 2.0 ** -23 * mag + 2.0 ** -22 * (want.abs() + bias.abs()) + 1e-37
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max error/bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("m,n,k", [(1, 2048, 4096), (3, 5120, 2048), (16, 384, 7168), (100, 200, 48), (384, 4096, 3072)])
@pytest.mark.parametrize("split_k", [1, 4])
def test_packed_gemm_matches_reference(tk, m, n, k, split_k):
    tq, tg, _ = tk
    x = _activations(m, k, seed=n + k)
    a = tq.quantize_per_token(x)
    w = _weight(n, k, seed=m, per_row=split_k == 4)
    bias = torch.randn(n, device="cuda")
    want = reference.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.float32)
    cfg = dict(tg.packed_config(m, n, k), SPLIT_K=split_k)
    for _ in range(2):                                    # the second run checks the workspace was re-zeroed
        out = torch.full((m, n), float("nan"), device="cuda")
        tg.launch_w4a4(a, w, out, bias=bias, config=cfg)
        _assert_fp32_reorder_close(out, a, w, want, bias)


@pytest.mark.parametrize("m,n,k", [(1, 2048, 4096), (2, 5120, 2048), (3, 384, 7168), (4, 200, 48), (9, 1000, 2048),
                                   (16, 4096, 12288)])
@pytest.mark.parametrize("split_k", [1, 8])
@pytest.mark.parametrize("fused", [True, False])
def test_gemv_matches_reference(tv, m, n, k, split_k, fused):
    """The decode kernel, activation quantized in the same launch (fused) or before it."""
    x = _activations(m, k, seed=n + k + 1)
    a = reference.quantize_per_token(x)
    w = _weight(n, k, seed=m, per_row=split_k == 8)
    bias = torch.randn(n, device="cuda")
    want = reference.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.float32)
    for _ in range(2):                                    # the second run checks the counters were re-zeroed
        out = torch.full((m, n), float("nan"), device="cuda")
        tv.launch_w4a4_gemv(x, w, out, bias=bias, fused=fused, config=dict(tv.gemv_config(m, n, k), SPLIT_K=split_k))
        _assert_fp32_reorder_close(out, a, w, want, bias)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("given_amax", [False, True])
def test_gemv_per_tensor_matches_reference(tv, fused, given_amax):
    m, n, k = 5, 1000, 4096
    x = _activations(m, k, seed=21)
    amax = x.abs().float().amax() * 1.5 if given_amax else None
    a = reference.quantize_per_tensor(x, amax=amax)
    w = _weight(n, k, seed=22, per_row=True)
    bias = torch.zeros(n, device="cuda")
    want = reference.nvfp4_gemm(a, w, out_dtype=torch.float32)
    out = torch.empty((m, n), device="cuda")
    tv.launch_w4a4_gemv(x, w, out, scaling="per_tensor", amax=amax, fused=fused)
    _assert_fp32_reorder_close(out, a, w, want, bias)


def test_inline_ptx_equals_portable_arithmetic(tk, tv):
    """The inline-PTX decode (packed kernel) and packed-FP16 block dots (gemv kernel) produce the
    same exact values as the portable Triton arithmetic (the path the CPU interpreter checks)."""
    tq, tg, _ = tk
    a = tq.quantize_per_token(_activations(16, 4096, seed=11))
    w = _weight(512, 4096, seed=12, per_row=True)
    outs = []
    for use_asm in (True, False):
        out = torch.empty(16, 512, device="cuda")
        tg.launch_w4a4(a, w, out, config=dict(tg.packed_config(16, 512, 4096), SPLIT_K=1), use_asm=use_asm)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "packed"
    x = _activations(3, 4096, seed=13)
    outs = []
    for use_asm in (True, False):
        out = torch.empty(3, 512, device="cuda")
        tv.launch_w4a4_gemv(x, w, out, config=dict(tv.gemv_config(3, 512, 4096), SPLIT_K=1), use_asm=use_asm)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "gemv"


@pytest.mark.parametrize("m", M_SIZES)
@pytest.mark.parametrize("path", ["gemv", "packed", "bf16", "exact"])
def test_linear_paths_match_reference(tk, tv, m, path):
    tg = tk[1]
    if path == "gemv" and m > tv.GEMV_KERNEL_MAX_M:
        pytest.skip("the decode kernel serves M <= GEMV_KERNEL_MAX_M")
    n, k = 640, 2048
    x = _activations(m, k, seed=m + 5)
    x = x / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    w = _weight(n, k, seed=3, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    got = tg.linear(x, w, bias=bias, path=path)
    want = reference.linear(x, w, bias=bias)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("m", [1, 300])
def test_bf16_path_in_column_blocks_matches_reference(tk, m):
    """The "bf16" path over column blocks of its FP32 product (`block_bytes`: 128-column blocks, the last
    one partial; per-row global scales and the bias sliced with them) stays within the tolerance of
    `reference.linear`, in both weight layouts."""
    from nvfp4_sampler.kernels import cuda_mma
    tg = tk[1]
    n, k = 400, 2048
    x = _activations(m, k, seed=m + 21)
    x = x / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    w = _weight(n, k, seed=6, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = reference.linear(x, w, bias=bias).float()
    for wk in (w, cuda_mma.tile_weight(w)):
        got = tg._linear_bf16(x, wk, bias, torch.bfloat16, None, "vllm", block_bytes=4 * 128 * m)
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_exact_gemm_decoding_codes_matches_reference(tk, m):
    """The exact GEMM with the weight codes decoded inside the kernel (config W_CODES): within the
    tolerance of `reference.linear`, the PTX decode table and the portable arithmetic bit for bit, the
    "mma_tiled" layout's decode too (128-element K steps), and deterministic (tiles of both default configurations and, up to 64 rows, the split-K decode one)."""
    tg = tk[1]
    n, k = 640, 2048
    x = _activations(m, k, seed=m + 9)
    w = _weight(n, k, seed=5, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = reference.linear(x, w, bias=bias).float()
    a = tk[0].quantize_per_token_exact(x, dtype=torch.float16)
    configs = [dict(tg.EXACT_DENSE, W_CODES=True), dict(tg.EXACT_GROUPED, W_CODES=True)]
    if m <= 64:
        configs.append(tg.exact_small_config(m, n, k))                  # split-K 8 at this shape
    for cfg in configs:
        outs = []
        for use_asm in (True, False, True):
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tg.launch_exact(a, w, out, bias=bias, config=cfg, use_asm=use_asm)
            outs.append(out)
        torch.testing.assert_close(outs[0].float(), want, rtol=2 ** -7, atol=1e-3)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        if cfg["BLOCK_K"] % 128 == 0:                                   # the engines' "mma_tiled" codes
            from nvfp4_sampler.kernels import cuda_mma
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tg.launch_exact(a, cuda_mma.tile_weight(w), out, bias=bias, config=cfg)
            assert torch.equal(out, outs[0]), "mma_tiled codes decoded differently from ModelOpt's"


def test_exact_small_config_is_batch_invariant(tk):
    """`exact_small_config`'s split-K comes from the weight shape alone: the first m rows of a 64-row batch
    are the bits of the same rows computed in batches of 1-40 (BLOCK_M 16, 32, 64: the MMA's N changes,
    not any output's summation order) -- what a strict mode on this kernel would rest on."""
    tg = tk[1]
    n, k = 1024, 4096
    x = _activations(64, k, seed=17)
    w = _weight(n, k, seed=19, per_row=True)

    def run(rows):
        a = tk[0].quantize_per_token_exact(x[:rows], dtype=torch.float16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        tg.launch_exact(a, w, out, config=tg.exact_small_config(rows, n, k))
        return out

    full = run(64)
    for rows in (1, 5, 16, 17, 40):
        assert torch.equal(run(rows), full[:rows]), f"{rows} rows"


def test_dispatch_picks_triton(tk):
    tg = tk[1]
    assert dispatch.choose_backend(torch.device("cuda")).name == "triton_hopper"
    assert [tg.linear_path(m, "per_token") for m in (tg.GEMV_MAX_M, tg.PACKED_MAX_M, 4096)] == ["gemv", "packed", "bf16"]
    w = _weight(256, 512, seed=1, per_row=False)
    for m in (4, 64, 4096):
        x = _activations(m, 512, seed=m)
        torch.testing.assert_close(dispatch.linear(x, w).float(), reference.linear(x, w).float(), rtol=2 ** -7, atol=1e-3)
    x = _activations(8, 512, seed=2)
    torch.testing.assert_close(dispatch.linear(x, w, scaling="per_tensor").float(),
                               reference.linear(x, w, scaling="per_tensor").float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 5, 64, 700])
@pytest.mark.parametrize("per_row_scale", [False, True])
def test_moe_matches_reference(tk, tokens, per_row_scale):
    experts, hidden, inter, top_k = 16, 256, 128, 4
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    if per_row_scale:
        w13 = w13.replace(global_scale=w13.global_scale[:, None] * (0.5 + torch.rand(experts, 2 * inter, device="cuda", generator=g)))
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), top_k)
    want = reference.moe(x, w13, w2, topk_w, topk_ids).float()
    got = dispatch.moe(x, w13, w2, topk_w, topk_ids).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3g}"
    close = ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-2 * want.abs().max()).float().mean().item()
    assert close > 0.99, f"only {close:.4f} of the outputs within tolerance"


@pytest.mark.parametrize("m", (1, 100, 4096))
def test_per_token_quantization_with_given_amax_is_bit_exact(tk, m):
    """Tensor-parallel row-parallel layers pass the all-reduced amax of the whole token row."""
    tq = tk[0]
    x = _activations(m, 2048, seed=m + 3)
    g = torch.Generator(device="cuda").manual_seed(m)
    amax = x.abs().float().amax(-1) * (1 + 3 * torch.rand(m, device="cuda", generator=g))
    amax[0] = 0.0                                         # amax 0 -> S_enc 1, as in the spec
    want = reference.quantize_per_token(x.cpu(), row_amax=amax.cpu())
    _assert_same(tq.quantize_per_token(x, amax=amax), want)
    exact = tq.quantize_per_token_exact(x, amax=amax)
    assert torch.equal(exact.values.float().cpu(), reference.dequantize_unscaled(want))
    assert torch.equal(exact.global_scale.cpu(), want.global_scale)
    with pytest.raises(ValueError, match="amax"):
        tq.quantize_per_token(x, amax=amax[:-1] if m > 1 else amax.reshape(1, 1))


@pytest.mark.parametrize("m", (1, 16, 64, 384))
@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
def test_linear_with_given_amax_matches_reference(tk, tv, m, scaling):
    tg = tk[1]
    n, k = 640, 2048
    x = _activations(m, k, seed=m + 17)
    x = x / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    w = _weight(n, k, seed=4, per_row=True)
    if scaling == "per_token":
        amax = x.abs().float().amax(-1) * 2.5                # e.g. a wider row on other TP ranks
    else:
        amax = x.abs().float().amax() * 2.5
    want = reference.linear(x, w, scaling=scaling, amax=amax).float()
    assert not torch.equal(want, reference.linear(x, w, scaling=scaling).float())   # the override matters
    paths = [p for p in ("gemv", "packed", "bf16") if not (p == "gemv" and m > tv.GEMV_KERNEL_MAX_M)
             and not (p == "bf16" and scaling == "per_tensor")]
    for path in paths:
        got = tg.linear(x, w, scaling=scaling, amax=amax, path=path).float()
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3, msg=path)
    got = dispatch.linear(x, w, scaling=scaling, amax=amax).float()
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)


REPEATS = 50


@pytest.mark.parametrize("path,m,n,k", [("gemv", 1, 4096, 4096), ("gemv", 16, 6144, 4096), ("gemv", 4, 2048, 12288),
                                        ("packed", 32, 5120, 2048), ("packed", 64, 4096, 7168),
                                        ("bf16", 300, 2048, 4096), ("exact", 300, 2048, 4096)])
def test_linear_is_bitwise_deterministic(tk, path, m, n, k):
    """Identical inputs give bitwise identical outputs run to run (split-K planes added in a fixed
    order; no floating-point atomics)."""
    tg = tk[1]
    x = _activations(m, k, seed=m + n)
    w = _weight(n, k, seed=k, per_row=True)
    first = tg.linear(x, w, path=path)
    for _ in range(REPEATS):
        assert torch.equal(tg.linear(x, w, path=path), first)


def _moe_case(tokens: int, experts: int = 32, hidden: int = 1024, inter: int = 384, top_k: int = 8):
    """(x, w13, w2, topk_weights, topk_ids) of a random top-k MoE layer on the GPU, seeded by `tokens`."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), -1), top_k)
    return x, w13, w2, topk_w, topk_ids


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_moe_is_bitwise_deterministic(tk, tokens):
    x, w13, w2, topk_w, topk_ids = _moe_case(tokens)
    first = tk[2].moe(x, w13, w2, topk_w, topk_ids)
    for _ in range(REPEATS):
        assert torch.equal(tk[2].moe(x, w13, w2, topk_w, topk_ids), first)


@pytest.mark.parametrize("tokens", [1, 4])
def test_moe_pairs_pdl_changes_no_bit(tk, tokens):
    """w2's launch as a programmatic dependent of w13's (`PAIRS_PDL`): the same bits as an ordinary launch."""
    x, w13, w2, topk_w, topk_ids = _moe_case(tokens)
    plain = tk[2]._moe_pairs(x, w13, w2, topk_w, topk_ids, "vllm", config=dict(pdl=False))
    assert torch.equal(tk[2]._moe_pairs(x, w13, w2, topk_w, topk_ids, "vllm", config=dict(pdl=True)), plain)


def test_split_k_launches_count_in_the_device_tickets(tk, tv, monkeypatch):
    """With the device's tickets allocated (`cuda_mma.tickets`, at load time), the Triton split-K launches
    count in them instead of zero-filling a buffer each; they leave them zero and give the bits they give
    with a buffer of their own."""
    from nvfp4_sampler.kernels import cuda_mma
    x = _activations(4, 4096, seed=5)
    w = _weight(6144, 4096, seed=6, per_row=True)
    cfg = dict(tv.gemv_config(4, 6144, 4096), SPLIT_K=8)
    g = torch.Generator(device="cuda").manual_seed(7)
    xm = torch.randn(2, 1024, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(32, 768, 1024, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    w2 = reference.quantize_weight((torch.randn(32, 1024, 384, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(2, 32, device="cuda", generator=g), -1), 8)

    def run():
        out = torch.full((4, 6144), float("nan"), device="cuda")
        tv.launch_w4a4_gemv(x, w, out, fused=False, config=cfg)
        return out, tk[2].moe(xm, w13, w2, topk_w, topk_ids)

    with monkeypatch.context() as mp:
        mp.setattr(cuda_mma, "_TICKETS", {})
        own = run()
        assert tv._workspace(x.device, 1, 8)[1].numel() == 8 and not cuda_mma._TICKETS   # a buffer of its own
    shared = cuda_mma.tickets(x.device.index)
    assert tv._workspace(x.device, 1, 8)[1] is shared
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(run(), own))
    assert not shared.any(), "a launch left a ticket counted"


@pytest.mark.parametrize("m,k", [(1, 2048), (100, 4112), (4096, 7168)])
def test_te_op_order_quantizers_are_bit_exact(tk, m, k):
    """op_order="te": per token (computed and given amax), exact-BF16 rows, per tensor and weights
    1d / 2d bit for bit as `reference` in TransformerEngine's order (tests/test_reference_te.py
    checks that order against TE's arithmetic)."""
    tq = tk[0]
    x = _activations(m, k, seed=m + k)
    xc = x.cpu()
    amax = x.abs().float().amax(-1) * 1.25
    for given in (None, amax):
        want = reference.quantize_per_token(xc, row_amax=None if given is None else given.cpu(), op_order="te")
        _assert_same(tq.quantize_per_token(x, amax=given, op_order="te"), want)
        exact = tq.quantize_per_token_exact(x, amax=given, op_order="te")
        assert torch.equal(exact.values.float().cpu(), reference.dequantize_unscaled(want))
    _assert_same(tq.quantize_per_tensor(x, op_order="te"), reference.quantize_per_tensor(xc, op_order="te"))
    for recipe in ("1d", "2d"):
        _assert_same(tq.quantize_weight(x, recipe=recipe, op_order="te"),
                     reference.quantize_weight(xc, recipe=recipe, op_order="te"))


@pytest.mark.parametrize("m", (1, 4, 64, 384))
def test_te_op_order_linear_and_moe_match_reference(tk, tv, m):
    """Every linear path (gemv with the quantization fused, packed, bf16) and the MoE with
    op_order="te" against the reference in the same order (FP32 reordering bound for the linear)."""
    tg, tm = tk[1], tk[2]
    n, k = 640, 2048
    x = _activations(m, k, seed=m + 11)
    x = x / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    w = _weight(n, k, seed=4, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = reference.quantize_per_token(x.cpu(), op_order="te")
    want = reference.nvfp4_gemm(a, w.to("cpu"), bias=bias.cpu(), out_dtype=torch.float32)
    for path in ("gemv", "packed", "bf16"):
        if path == "gemv" and m > tv.GEMV_KERNEL_MAX_M:
            continue
        out = tg.linear(x.float(), w, bias=bias, op_order="te", path=path)
        _assert_fp32_reorder_close(out.cpu(), a, w.to("cpu"), want, bias.cpu().float())
    experts, hidden, inter = 8, 256, 128
    g = torch.Generator(device="cuda").manual_seed(m)
    xm = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.1)
                                    .to(torch.bfloat16), op_order="te")
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.1)
                                   .to(torch.bfloat16), op_order="te")
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(m, experts, device="cuda", generator=g), -1), 2)
    want = reference.moe(xm, w13, w2, topk_w, topk_ids, op_order="te").float()
    got = tm.moe(xm, w13, w2, topk_w, topk_ids, op_order="te").float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
