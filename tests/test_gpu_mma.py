"""The small-M tensor-core kernel (`kernels.cuda_mma`) against the spec, on the H200 (skipped without CUDA).

Compared with `reference.nvfp4_gemm` in FP32 on the same quantized operands (the activation quantized by
the reference on the CPU): every output within the FP32 reordering bound K * 2^-23 * (|a| @ |w|^T)
plus one rounding to the output dtype. Bitwise: two runs agree, and a token's row is the same alone,
in a batch of 16 and in a batch of 40 (batch invariance, what strict mode builds on).
"""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.kernels import reference
from nvfp4_sampler.kernels.format import NVFP4Tensor

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mods():
    from nvfp4_sampler.kernels import cuda_mma, triton_gemm, triton_quant
    ok, reason = cuda_mma.prepare(torch.device("cuda"))
    assert ok, reason
    return cuda_mma, triton_gemm, triton_quant


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), device="cuda",
                                                                               generator=g).float())
    x[:, :16] = 0.0
    if k >= 256:
        x[0, 128:144] = 1e-3          # a block far below the row's amax: small e4m3 scales
    return x.to(torch.bfloat16)


def _w(n: int, k: int, seed: int, per_row: bool) -> NVFP4Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    w[:, 16:32] *= 1e-4               # subnormal-range block scales
    w = reference.quantize_weight(w.to(torch.bfloat16))
    if per_row:
        w = w.replace(global_scale=w.global_scale * (0.5 + torch.rand(n, device="cuda", generator=g)))
    return w


def _check(got: torch.Tensor, x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None) -> None:
    a = reference.quantize_per_token(x.cpu()).to("cuda")
    b32 = None if bias is None else bias.float()
    want = reference.nvfp4_gemm(a, w, bias=b32, out_dtype=torch.float32)
    mag = reference.dequantize(a).abs() @ reference.dequantize(w).abs().T
    bound = x.shape[1] * 2.0 ** -23 * mag + 2.0 ** -22 * want.abs() + 1e-37
    half_ulp = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -11
    err = (got.float() - want).abs()
    limit = bound + half_ulp * (want.abs() + bound)
    assert bool((err <= limit).all()), f"max error/limit {(err / limit).max().item():.3g}"
    # most outputs are the correctly rounded reference value
    assert (got == want.to(got.dtype)).float().mean().item() > 0.98


@pytest.mark.parametrize("n,k", [(16, 128), (48, 384), (640, 2048), (96, 1152), (4096, 4096), (256, 12288)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 40, 64])
@pytest.mark.parametrize("tiled", [False, True])
def test_mma_matches_reference(mods, m, n, k, tiled):
    cuda_mma, _, tq = mods
    x = _x(m, k, seed=m * 7 + n + k)
    w = _w(n, k, seed=n + k, per_row=m % 2 == 1)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if m != 8 else None
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)
    wk = cuda_mma.tile_weight(w) if tiled else w
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cuda_mma.launch(a.values, a.global_scale, wk, out, bias=bias)
    _check(out, x, w, bias)
    again = torch.full_like(out, float("nan"))
    cuda_mma.launch(a.values, a.global_scale, wk, again, bias=bias)   # tickets were left at zero
    assert torch.equal(out, again), "not deterministic"
    if tiled:
        plain = torch.empty_like(out)
        cuda_mma.launch(a.values, a.global_scale, w, plain, bias=bias)
        assert torch.equal(out, plain), "the tiled layout changed the result"


@pytest.mark.parametrize("m", [1, 16, 40, 64, 100])
@pytest.mark.parametrize("tiled", [False, True])
def test_warps_tokens_per_cta_and_stages_do_not_change_the_result(mods, m, tiled):
    """`tiles`' rw (warps of 16 rows per CTA) and nt (token tiles of 8 per CTA) and the weight
    pipeline's depth are speed choices: every choice gives the same bits."""
    cuda_mma, _, tq = mods
    x, w = _x(m, 2048, seed=11), _w(640, 2048, seed=12, per_row=True)
    wk = cuda_mma.tile_weight(w) if tiled else w
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)
    outs = []
    for rw, stages, nt in [(1, 2, None), (4, 3, 1), (8, 3, 2), (16, 2, 4), (1, 8, 8), (4, 4, 8), (8, 6, None),
                           (16, 8, 8), (8, 3, 8)]:
        outs.append(torch.full((m, 640), float("nan"), device="cuda", dtype=torch.bfloat16))
        cuda_mma.launch(a.values, a.global_scale, wk, outs[-1], rw=rw, stages=stages, nt=nt, wgmma=False)
    _check(outs[0], x, w, None)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("m", [1, 9, 16, 40, 64, 100])
