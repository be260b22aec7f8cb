"""The decode GEMM kernels' arithmetic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The interpreter runs the kernels' portable path (no inline PTX): the same exact block products,
split-K planes and epilogue as on the GPU, so the numerics are checked in CI against the spec
(`kernels.reference`). What only the GPU checks: the packed-FP16 inline PTX (`_DOT16`) and the
`prmt` decode, which tests/test_gpu_kernels.py compares bitwise with this portable path.
The checks run in a child process because TRITON_INTERPRET must be set before triton compiles.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def _bound(a, w, want, bias):
    """FP32 reordering bound: K * 2^-23 * (|a| @ |w|^T) plus one rounding of the bias addition."""
    from kernels import reference
    mag = reference.dequantize(a).abs() @ reference.dequantize(w).abs().T
    return a.shape[1] * 2.0 ** -23 * mag + 2.0 ** -22 * (want.abs() + bias.abs()) + 1e-37


def _case(m: int, n: int, k: int, *, seed: int):
    from kernels import reference
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())
    x[:, :16] = 0.0                                                   # a zero block
    w = reference.quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    w = w.replace(global_scale=w.global_scale * (0.5 + torch.rand(n, generator=g)))
    return x.to(torch.bfloat16), w, torch.randn(n, generator=g)


def check_gemv() -> None:
    """Decode kernel with the activation quantized in its launch: per token / per tensor, with and
    without an amax override, split-K 1 and 4, deterministic run to run."""
    from kernels import reference, triton_gemm
    for m, n, k, split_k, scaling, amax_mul in [(1, 64, 256, 1, "per_token", None), (3, 100, 512, 4, "per_token", None),
                                                 (3, 100, 512, 2, "per_tensor", None), (2, 70, 1024, 4, "per_token", 2.5),
                                                 (4, 64, 48, 1, "per_tensor", 3.0)]:
        x, w, bias = _case(m, n, k, seed=m * n + k)
        amax = None
        if amax_mul:
            amax = (x.abs().float().amax(-1) if scaling == "per_token" else x.abs().float().amax()) * amax_mul
        a = reference.quantize_activations(x, scaling=scaling, amax=amax)
        want = reference.nvfp4_gemm(a, w, bias=bias, out_dtype=torch.float32)
        cfg = dict(triton_gemm.gemv_config(m, n, k), SPLIT_K=split_k)
        outs = []
        for _ in range(2):
            out = torch.full((m, n), float("nan"))
            triton_gemm.launch_w4a4_gemv(x, w, out, bias=bias, scaling=scaling, amax=amax, fused=True, config=cfg)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"gemv not deterministic {m, n, k, split_k}"
        err = (outs[0] - want).abs()
        assert bool((err <= _bound(a, w, want, bias)).all()), f"gemv {m, n, k, split_k, scaling, amax_mul}: max err {err.max()}"


def check_packed_split_k() -> None:
    """Tensor-core kernel's split-K planes, added in a fixed order by the tile's last program."""
    from kernels import reference, triton_gemm
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


def check_moe_pairs() -> None:
    """MoE decode (one GEMV program row per (token, expert) pair, SwiGLU and router weight fused),
    split-K 1 and 2: the SwiGLU rows within one BF16 ulp of the spec's, the layer within the
    re-quantization error of `reference.moe`, bitwise deterministic."""
    from kernels import reference, triton_gemm, triton_moe
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k, tokens = 6, 256, 64, 4, 2
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w13 = reference.quantize_weight((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16))
    w13 = w13.replace(global_scale=w13.global_scale[:, None] * (0.5 + torch.rand(experts, 2 * inter, generator=g)))
    w2 = reference.quantize_weight((torch.randn(experts, hidden, inter, generator=g) * 0.1).to(torch.bfloat16))
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), top_k)
    ids = topk_ids.reshape(-1).to(torch.int32)
    a = reference.quantize_per_token(x)
    for split_k in (1, 2):
        cfg = dict(triton_gemm.gemv_config(1, inter * ids.numel(), hidden), SPLIT_K=split_k)
        act = torch.empty((ids.numel(), inter), dtype=torch.bfloat16)
        triton_gemm.launch_w4a4_pairs(x, w13, act, pair_expert=ids, topk=top_k, swiglu=True, config=cfg)
        for p in range(ids.numel()):
            h = reference.nvfp4_gemm(reference._rows(a, torch.tensor([p // top_k])), reference._expert(w13, int(ids[p])),
                                     out_dtype=torch.float32)
            want = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)[0].float()
            assert bool(((act[p].float() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()), f"SwiGLU row {p}"
    want = reference.moe(x, w13, w2, topk_w, topk_ids).float()
    got = triton_moe.moe(x, w13, w2, topk_w, topk_ids)
    assert ids.numel() <= triton_gemm.PAIRED_MAX_PAIRS
    assert torch.equal(got, triton_moe.moe(x, w13, w2, topk_w, topk_ids)), "MoE decode not deterministic"
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 3e-2, f"MoE decode relative error {rel:.3g}"


def test_decode_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_triton_interpret"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "interpreter checks passed" in proc.stdout


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    check_gemv()
    check_packed_split_k()
    check_moe_pairs()
    print("interpreter checks passed")
