"""The Triton kernels' arithmetic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The interpreter runs the kernels' portable path (no inline PTX): the quantizers in both op orders
(vLLM's and TransformerEngine's, bit for bit), the same exact block products, split-K planes and
epilogue as on the GPU, so the numerics are checked in CI against the spec (`kernels.reference`).
What only the GPU checks: the packed-FP16 inline PTX (`_DOT16`) and the `prmt` decode, which
tests/test_gpu_kernels.py compares bitwise with this portable path.
The checks run in a child process because TRITON_INTERPRET must be set before triton compiles.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nvfp4_sampler.kernels import triton_quant  # noqa: E402


def _bound(a, w, want, bias):
    """FP32 reordering bound: K * 2^-23 * (|a| @ |w|^T) plus one rounding of the bias addition."""
    from nvfp4_sampler.kernels import reference
    mag = reference.dequantize(a).abs() @ reference.dequantize(w).abs().T
    return a.shape[1] * 2.0 ** -23 * mag + 2.0 ** -22 * (want.abs() + bias.abs()) + 1e-37


def _case(m: int, n: int, k: int, *, seed: int):
    from nvfp4_sampler.kernels import reference
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())
    x[:, :16] = 0.0                                                   # a zero block
    w = reference.quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    w = w.replace(global_scale=w.global_scale * (0.5 + torch.rand(n, generator=g)))
    return x.to(torch.bfloat16), w, torch.randn(n, generator=g)


def _activations(dtype: torch.dtype, *, seed: int) -> torch.Tensor:
    """[6, 160] rows whose amax spans 2^-40 .. 2^12: a zero row, a row under TE's 1e-12 amax floor,
    a zero block, E2M1 ties (x = 0.25, 0.75 ... of the block's scale) and random values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 160, generator=g) * torch.exp2(torch.tensor([0.0, -8.0, 12.0, -40.0, 3.0, 0.0]))[:, None]
    x[0] = 0.0
    x[2, 16:32] = 0.0
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0] * 8)
    return x.to(dtype)


def _order_sensitive() -> list[torch.Tensor]:
    """Inputs on which the two op orders differ (tests/test_reference_te.py): the E4M3 tie (amax 10,
    block amax 3.75: vLLM order 176, TE 160), a block whose scale underflows to 0 (TE per tensor
    saturates its codes, per row zeroes them), and heavy-tailed rows with zero blocks."""
    from tests.test_reference_te import heavy_tailed
    tie = torch.zeros(2, 32)
    tie[:, 0], tie[:, 16] = 10.0, 3.75
    underflow = torch.zeros(2, 32)
    underflow[:, 0], underflow[:, 16:] = 1000.0, 1e-6
    return [tie, underflow, heavy_tailed(32, 256, torch.bfloat16, 0)]


@triton.jit
def _rounding_kernel(v_ptr, code_ptr, q_ptr, e4m3_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs)
    code, q = triton_quant._e2m1_rne(v)
    tl.store(code_ptr + offs, code)
    tl.store(q_ptr + offs, q)
    tl.store(e4m3_ptr + offs, triton_quant._e4m3_rne(tl.minimum(tl.abs(v), 448.0)).to(tl.uint8, bitcast=True))