@pytest.mark.parametrize("n,k", [(640, 2048), (48, 384), (4096, 4096)])
def test_wgmma_variant_matches_reference_and_is_batch_invariant(mods, m, n, k):
    """`launch(wgmma=True)` (one warpgroup MMA per k16 step, the tokens read from shared memory through
    descriptors; N = 48 leaves warps of a warpgroup past N): within the reference's bound, deterministic,
    the same bits in both weight layouts and for every rw / nt / stages, and each row's bits the same
    alone as in the batch."""
    cuda_mma, _, tq = mods
    x, w = _x(m, k, seed=m + n + 5), _w(n, k, seed=n + 3, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)

    def run(wk, rows=slice(None), **opts):
        out = torch.full((a.values[rows].shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cuda_mma.launch(a.values[rows].contiguous(), a.global_scale[rows].contiguous(), wk, out, bias=bias, wgmma=True,
                        **opts)
        return out

    got = run(w)
    _check(got, x, w, bias)
    assert torch.equal(run(w), got), "not deterministic"
    assert torch.equal(run(cuda_mma.tile_weight(w)), got), "the tiled layout changed the result"
    for opts in (dict(rw=4, nt=1), dict(rw=16, nt=8, stages=2), dict(rw=8, nt=4, stages=6)):
        assert torch.equal(run(w, **opts), got), opts
    assert torch.equal(run(w, slice(m // 2, m // 2 + 1)), got[m // 2:m // 2 + 1]), "row alone"


def grouped_launch(cuda_mma, tq, k: int, seed: int):
    """A grouped (MoE) launch on 8 experts [256, k], 40 tokens x top-2 rows in `schedule_rows` order, rw = 4:
    run(**launch options) -> its fp32 rows."""
    from nvfp4_sampler.kernels import triton_moe
    experts, n, tokens, top_k = 8, 256, 40, 2
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = reference.quantize_weight((torch.randn(experts, n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16))
    a = tq.quantize_per_token_exact(_x(tokens * top_k, k, seed=seed + 1), dtype=torch.float16)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:top_k] for _ in range(tokens)])
    _, _, schedule = triton_moe.schedule_rows(ids, experts, 8 * cuda_mma.GROUPED_NT)

    def run(**opts):
        out = torch.full((tokens * top_k, n), float("nan"), device="cuda")
        cuda_mma.launch(a.values, a.global_scale, w, out, schedule=schedule, nt=cuda_mma.GROUPED_NT, rw=4, **opts)
        return out
    return run


def test_wgmma_variant_grouped(mods):
    """The grouped (MoE) launch of the wgmma variant: its fp32 rows within FP32 reordering noise of the mma.sync
    variant's (relative norm < 1e-5; the products are exact, only the summation order may differ), and
    deterministic."""
    cuda_mma, _, tq = mods
    run = grouped_launch(cuda_mma, tq, 1024, seed=3)
    outs = [run(wgmma=wgmma) for wgmma in (False, True, True)]
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 1e-5
    assert torch.equal(outs[1], outs[2])


def test_mma_fp16_output(mods):
    cuda_mma, _, tq = mods
    x = _x(5, 1024, seed=1).to(torch.float16)
    w = _w(128, 1024, seed=2, per_row=True)
    bias = torch.randn(128, device="cuda", dtype=torch.float16)
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)
    out = torch.empty(5, 128, device="cuda", dtype=torch.float16)
    cuda_mma.launch(a.values, a.global_scale, w, out, bias=bias)
    _check(out, x, w, bias)


@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 12288)])
def test_mma_is_batch_invariant(mods, n, k):
    """batch_invariant=True (strict mode): row r of a batch equals the same row computed alone, bitwise,
    whatever the batch size. The default takes `throughput_options` from 9 rows (at M <= 16 a longer slice on
    some shapes; not these): within the bound."""
    _, tg, _ = mods
    x = _x(40, k, seed=3)
    w = _w(n, k, seed=4, per_row=True)
    alone = torch.cat([tg.linear(x[i:i + 1], w, path="mma", batch_invariant=True) for i in range(40)])
    for m in (2, 7, 16, 40):
        assert torch.equal(tg.linear(x[:m], w, path="mma", batch_invariant=True), alone[:m]), f"batch {m}"
    assert torch.equal(tg.linear(x[5:21], w, path="mma", batch_invariant=True), alone[5:21]), "other companions"
    assert torch.equal(tg.linear(x[:16], w, path="mma"), alone[:16])          # up to 16 rows on these shapes
    _check(tg.linear(x, w, path="mma"), x, w, None)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_default_takes_a_longer_slice_at_9_to_16_rows(mods, n, k):
    """On 8B qkv and down (`cuda_mma.throughput_options`: 8 and 16 chunks a slice, clusters of 4 and 6) the
    default path at 9-16 rows launches the longer slice on tiled weights, as engines store them: within the
    reference's bound, the bits of that launch; up to 8 rows `config`'s slice."""
    cuda_mma, tg, tq = mods
    x, w0 = _x(16, k, seed=n + 1), _w(n, k, seed=n + 2, per_row=True)
    w = cuda_mma.tile_weight(w0)
    slices = cuda_mma.small_slices(x.device)                  # as `triton_gemm.linear` takes them (the H200's: 2, 4)

    def opt(m, n, k):
        return cuda_mma.throughput_options(m, n, k, slices=slices)

    assert opt(8, n, k) == {} and opt(9, n, k)["cps"] > cuda_mma.config(n, k)["CPS"]
    for m in (9, 16):
        got = tg.linear(x[:m], w, path="mma")
        a = tq.quantize_per_token_exact(x[:m], dtype=torch.float16)
        want = torch.empty_like(got)
        cuda_mma.launch(a.values, a.global_scale, w, want, **opt(m, n, k))
        assert torch.equal(got, want), m
        _check(got, x[:m], w0, None)


