"""The layer core's load-time warm-up (`core.warm_up`): which token counts it runs, and that it runs each
layer shape once per process. The compilations it moves out of serving are measured on the GPU (the e2e
bench counts the kernels vLLM's JIT monitor sees compiled while serving)."""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.kernels import cuda_mma, triton_gemm, triton_moe
from nvfp4_sampler.sampler_format import SamplerConfig
from nvfp4_sampler.sampler_plugin import core, layers


def _regions(bounds: list[int], top: int) -> list[range]:
    """The token ranges between consecutive bounds (a bound b: b tokens and fewer take one side)."""
    edges = sorted({0, *(b for b in bounds if 0 < b < top), top})
    return [range(a + 1, b + 1) for a, b in zip(edges, edges[1:])]


def test_warm_up_tokens_reach_every_side_of_the_dispatch_bounds():
    """Every range of token counts between two size bounds of the dense and MoE dispatch (rows; pairs at
    top-8 and top-4, 128 experts) holds a warm-up count, a multiple of 16 where it holds one, and another."""
    rows = [triton_gemm.GEMV_MAX_M, cuda_mma.MMA_MIN_M - 1, cuda_mma.SMALL_MIN_M - 1, cuda_mma.THROUGHPUT_MIN_M - 1,
            cuda_mma.PERSIST_MIN_M - 1, cuda_mma.MMA_MAX_M, *(top for top, _, _ in cuda_mma.TILES if top)]
    for k in (8, 4):
        pairs = [triton_moe.PAIRED_MAX_PAIRS, triton_moe.MMA_WIDE_PAIRS - 1, triton_moe.MMA_MAX_PAIRS,
                 triton_moe.SCHEDULE_MAX_PAIRS, triton_moe.EXACT_TALL_ROWS * 128 - 1,
                 triton_moe.EXACT_WIDE_ROWS * 128 - 1, triton_moe.SCHEDULE_FEW_CHUNKS * triton_moe.SCHEDULE_CHUNK]
        bounds = rows + [p // k for p in pairs]
        for region in _regions(bounds, max(core.WARMUP_TOKENS)):
            got = [t for t in core.WARMUP_TOKENS if t in region]
            assert got, f"no warm-up count in {region} (top-{k})"
            if any(t % 16 == 0 for t in region):
                assert any(t % 16 == 0 for t in got), f"no multiple of 16 warmed in {region}"
            if any(t % 16 for t in region):
                assert any(t % 16 for t in got), f"no odd count warmed in {region}"


def _linear(cfg: SamplerConfig, prefix: str):
    lin = core.LinearCore(cfg, prefix, [prefix], layers.MemoryReport())
    layer = torch.nn.Module()
    lin.create_linear(layer, output_sizes=[32], input_size=64, k_part=64, dtype=torch.bfloat16)
    lin.load(layer, layer.weight, torch.randn(32, 64, dtype=torch.bfloat16))
    lin.process_weights_after_loading(layer)                # on the CPU: no warm-up of its own
    return lin, layer


def test_warm_up_runs_each_layer_shape_once():
    cfg = SamplerConfig(backend="reference")
    lin, layer = _linear(cfg, "a.proj")
    assert lin.warm_up(layer, tokens=(1, 3, 17)) == 3
    other, other_layer = _linear(cfg, "b.proj")             # the same shape, backend, dtype and config
    assert other.warm_up(other_layer, tokens=(1, 3, 17)) == 0
    strict, strict_layer = _linear(SamplerConfig(backend="reference", strict=True), "c.proj")
    assert strict.warm_up(strict_layer, tokens=(2,)) == 1   # another config: its own kernels


def test_warm_up_runs_the_experts_with_their_top_k_only():
    cfg = SamplerConfig(backend="reference")
    for top_k, runs in ((2, 2), (None, 0)):
        ex = core.ExpertsCore(cfg, "m.experts", layers.MemoryReport())
        moe = torch.nn.Module()
        ex.create_experts(moe, num_experts=4, hidden=64, inter=32, top_k=top_k, dtype=torch.bfloat16)
        for e in range(4):
            for sid in ("w1", "w3", "w2"):
                name, shard = ex.locate(moe, "", sid, e)
                shape = (32, 64) if sid != "w2" else (64, 32)
                layers.write(ex.storage(moe)[name], shard, "weight", torch.randn(shape, dtype=torch.bfloat16), config=cfg)
        assert ex.warm_up(moe, tokens=(1, 5)) == runs


@pytest.mark.gpu
def test_after_warm_up_serving_compiles_no_kernel():
    """On the GPU with the default backends: once a linear and an MoE layer are warmed, forwards at token
    counts the warm-up did not run (1 to 3000, odd and even, both MoE top-k's) compile no Triton kernel
    (Triton's post-compile hook, as vLLM's JIT monitor uses it; disk-cache loads count too)."""
    import triton

    cfg = SamplerConfig()
    lin = core.LinearCore(cfg, "g.proj", ["g.proj"], layers.MemoryReport())
    layer = torch.nn.Module()
    with torch.device("cuda"):                                 # storage (and so the backend) on the GPU
        lin.create_linear(layer, output_sizes=[1024], input_size=2048, k_part=2048, dtype=torch.bfloat16)
    lin.load(layer, layer.weight, torch.randn(1024, 2048, dtype=torch.bfloat16, device="cuda"))
    ex = core.ExpertsCore(cfg, "g.experts", layers.MemoryReport())
    moe = torch.nn.Module()
    with torch.device("cuda"):
        ex.create_experts(moe, num_experts=16, hidden=1024, inter=256, top_k=4, dtype=torch.bfloat16)
    assert layer.nvfp4_backend != "reference" and moe.nvfp4_backend != "reference"
    for e in range(16):
        for sid, shape in (("w1", (256, 1024)), ("w3", (256, 1024)), ("w2", (1024, 256))):
            param = moe.w2_weight if sid == "w2" else moe.w13_weight          # as the engine's loader calls it
            ex.load(moe, param, torch.randn(shape, dtype=torch.bfloat16, device="cuda"), "", sid, e)
    assert core.WARMUP
    lin.process_weights_after_loading(layer)                   # the warm-up runs here, on CUDA
    ex.process_weights_after_loading(moe)
    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(
        f"{getattr(kw.get('fn'), 'name', '?')} {str(kw.get('key'))[:300]}")
    try:
        with torch.no_grad():
            for t in (3, 7, 10, 13, 20, 31, 40, 47, 50, 70, 90, 111, 200, 300, 517, 700, 1111, 2222, 3000):
                lin.apply(layer, torch.randn(t, 2048, dtype=torch.bfloat16, device="cuda"))
                ids = torch.randint(0, 16, (t, 4), device="cuda", dtype=torch.int32)
                ex.forward_experts(moe, torch.randn(t, 1024, dtype=torch.bfloat16, device="cuda"),
                                   torch.full((t, 4), 0.25, device="cuda"), ids)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], "compiled while serving after the warm-up:\n" + "\n".join(compiled)


def test_the_warm_up_switch_is_read_once_and_checked():
    """NVFP4_SAMPLER_WARMUP=0 turns the warm-up off; a value other than 0 or 1 stops the import naming it
    (`kernels.switches`, as the kernels' switches do)."""
    import os
    import subprocess
    import sys
    code = "from nvfp4_sampler.sampler_plugin import core; print(core.WARMUP)"
    env = {k: v for k, v in os.environ.items() if k != "NVFP4_SAMPLER_WARMUP"}
    for value, want in ((None, "True"), ("1", "True"), ("0", "False")):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env if value is None else dict(env, NVFP4_SAMPLER_WARMUP=value))
        assert res.stdout.strip() == want, res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(env, NVFP4_SAMPLER_WARMUP="off"))
    assert res.returncode != 0 and "NVFP4_SAMPLER_WARMUP must be one of ['1', '0'], got 'off'" in res.stderr