def check_roundings() -> None:
    """The quantizers' two roundings against the spec: `triton_quant._e2m1_rne` against its thresholds
    and table (`reference.e2m1_encode`, `e2m1_decode`), `_e4m3_rne` against torch's float8_e4m3fn
    rounding; on every fp32 from 2^-12 (under half E4M3's least subnormal; E2M1 is 0 below 2^-2) to 6,
    the negatives of those from 2^-4, every 7th from 6 to 448 (E2M1 saturated, E4M3's top binades), and
    every 4099th below 2^-12 and above 448, 0 and -0 among them."""
    import numpy as np

    from nvfp4_sampler.kernels import reference
    at = {v: int(np.float32(v).view(np.int32)) for v in (2.0 ** -12, 2.0 ** -4, 6.0, 448.0)}
    ranges = [(at[2.0 ** -12], at[2.0 ** -4], 1, False), (at[2.0 ** -4], at[6.0] + 1, 1, True),
              (at[6.0], at[448.0] + 1, 7, False), (0, at[2.0 ** -12], 4099, True), (at[448.0], 0x7F7FFFFF, 4099, True)]
    block = 1 << 16
    for lo, hi, step, both_signs in ranges:
        for start in range(lo, hi, step << 23):
            v = torch.from_numpy(np.arange(start, min(start + (step << 23), hi), step, dtype=np.int32).view(np.float32))
            v = torch.cat([v, -v]) if both_signs else v
            v = torch.nn.functional.pad(v, (0, -v.numel() % block))
            code, q, e4m3 = (torch.empty(v.shape, dtype=torch.int32), torch.empty_like(v),
                             torch.empty(v.shape, dtype=torch.uint8))
            _rounding_kernel[(v.numel() // block,)](v, code, q, e4m3, BLOCK=block)
            want = reference.e2m1_encode(v)
            bad = (code != want.int()).nonzero()[:4, 0]
            assert not bad.numel(), f"E2M1 code of {v[bad].tolist()}: {code[bad].tolist()} != {want[bad].tolist()}"
            assert torch.equal(q.view(torch.int32), reference.e2m1_decode(want).view(torch.int32)), "E2M1 values"
            want = v.abs().clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            bad = (e4m3 != want).nonzero()[:4, 0]
            assert not bad.numel(), f"E4M3 of {v[bad].tolist()}: {e4m3[bad].tolist()} != {want[bad].tolist()}"


def check_quantizers(op_order: str) -> None:
    """Every Triton quantizer bit for bit against `reference` in `op_order`: per token (computed
    and given amax, fp32/bf16/fp16 input), per tensor, exact-BF16 rows, weights 1d / 2d / experts."""
    from nvfp4_sampler.kernels import reference, triton_quant
    from tests.test_cpu_quant import assert_same
    for x in _order_sensitive():
        for scaling in ("per_token", "per_tensor"):
            quantize = triton_quant.quantize_per_token if scaling == "per_token" else triton_quant.quantize_per_tensor
            assert_same(quantize(x, op_order=op_order), reference.quantize_activations(x, scaling=scaling,
                         op_order=op_order), f"{scaling} {tuple(x.shape)} {op_order}")
        assert_same(triton_quant.quantize_weight(x, op_order=op_order),
                     reference.quantize_weight(x, op_order=op_order), f"weight {tuple(x.shape)} {op_order}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _activations(dtype, seed=1)
        for amax in (None, x.abs().float().amax(-1) * 1.5):
            want = reference.quantize_per_token(x, row_amax=amax, op_order=op_order)
            assert_same(triton_quant.quantize_per_token(x, amax=amax, op_order=op_order), want,
                         f"per token {dtype} amax={amax is not None} {op_order}")
            rows = triton_quant.quantize_per_token_exact(x, amax=amax, op_order=op_order)
            assert torch.equal(rows.values.float(), reference.dequantize_unscaled(want)), f"exact bf16 {op_order}"
            assert torch.equal(rows.global_scale, want.global_scale), f"exact bf16 S_dec {op_order}"
            rows16 = triton_quant.quantize_per_token_exact(x, amax=amax, op_order=op_order, dtype=torch.float16)
            assert rows16.values.dtype == torch.float16          # the cuda_mma operand: exact in FP16 too
            assert torch.equal(rows16.values.float(), reference.dequantize_unscaled(want)), f"exact fp16 {op_order}"
        for amax in (None, torch.tensor(7.0)):
            assert_same(triton_quant.quantize_per_tensor(x, amax=amax, op_order=op_order),
                         reference.quantize_per_tensor(x, amax=amax, op_order=op_order),
                         f"per tensor {dtype} {op_order}")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(3, 40, 96, generator=g) * torch.exp2(torch.randint(-20, 4, (3, 40, 1), generator=g).float()))
    w = w.to(torch.bfloat16)
    for recipe in ("1d", "2d"):
        for ws, amax in ((w[0], None), (w, None), (w, torch.tensor([9.0, 2.0, 3.0]))):
            assert_same(triton_quant.quantize_weight(ws, recipe=recipe, amax=amax, op_order=op_order),
                         reference.quantize_weight(ws, recipe=recipe, amax=amax, op_order=op_order),
                         f"weight {tuple(ws.shape)} {recipe} {op_order}")


def check_gemv(op_order: str) -> None:
    """Decode kernel with the activation quantized in its launch (in `op_order`): per token / per
    tensor, with and without an amax override, split-K 1 and 4, deterministic run to run."""
    from nvfp4_sampler.kernels import reference, triton_gemv
    for m, n, k, split_k, scaling, amax_mul in [(1, 64, 256, 1, "per_token", None), (3, 100, 512, 4, "per_token", None),
                                                 (3, 100, 512, 2, "per_tensor", None), (2, 70, 1024, 4, "per_token", 2.5),
                                                 (4, 64, 48, 1, "per_tensor", 3.0)]:
        x, w, bias = _case(m, n, k, seed=m * n + k)
        amax = None
        if amax_mul:
            amax = (x.abs().float().amax(-1) if scaling == "per_token" else x.abs().float().amax()) * amax_mul
        a = reference.quantize_activations(x, scaling=scaling, amax=amax, op_order=op_order)
        want = reference.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.float32)
        cfg = dict(triton_gemv.gemv_config(m, n, k), SPLIT_K=split_k)
        outs = []
        for _ in range(2):
            out = torch.full((m, n), float("nan"))
            triton_gemv.launch_w4a4_gemv(x, w, out, bias=bias, scaling=scaling, amax=amax, op_order=op_order,
                                         fused=True, config=cfg)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"gemv not deterministic {m, n, k, split_k}"
        err = (outs[0] - want).abs()
        assert bool((err <= _bound(a, w, want, bias)).all()), \
            f"gemv {m, n, k, split_k, scaling, amax_mul, op_order}: max err {err.max()}"


def check_packed_split_k() -> None:
    """Tensor-core kernel's split-K planes, added in a fixed order by the tile's last program."""
    from nvfp4_sampler.kernels import reference, triton_gemm
    m, n, k = 5, 96, 512
    x, w, bias = _case(m, n, k, seed=7)
    a = reference.quantize_per_token(x)
    want = reference.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.float32)
    cfg = dict(triton_gemm.packed_config(m, n, k), SPLIT_K=4)
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"))
        triton_gemm.launch_w4a4(a, w, out, bias=bias, config=cfg)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "packed split-K not deterministic"
    assert bool(((outs[0] - want).abs() <= _bound(a, w, want, bias)).all())