def test_linear_takes_mma_for_decode(mods):
    _, tg, _ = mods
    w = _w(256, 512, seed=5, per_row=False)
    assert [tg.linear_path(m, "per_token", w) for m in (1, 2, 16, 17, 64)] == ["gemv", "mma", "mma", "mma", "mma"]
    assert tg.linear_path(65, "per_token", w) == tg.linear_path(65, "per_token")           # past mma: the other paths
    assert tg.linear_path(1, "per_tensor", w) == "gemv"
    assert tg.linear_path(3, "per_token", _w(24, 512, seed=6, per_row=False)) == "gemv"    # N % 16 != 0
    x = _x(4, 512, seed=6)
    torch.testing.assert_close(tg.linear(x, w).float(), reference.linear(x.cpu(), w.to("cpu")).float().cuda(),
                               rtol=2 ** -7, atol=1e-3)


def test_tiled_weights_take_mma_at_every_decode_size_and_bf16_beyond(mods):
    _, tg, _ = mods
    from nvfp4_sampler.kernels import cuda_mma
    wt = cuda_mma.tile_weight(_w(256, 512, seed=5, per_row=False))
    assert [tg.linear_path(m, "per_token", wt) for m in (1, 2, 64, 65, 4096)] == ["mma"] * 3 + ["bf16"] * 2
    with pytest.raises(ValueError, match="mma_tiled"):
        tg.linear(_x(3, 512, seed=1), wt, path="gemv")