def check_scale_epilogue() -> None:
    """`scale_epilogue` into a column block of a wider output (the "bf16" path's blocks): the spec's two FP32
    scalings and the bias, rounded once, bit for bit (FP16 out: the interpreter truncates to BF16, where the
    GPU rounds to nearest even); nothing written outside the block."""
    from nvfp4_sampler.kernels import triton_gemm
    g = torch.Generator().manual_seed(7)
    m, n, wide, n0 = 70, 200, 520, 128
    acc = torch.randn(m, n, generator=g) * 1e3
    a_gs, w_gs = torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g)
    bias = torch.randn(n, generator=g).to(torch.float16)
    for gs, b in ((w_gs, bias), (w_gs[3], None)):
        out = torch.full((m, wide), 7.0, dtype=torch.float16)
        triton_gemm.scale_epilogue(acc, a_gs, gs, b, out[:, n0:n0 + n])
        want = (acc * a_gs[:, None]) * (gs if gs.dim() == 0 else gs[None, :])
        want = (want if b is None else want + b.float()).to(torch.float16)
        assert torch.equal(out[:, n0:n0 + n], want)
        assert (out[:, :n0] == 7).all() and (out[:, n0 + n:] == 7).all()


def check_linear_exact() -> None:
    """The exact GEMM (`launch_exact`, path "exact"), weights dequantized beforehand or decoded in the
    kernel (W_CODES), split-K planes added in order: every output of a grid with partial row and column tiles and a partial last group
    of row tiles written once, within the FP32 reordering bound of `reference.nvfp4_gemm`, per-row and
    per-tensor weight scales, with and without bias; `linear` returns it in x's dtype; deterministic."""
    from nvfp4_sampler.kernels import reference, triton_gemm, triton_quant
    m, n, k = 70, 96, 256
    x, w, bias = _case(m, n, k, seed=9)
    a = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
    want_a = reference.quantize_per_token(x)
    for weight, b, w_codes, split in ((w, bias, False, 1), (w.replace(global_scale=w.global_scale[0]), None, False, 1),
                                      (w, bias, True, 1), (w, bias, True, 3)):     # 3 slices of 2, 2, 0 K steps
        small = dict(triton_gemm.EXACT_DENSE, BLOCK_M=16, BLOCK_N=32, GROUP_M=2, W_CODES=w_codes,  # 5 x 3 tiles,
                     SPLIT_K=split)                                                             # groups 2 + 2 + 1
        want = reference.nvfp4_gemm(want_a, weight, bias=b, out_dtype=torch.float32)
        out = torch.full((m, n), float("nan"))
        triton_gemm.launch_exact(a, weight, out, bias=b, config=small)
        bound = _bound(want_a, weight, want, torch.zeros(n) if b is None else b)
        assert bool(((out - want).abs() <= bound).all()), "exact GEMM outside the FP32 reordering bound"
        again = torch.full((m, n), float("nan"))
        triton_gemm.launch_exact(a, weight, again, bias=b, config=small)
        assert torch.equal(out, again), "exact GEMM not deterministic"
    for split in (1, 3):                             # codes decoded to value * 2^-14, the sum times 2^14 in the
        outs = []                                    # epilogue: the bits of the FP16 copy's GEMM at equal tiles
        for w_codes in (False, True):
            outs.append(torch.full((m, n), float("nan")))
            triton_gemm.launch_exact(a, w, outs[-1], bias=bias, config=dict(triton_gemm.EXACT_DENSE, BLOCK_M=16,
                                     BLOCK_N=32, GROUP_M=2, W_CODES=w_codes, SPLIT_K=split))
        assert torch.equal(outs[0], outs[1]), "codes decoded in the GEMM differ from the FP16 copy's bits"
    from nvfp4_sampler.kernels import cuda_mma                        # codes in the engines' "mma_tiled" layout:
    tiled = cuda_mma.tile_weight(w)                                  # the same bits as ModelOpt's at equal tiles
    for split in (1, 2):
        cfg = dict(triton_gemm.EXACT_DENSE, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=2, W_CODES=True, SPLIT_K=split)
        outs = []
        for weight in (w, tiled):
            outs.append(torch.full((m, n), float("nan")))
            triton_gemm.launch_exact(a, weight, outs[-1], bias=bias, config=cfg)
        assert torch.equal(outs[0], outs[1]), "mma_tiled codes decoded differently from ModelOpt's"
    got = triton_gemm.linear(x[:9], w, bias=bias, path="exact")          # the default tiles: one partial tile
    assert got.dtype == torch.bfloat16
    want = reference.nvfp4_gemm(reference.quantize_per_token(x[:9]), w, bias=bias, out_dtype=torch.float32)
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-30)