def test_tiled_weights_take_the_exact_gemm_from_exact_min_m(mods, monkeypatch):
    """With EXACT_MIN_M set (NVFP4_SAMPLER_EXACT_MIN_M, the e2e bench's --exact engine) "mma_tiled" weights
    take the exact Triton GEMM from that many tokens to MMA_MAX_M: within the reference's tolerance and the
    bits of the same GEMM on the ModelOpt codes."""
    _, tg, tq = mods
    from nvfp4_sampler.kernels import cuda_mma
    w = _w(640, 2048, seed=7, per_row=True)
    wt = cuda_mma.tile_weight(w)
    monkeypatch.setattr(tg, "EXACT_MIN_M", 33)
    assert [tg.linear_path(m, "per_token", wt) for m in (1, 32, 33, 64, 65)] == ["mma"] * 2 + ["exact"] * 2 + ["bf16"]
    bias = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    for m in (33, 64):
        x = _x(m, 2048, seed=m)
        got = tg.linear(x, wt, bias=bias)
        assert torch.equal(got, tg.linear(x, w, bias=bias, path="exact")), "tiled and ModelOpt codes differ"
        torch.testing.assert_close(got.float(), reference.linear(x, w, bias=bias).float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("n,k", [(48, 384), (640, 2048), (256, 12288)])
def test_dequantize_tiled_equals_the_modelopt_dequantizer(mods, n, k):
    cuda_mma, tg, _ = mods
    w = _w(n, k, seed=n + k, per_row=True)
    assert torch.equal(cuda_mma.dequantize(cuda_mma.tile_weight(w)), tg.dequantize_exact(w))


@pytest.mark.parametrize("m", [1, 16, 64, 65, 300])
def test_hopper_mma_backend_linear(mods, m):
    """The backend engines pick for dense layers: tiled weights, mma up to 64 tokens (M = 1 included),
    the exact-BF16 path beyond; within the bound of the reference, and each row batch-invariant up to 16
    on this shape (`cuda_mma.throughput_options` changes the split-K slice above, and from 9 rows on some)."""
    cuda_mma, _, _ = mods
    from nvfp4_sampler.kernels import dispatch
    x, w = _x(m, 2048, seed=21), _w(640, 2048, seed=22, per_row=True)
    be = dispatch.choose_backend("cuda", req=dispatch.Requirements("linear", k=2048, rows=(512, 128)))
    assert be.name == "hopper_mma"
    bias = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    got = be.linear(x, cuda_mma.tile_weight(w), bias=bias, scaling="per_token")
    _check(got, x, w, bias)
    if m <= 16:
        one = be.linear(x[m // 2:m // 2 + 1], cuda_mma.tile_weight(w), bias=bias, scaling="per_token")
        assert torch.equal(one, got[m // 2:m // 2 + 1])


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("per_row_scale", [False, True])
def test_grouped_kernel_moe_matches_reference_and_is_deterministic(mods, tokens, per_row_scale):
    """`triton_moe.moe(path="mma")`: the kernel over each expert's 8-row tiles (`schedule`), fp32 out,
    against `reference.moe` with the bound the other MoE paths meet; two runs and a CUDA-graph replay
    give the same bits."""
    from nvfp4_sampler.kernels import triton_gemm, triton_moe

    experts, hidden, inter, top_k = 16, 256, 128, 4
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.1))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.1))
    if per_row_scale:
        w13 = w13.replace(global_scale=w13.global_scale[:, None] * (0.5 + torch.rand(experts, 2 * inter, device="cuda",
                                                                                     generator=g)))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), -1), top_k)
    want = reference.moe(x, w13, w2, topk_w, topk_ids).float()
    got = triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="mma")
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3g}"
    close = ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-2 * want.abs().max()).float().mean().item()
    assert close > 0.99, f"only {close:.4f} of the outputs within tolerance"
    assert torch.equal(triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="mma"), got)
    exact = triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="exact")   # FP16 wgmma tiles of 64 rows (forced)
    assert ((exact.float() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="exact"), exact)
    for codes in (dict(triton_gemm.EXACT_GROUPED, W_CODES=True),        # the codes decoded inside the GEMM,
                  dict(triton_gemm.EXACT_GROUPED, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                       W_CODES=True)):                                  # 64- and 16-row expert tiles
        decoded = triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, "vllm", gemm="exact", config=codes)
        assert ((decoded.float() - want).norm() / want.norm()).item() < 1e-2
        assert torch.equal(triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, "vllm", gemm="exact", config=codes),
                           decoded)
    for nt in (2, 4):                                                   # more token tiles per expert tile: same bits
        assert torch.equal(triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, "vllm", nt=nt), got), f"nt={nt}"
    default = triton_moe.moe_path(tokens * top_k, x, w13, w2)         # pairs to 64, mma to 2048, exact beyond
    assert default == {1: "pairs", 5: "pairs", 64: "mma", 300: "mma"}[tokens]
    assert triton_moe.moe_path(triton_moe.MMA_MAX_PAIRS + 1, x, w13, w2) == "exact"
    if default == "mma":
        assert torch.equal(triton_moe.moe(x, w13, w2, topk_w, topk_ids), got)
    graph = torch.cuda.CUDAGraph()                    # as engines run decode: captured once, replayed
    with torch.cuda.graph(graph):
        captured = triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="mma")
    captured.zero_()
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.parametrize("tokens", [300, 3000])
def test_exact_moe_defaults_match_reference_and_read_token_rows(mods, tokens):
    """The "exact" path with `exact_config`'s forms for the pair count (300 tokens: 128-row tiles; 3000: 256-row
    tiles, w13's gate and up rows interleaved; the codes decoded in both GEMMs) against
    `reference.moe`, deterministic; w13's GEMM reading each pair's token row through an index (x quantized once
    a token) gives the bits of the rows quantized in pair order; the dequantization's PTX decode gives the
    portable decode's bits."""
    from nvfp4_sampler.kernels import triton_gemm, triton_moe, triton_quant

    experts, hidden, inter, top_k = 16, 256, 128, 4
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.1))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.1))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), -1), top_k)
    want = reference.moe(x, w13, w2, topk_w, topk_ids).float()
    got = triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="exact")
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(triton_moe.moe(x, w13, w2, topk_w, topk_ids, path="exact"), got)
    cfg = triton_moe.exact_config(tokens * top_k, w13, w2)["w13"]
    order, _, schedule = triton_moe.schedule_rows(topk_ids, experts, cfg["BLOCK_M"])
    gathered = triton_quant.quantize_per_token_exact(x, dtype=torch.float16, rows=order // top_k)
    once = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
    outs = [torch.full((tokens * top_k, inter), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    triton_gemm.launch_exact(gathered, w13, outs[0], schedule=schedule, swiglu=True, config=cfg)
    triton_gemm.launch_exact(once, w13, outs[1], schedule=schedule, swiglu=True, config=cfg, a_index=order // top_k)
    assert torch.equal(outs[0], outs[1])
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(triton_gemm.dequantize_exact(w13, dtype), triton_gemm.dequantize_exact(w13, dtype, use_asm=False))
    h = triton_quant.quantize_per_token_exact(outs[0], dtype=torch.float16)
    for w, a, swiglu, n in ((w13, once, True, inter), (w2, h, False, hidden)):   # the codes decoded to value * 2^-14
        both = []                                                      # (the sum times 2^14): the FP16 copy's bits
        for w_codes in (True, False):                                  # at equal tiles
            both.append(torch.full((tokens * top_k, n), float("nan"), device="cuda",
                                   dtype=torch.bfloat16 if swiglu else torch.float32))
            triton_gemm.launch_exact(a, w, both[-1], schedule=schedule, swiglu=swiglu, a_index=order // top_k if swiglu
                                     else None, config=dict(cfg, W_CODES=w_codes, **({"num_stages": 2} if
                                                            cfg["BLOCK_M"] == 256 else {})))   # FP16 tiles: smem
        assert torch.equal(both[0], both[1]), f"{'w13' if swiglu else 'w2'}: codes and FP16 copy differ"


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 8, 128), (64, 8, 128), (256, 8, 128), (33, 4, 60), (600, 8, 256)])
def test_moe_glue_kernels_match_their_torch_forms(mods, tokens, top_k, experts):
    """The tensor-core MoE's one-launch pieces on the GPU: `schedule_rows` equals `moe_schedule` (sorted
    order, tiles, inverse), `combine` the weighted slot sum, the gathered quantizer the quantizer of the
    gathered rows bitwise, the SwiGLU quantizer that of torch's SwiGLU rounded to bf16 (>= 99% of the values;
    the exponentials may differ in the last bit)."""
    from nvfp4_sampler.kernels import triton_moe
    _, _, tq = mods
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.topk(torch.rand(tokens, experts, device="cuda", generator=g), top_k).indices
    order, pos, sched = triton_moe.schedule_rows(ids, experts, 8)
    o_ref, e_ref, s_ref, end_ref = triton_moe.moe_schedule(ids, experts, 8)
    assert torch.equal(order.long(), o_ref) and torch.equal(sched, torch.stack([e_ref, s_ref, end_ref]))
    assert torch.equal(order.long()[pos.long()], torch.arange(ids.numel(), device="cuda"))
    y = torch.randn(ids.numel(), 2048, device="cuda", generator=g)
    w = torch.rand(tokens, top_k, device="cuda", generator=g)
    want = (y[pos.long()].view(tokens, top_k, -1) * w[..., None]).sum(1)
    torch.testing.assert_close(triton_moe.combine(y, pos, w, torch.float32), want, rtol=top_k * 2 ** -23, atol=1e-6)
    x = _x(tokens, 2048, seed=tokens)
    rows = order // top_k
    got = tq.quantize_per_token_exact(x, rows=rows, dtype=torch.float16)
    ref = tq.quantize_per_token_exact(x.index_select(0, rows), dtype=torch.float16)
    assert torch.equal(got.values, ref.values) and torch.equal(got.global_scale, ref.global_scale)
    h = torch.randn(ids.numel(), 2 * 768, device="cuda", generator=g) * 4
    got = tq.quantize_per_token_exact(h, swiglu=torch.bfloat16, dtype=torch.float16)
    act = (torch.nn.functional.silu(h[:, :768]) * h[:, 768:]).to(torch.bfloat16)
    ref = tq.quantize_per_token_exact(act, dtype=torch.float16)
    assert (got.values == ref.values).float().mean().item() >= 0.99


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("n,k", [(640, 2048), (4096, 4096), (2048, 12288)])
@pytest.mark.parametrize("wgmma", [False, True])
def test_activation_codes_give_the_rows_bits(mods, monkeypatch, m, n, k, wgmma):
    """`launch(codes, S_dec, w, out, x_scales=scales)` on the per-token quantizer's codes and block scales
    (`quantize_per_token`; X_CODES: decoded as the CTA stages them): the bits of the same launch on the exact
    FP16 rows, with the default tiles and `throughput_options`' (persistent, 16 warps), split-K pulled, pushed
    and through global planes, in a CUDA graph too; and the linear path with the switch off and on."""
    cuda_mma, triton_gemm, tq = mods
    x, w = _x(m, k, seed=m + 3 * k), cuda_mma.tile_weight(_w(n, k, seed=n + 1, per_row=False))
    rows, codes = tq.quantize_per_token_exact(x, dtype=torch.float16), tq.quantize_per_token(x)
    assert torch.equal(codes.global_scale, rows.global_scale)
    options = cuda_mma.throughput_options(m, n, k, warpgroup=True) | {"wgmma": wgmma} if wgmma else {"wgmma": False}
    if wgmma and options.get("rw", cuda_mma.tiles(m)[1]) % 4:
        options["rw"] = 4 * -(-options.get("rw", cuda_mma.tiles(m)[1]) // 4)
    run = lambda out, a, **kw: cuda_mma.launch(a.codes if a is codes else a.values, a.global_scale, w, out,  # noqa: E731
                                               x_scales=a.block_scales if a is codes else None, **options, **kw)
    for split in (dict(cluster=True, push=False), dict(cluster=True, push=True, persist=False), dict(cluster=False)):
        want, got = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        run(want, rows, **split)
        run(got, codes, **split)
        assert torch.equal(got, want), split
    want, out = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    run(want, rows)
    with torch.cuda.graph(graph):
        run(out, codes)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="x_scales"):
        cuda_mma.launch(codes.codes, codes.global_scale, w, out, x_scales=codes.block_scales[:, :-1], **options)
    monkeypatch.setattr(cuda_mma, "X_CODES", False)
    want = triton_gemm.linear(x, w, path="mma")
    monkeypatch.setattr(cuda_mma, "X_CODES", True)
    assert torch.equal(triton_gemm.linear(x, w, path="mma"), want)