def check_moe_pairs(op_order: str) -> None:
    """MoE decode (one GEMV program row per (token, expert) pair, SwiGLU and router weight fused),
    split-K 1 and 2, tokens quantized in `op_order`: the SwiGLU rows within one BF16 ulp of the
    spec's, w2's in-launch sum of each token's rows bitwise torch's in slot order, the layer within the re-quantization
    error of `reference.moe`, bitwise deterministic."""
    from nvfp4_sampler.kernels import reference, triton_gemv, triton_moe
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k, tokens = 6, 256, 64, 4, 2
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16))
    w13 = w13.replace(global_scale=w13.global_scale[:, None] * (0.5 + torch.rand(experts, 2 * inter, generator=g)))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, generator=g) * 0.1).to(torch.bfloat16))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), top_k)
    ids = topk_ids.reshape(-1).to(torch.int32)
    a = reference.quantize_per_token(x, op_order=op_order)
    for split_k in (1, 2):
        cfg = dict(triton_gemv.gemv_config(1, inter * ids.numel(), hidden), SPLIT_K=split_k)
        act = torch.empty((ids.numel(), inter), dtype=torch.bfloat16)
        triton_gemv.launch_w4a4_pairs(x, w13, act, pair_expert=ids, topk=top_k, swiglu=True, op_order=op_order,
                                      config=cfg)
        for p in range(ids.numel()):
            h = reference.nvfp4_gemm(reference._rows(a, torch.tensor([p // top_k])), reference._expert(w13, int(ids[p])),
                                     out_dtype=torch.float32)
            want = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)[0].float()
            assert bool(((act[p].float() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()), f"SwiGLU row {p}"
        # w2 with each token's pairs combined in the launch: its rows added in slot order from 0 in fp32, one rounding
        cfg2 = dict(triton_gemv.gemv_config(1, hidden * ids.numel(), inter), SPLIT_K=split_k)
        rows, rows2 = (torch.empty((ids.numel(), hidden)) for _ in range(2))
        out = torch.empty((tokens, hidden))                  # fp32 (the interpreter truncates to bf16)
        for y, combined in ((rows, None), (rows2, out)):
            triton_gemv.launch_w4a4_pairs(act, w2, y, pair_expert=ids, topk=1, row_weight=topk_w.reshape(-1).float(),
                                          op_order=op_order, config=cfg2, combined=combined)
        summed = torch.zeros(tokens, hidden)
        for j in range(top_k):
            summed = summed + rows.view(tokens, top_k, hidden)[:, j]
        assert torch.equal(rows, rows2) and torch.equal(out, summed), split_k
    want = reference.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order).float()
    got = triton_moe.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order)
    assert ids.numel() <= triton_moe.PAIRED_MAX_PAIRS
    assert torch.equal(got, triton_moe.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order)), "MoE not deterministic"
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 3e-2, f"MoE decode relative error {rel:.3g}"
    # strict (batch-invariant): each token's output is the same bits alone as beside the other token
    strict = triton_moe._moe_pairs(x, w13, w2, topk_w, topk_ids, op_order, strict=True)
    alone = [triton_moe._moe_pairs(x[t:t + 1], w13, w2, topk_w[t:t + 1], topk_ids[t:t + 1], op_order, strict=True)
             for t in range(tokens)]
    assert torch.equal(strict, torch.cat(alone)), "strict MoE depends on the batch"
    assert ((strict.float() - want).norm() / want.norm()).item() < 3e-2


def check_gathered_and_swiglu_rows(op_order: str) -> None:
    """quantize_per_token_exact(rows=...) gives the bits of quantizing x[rows]; swiglu=... those of
    quantizing (silu(gate) * up).to(bf16) computed in torch, up to one BF16 ulp of the intermediate (the
    interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest even; GPU: tests/test_gpu_mma)."""
    from nvfp4_sampler.kernels import triton_quant
    x = _activations(torch.bfloat16, seed=7)
    rows = torch.tensor([5, 0, 0, 3, 2, 5])
    got = triton_quant.quantize_per_token_exact(x, rows=rows, dtype=torch.float16, op_order=op_order)
    want = triton_quant.quantize_per_token_exact(x[rows], dtype=torch.float16, op_order=op_order)
    assert torch.equal(got.values, want.values) and torch.equal(got.global_scale, want.global_scale)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(5, 2 * 96, generator=g) * torch.exp2(torch.tensor([0.0, 4.0, -6.0, 9.0, 1.0]))[:, None]
    got = triton_quant.quantize_per_token_exact(h, swiglu=torch.bfloat16, dtype=torch.float16, op_order=op_order)
    gate, up = h[:, :96], h[:, 96:]
    act = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16)
    want = triton_quant.quantize_per_token_exact(act, dtype=torch.float16, op_order=op_order)
    assert (got.values == want.values).float().mean().item() >= 0.98
    assert torch.allclose(got.global_scale, want.global_scale, rtol=2 ** -7, atol=0.0)


def check_moe_exact(op_order: str) -> None:
    """path="exact" (tiles of 64 rows of one expert, FP16 tensor-core GEMM over exact values, fp32 out),
    with tiles that end inside an expert and an expert with no rows: its w13 GEMM equal to the rows'
    products computed in torch, its SwiGLU epilogue the bits of the SwiGLU quantizer on that fp32 output; the layer within 1% of the grouped path's (both round the SwiGLU
    intermediate to bf16, which this interpreter does by truncation: ~3% from `reference.moe` for every
    path here; on the GPU, tests/test_gpu_mma), deterministic."""
    from nvfp4_sampler.kernels import reference, triton_gemm, triton_moe, triton_quant
    g = torch.Generator().manual_seed(11)
    experts, hidden, inter, top_k, tokens = 5, 128, 64, 2, 70
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, generator=g) * 0.1).to(torch.bfloat16))
    w2 = w2.replace(global_scale=w2.global_scale[:, None] * (0.5 + torch.rand(experts, hidden, generator=g)))
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 4] = -1e9                                                # expert 4 gets no rows
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), top_k)
    order, _, schedule = triton_moe.schedule_rows(topk_ids, experts, triton_gemm.EXACT_GROUPED["BLOCK_M"])
    a = triton_quant.quantize_per_token_exact(x, dtype=torch.float16, rows=order // top_k, op_order=op_order)
    h13 = torch.full((tokens * top_k, 2 * inter), float("nan"))
    triton_gemm.launch_exact(a, w13, h13, schedule=schedule)
    expert = topk_ids.reshape(-1)[order.long()]
    w_deq = triton_gemm.dequantize_exact(w13, torch.float16).float()
    want = torch.einsum("pk,pnk->pn", a.values.float(), w_deq[expert]) * a.global_scale[:, None] * w13.global_scale[expert, None]
    assert torch.allclose(h13, want, rtol=hidden * 2 ** -23, atol=0.0)
    act = torch.full((tokens * top_k, inter), float("nan"), dtype=torch.bfloat16)   # SwiGLU in the epilogue:
    triton_gemm.launch_exact(a, w13, act, schedule=schedule, swiglu=True)            # the rows the swiglu
    fused = triton_quant.quantize_per_token_exact(act, dtype=torch.float16, op_order=op_order)   # quantizer
    apart = triton_quant.quantize_per_token_exact(h13, dtype=torch.float16, swiglu=torch.bfloat16,  # makes of
                                                  op_order=op_order)                                # h13
    assert torch.equal(fused.values, apart.values) and torch.equal(fused.global_scale, apart.global_scale)
    for block_n, w_codes in ((32, False), (64, True)):               # gate and up rows interleaved 8 by 8 in one
        mixed = torch.full_like(act, float("nan"))                    # tile, one accumulator: the same bits
        triton_gemm.launch_exact(a, w13, mixed, schedule=schedule, swiglu=True, config=dict(
            triton_gemm.EXACT_GROUPED, BLOCK_N=block_n, W_CODES=w_codes, INTERLEAVE=True))
        assert torch.equal(mixed, act), f"interleaved gate and up rows (BLOCK_N {block_n}) change the bits"
    decoded = torch.full_like(h13, float("nan"))                       # the codes decoded inside the kernel:
    triton_gemm.launch_exact(a, w13, decoded, schedule=schedule, config=dict(triton_gemm.EXACT_GROUPED, W_CODES=True))
    assert torch.equal(decoded, h13), "codes decoded in the GEMM differ from the FP16 copy's bits"   # equal tiles
    by_group = []                                    # the tile order (column tile major, GROUP_M row tiles
    for group_m in (0, 1, 3):                        # per column sweep) changes no bit: 4 column tiles
        by_group.append(torch.full_like(h13, float("nan")))
        triton_gemm.launch_exact(a, w13, by_group[-1], schedule=schedule,
                                 config=dict(triton_gemm.EXACT_GROUPED, BLOCK_N=32, GROUP_M=group_m))
    assert torch.allclose(by_group[0], want, rtol=hidden * 2 ** -23, atol=0.0)
    assert all(torch.equal(by_group[0], other) for other in by_group[1:])
    got = triton_moe.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order, path="exact")
    grouped = triton_moe.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order, path="grouped").float()
    assert ((got.float() - grouped).norm() / grouped.norm()).item() < 1e-2
    want = reference.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order).float()
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-2
    assert torch.equal(got, triton_moe.moe(x, w13, w2, topk_w, topk_ids, op_order=op_order, path="exact"))
    small = dict(triton_gemm.EXACT_GROUPED, BLOCK_M=16, BLOCK_N=64, W_CODES=True)   # 16-row tiles, codes decoded
    got16 = triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, op_order, gemm="exact", config=small)
    assert ((got16.float() - grouped).norm() / grouped.norm()).item() < 1e-2
    tall_pairs = triton_moe.EXACT_TALL_ROWS * experts                  # the default's 128-row tiles, GROUP_M 4
    assert {c["BLOCK_M"] for c in triton_moe.exact_config(tall_pairs - 1, w13, w2).values()} == {64}
    tall = triton_moe.exact_config(tall_pairs, w13, w2)
    assert {(c["BLOCK_M"], c["GROUP_M"]) for c in tall.values()} == {(128, 4)}
    got128 = triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, op_order, gemm="exact", config=tall)
    assert ((got128.float() - grouped).norm() / grouped.norm()).item() < 1e-2
    wide = triton_moe.exact_config(triton_moe.EXACT_WIDE_ROWS * experts, w13, w2)   # 256-row tiles only where
    assert {c["BLOCK_M"] for c in wide.values()} == {128}                        # both K steps fit (w2's K is 64)
    wide = {"w13": triton_moe.exact_form("w13", 256),                            # w13's 256-row form (interleaved)
            "w2": dict(triton_gemm.EXACT_GROUPED, BLOCK_M=256, BLOCK_N=64, num_warps=4, W_CODES=True)}
    got256 = triton_moe._moe_tiled(x, w13, w2, topk_w, topk_ids, op_order, gemm="exact", config=wide)
    assert ((got256.float() - grouped).norm() / grouped.norm()).item() < 1e-2
    once = triton_quant.quantize_per_token_exact(x, dtype=torch.float16, op_order=op_order)   # x quantized once a
    indexed = torch.full_like(act, float("nan"))                                          # token, each pair's row
    triton_gemm.launch_exact(once, w13, indexed, schedule=schedule, swiglu=True, a_index=order // top_k)  # read
    assert torch.equal(indexed, act)                                   # through an index: the gathered rows' bits


def check_moe_schedule_and_combine() -> None:
    """`schedule_rows`' one-launch sort and tiling equals `moe_schedule`'s torch ops (order, tiles, the
    inverse) over expert counts that are not powers of two, unused experts, one pair and 4096 pairs, and its
    chunked form beyond SCHEDULE_MAX_PAIRS (a partial last chunk);
    `combine` equals the router-weighted slot sum of the pairs' rows within one fp32 rounding a slot, and
    without weights or gather, bitwise the rows added one at a time in slot order."""
    from nvfp4_sampler.kernels import triton_moe
    g = torch.Generator().manual_seed(5)
    for tokens, top_k, experts, block_m in ((1, 1, 4, 8), (3, 2, 60, 8), (64, 8, 128, 8), (40, 4, 16, 16),
                                             (512, 8, 128, 8), (7, 8, 256, 32), (700, 8, 128, 128), (1030, 4, 60, 64)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        ids[: tokens // 2] %= max(1, experts // 3)                 # crowd some experts, leave others unused
        order, pos, sched = triton_moe.schedule_rows(ids, experts, block_m)
        o_ref, e_ref, s_ref, end_ref = triton_moe.moe_schedule(ids, experts, block_m)
        assert torch.equal(order.long(), o_ref), (tokens, top_k, experts)
        assert torch.equal(sched, torch.stack([e_ref, s_ref, end_ref])), (tokens, top_k, experts)
        assert torch.equal(order.long()[pos.long()], torch.arange(ids.numel()))
        assert sched.shape[1] == ids.numel() // block_m + min(experts, ids.numel())
        covered = torch.zeros(ids.numel(), dtype=torch.int64)          # every sorted row in exactly one tile
        for e, r0, end in sched.t().tolist():                         # of its own expert (a tile: block_m rows
            r1 = max(r0, min(end, r0 + block_m))                      # from r0, within its expert's end row)
            assert (ids.reshape(-1)[order.long()[r0:r1]] == e).all()
            covered[r0:r1] += 1
        assert (covered == 1).all(), (tokens, top_k, experts)
        if ids.numel() > triton_moe.SCHEDULE_MAX_PAIRS:              # more chunks than the 64-row count tile
            chunk, triton_moe.SCHEDULE_CHUNK = triton_moe.SCHEDULE_CHUNK, 64
            try:
                assert all(torch.equal(a, b) for a, b in zip(triton_moe.schedule_rows(ids, experts, block_m),
                                                             (order, pos, sched)))
            finally:
                triton_moe.SCHEDULE_CHUNK = chunk
        h = 48
        y = torch.randn(ids.numel(), h, generator=g)
        w = torch.rand(tokens, top_k, generator=g).to(torch.bfloat16)
        got = triton_moe.combine(y, pos, w, torch.float32)
        want = (y[pos.long()].view(tokens, top_k, h) * w.float()[..., None]).sum(1)
        assert torch.allclose(got, want, rtol=top_k * 2 ** -23, atol=1e-6), (tokens, top_k, experts)


def check_weight_into(op_order: str) -> None:
    """quantize_weight_into writes the reference's bits into views: stacked experts [E, 2R, K] as [2E, R, K]
    matrices (one call per fused entry) with the amax given or computed (per matrix, or one per `share`
    matrices: an expert's gate and up), and a row slice of a fused qkv; the amax it returns is
    reference.weight_amax's (NaN where a matrix holds one, the others unchanged)."""
    from nvfp4_sampler.kernels import reference, triton_quant
    from nvfp4_sampler.kernels.format import NVFP4Tensor
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(8, 32, 64, generator=g) * 0.05).to(torch.bfloat16)
    w[5] = 0                                                          # a zero matrix: amax 0, S_enc 1
    for amax, share in ((reference.weight_amax(w), 1), (None, 1), (None, 2)):
        per_matrix = reference.weight_amax(w)
        if share > 1:
            per_matrix = per_matrix.view(-1, share).amax(1).repeat_interleave(share)
        want = reference.quantize_weight(w, amax=per_matrix, op_order=op_order)
        codes, scales, s2 = (torch.zeros(4, 64, 32, dtype=torch.uint8), torch.zeros(4, 64, 4, dtype=torch.uint8),
                             torch.zeros(4, 2))
        out = NVFP4Tensor(codes.view(8, 32, 32), scales.view(torch.float8_e4m3fn).view(8, 32, 4), s2.view(8))
        used = triton_quant.quantize_weight_into(w, out, amax=amax, share=share, op_order=op_order)
        assert torch.equal(used, per_matrix[::share]), (used, share)
        assert torch.equal(codes.view(8, 32, 32), want.codes), share
        assert torch.equal(scales.view(8, 32, 4), want.block_scales.view(torch.uint8))
        assert torch.equal(s2.view(8), want.global_scale)
    codes, scales, s2 = (torch.zeros(48, 32, dtype=torch.uint8), torch.zeros(48, 4, dtype=torch.float8_e4m3fn),
                         torch.zeros(3))                                # a qkv entry's parts: k is rows 16..48
    want = reference.quantize_weight(w[0], op_order=op_order)
    used = triton_quant.quantize_weight_into(w[0], NVFP4Tensor(codes[16:48], scales[16:48], s2[1]), op_order=op_order)
    assert used.shape == () and torch.equal(used, reference.weight_amax(w[0]))
    assert torch.equal(codes[16:48], want.codes) and not codes[:16].any()
    assert torch.equal(s2, torch.stack([torch.tensor(0.0), want.global_scale, torch.tensor(0.0)]))
    w[6, 3, 7] = float("nan")
    used = triton_quant.quantize_weight_into(w, NVFP4Tensor(torch.empty(8, 32, 32, dtype=torch.uint8),
                                                            torch.empty(8, 32, 4, dtype=torch.float8_e4m3fn),
                                                            torch.empty(8)), share=2, op_order=op_order)
    assert used[3].isnan() and torch.equal(used[:3], reference.weight_amax(w[:6]).view(3, 2).amax(1))
    try:
        triton_quant.quantize_weight(w, op_order=op_order)
    except ValueError as e:
        assert "NaN or Inf" in str(e)
    else:
        raise AssertionError("quantize_weight took a NaN")


def test_decode_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_triton_interpret"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "interpreter checks passed" in proc.stdout


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    check_roundings()
    for order in ("vllm", "te"):
        check_quantizers(order)
        check_gemv(order)
        check_moe_pairs(order)
        check_weight_into(order)
        check_gathered_and_swiglu_rows(order)
        check_moe_exact(order)
    check_packed_split_k()
    check_linear_exact()
    check_scale_epilogue()
    check_moe_schedule_and_combine()
    print("interpreter checks passed")
