"""Tensor parallelism with per-token scaling on CPU (gloo, 2 processes).

A row-parallel layer's rank holds a K-slice of every token. With the activation amax all-reduced
(MAX) over the group, each rank's codes, block scales and per-token scales equal the matching
slice of the unsharded (TP=1) quantization bit for bit; without it they do not. Outputs (partial
GEMMs summed over ranks) equal TP=1 within FP32 summation-order tolerance. MoE experts split over the
ranks (each holds I / 2 of every expert) likewise: each SwiGLU row's amax all-reduced before its
quantization for w2 (`layers.apply_moe(tp_group=...)`), the summed outputs equal TP=1 within that tolerance.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvfp4_sampler.kernels import reference
from nvfp4_sampler.kernels import NVFP4Tensor
from nvfp4_sampler.sampler_plugin import layers
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig
from nvfp4_sampler.server.process import free_port

WORLD, M, K, N = 2, 37, 256, 48


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g, dtype=torch.float32)
    x[:, K // 2:] *= 8.0          # the second rank's slice holds each row's max: a local amax is wrong
    return x.to(torch.bfloat16).float(), torch.randn(N, K, generator=g)   # bf16 values, fp32 outputs


def _slice(t, rank):
    part = t.shape[-1] // WORLD
    return t[..., rank * part:(rank + 1) * part]


def _worker(rank: int, port: int, scaling: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        x, w = _inputs()
        full_w = reference.quantize_weight(w)
        # this rank's K-slice of the checkpoint weight, as the loader writes it (16-block aligned)
        w_r = NVFP4Tensor(_slice(full_w.codes, rank).contiguous(),
                                     _slice(full_w.block_scales, rank).contiguous(),
                                     full_w.global_scale.expand(N).contiguous())
        cfg = SamplerConfig(recipe=Recipe(activation_scaling=scaling), backend="reference")
        x_r = _slice(x, rank).contiguous()
        amax = x_r.abs().float().amax(-1) if scaling == "per_token" else x_r.abs().float().amax()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        a_r = reference.quantize_activations(x_r, scaling=scaling, amax=amax)
        out = layers.apply_linear(x_r, w_r, bias=None, config=cfg, tp_group=dist.group.WORLD).float()
        dist.all_reduce(out)                                   # the row-parallel output reduction
        local = reference.quantize_activations(x_r, scaling=scaling)   # without the all-reduce
        results[rank] = (a_r, local, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["per_token", "per_tensor"])
def tp_run(request):
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(free_port(), request.param, results), nprocs=WORLD,
                       start_method="spawn", join=True)
    return request.param, dict(results)


def test_tp2_codes_and_scales_equal_tp1(tp_run):
    scaling, results = tp_run
    x, _ = _inputs()
    full = reference.quantize_activations(x, scaling=scaling)
    for rank, (a_r, local, _) in results.items():
        assert torch.equal(a_r.codes, _slice(full.codes, rank))
        assert torch.equal(a_r.block_scales.view(torch.uint8), _slice(full.block_scales, rank).view(torch.uint8))
        assert torch.equal(a_r.global_scale, full.global_scale)
    # a rank that quantizes its slice with its own amax gets other codes (the failure TP must avoid)
    a0, local0, _ = results[0]
    assert not torch.equal(local0.global_scale, a0.global_scale)
    assert not torch.equal(local0.codes, a0.codes)


def test_tp2_output_equals_tp1(tp_run):
    scaling, results = tp_run
    x, w = _inputs()
    a, wq = reference.quantize_activations(x, scaling=scaling), reference.quantize_weight(w)
    tp1 = reference.nvfp4_gemm(a, wq, out_dtype=torch.float32)
    # FP32 accumulation in another order (two K halves, then the sum): |diff| <= K * 2^-24 * sum|a w|
    abs_acc = reference.dequantize(a).abs() @ reference.dequantize(wq).abs().T
    for _, _, out in results.values():
        assert ((out - tp1).abs() <= K * 2.0 ** -24 * abs_acc).all()
        assert out.abs().max() > 0


E, H, I, T, TOP = 4, 32, 64, 9, 2                  # MoE: each rank holds I / 2 of every expert


def _moe_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    w13 = reference.quantize_weight(torch.randn(E, 2 * I, H, generator=g) * 0.3)
    w2 = reference.quantize_weight(torch.randn(E, H, I, generator=g) * 0.3)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(T)])
    return x, w13, w2, torch.rand(T, TOP, generator=g), ids


def _moe_worker(rank: int, port: int, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        x, w13, w2, tw, ids = _moe_inputs()
        half = I // WORLD
        mine = torch.arange(rank * half, (rank + 1) * half)
        rows = torch.cat([mine, I + mine])                     # this rank's gate rows, then its up rows
        w13_r = NVFP4Tensor(w13.codes[:, rows].contiguous(), w13.block_scales[:, rows].contiguous(), w13.global_scale)
        w2_r = NVFP4Tensor(_slice(w2.codes, rank).contiguous(), _slice(w2.block_scales, rank).contiguous(),
                           w2.global_scale)
        cfg = SamplerConfig(backend="reference")
        outs = []
        for group in (dist.group.WORLD, None):        # the SwiGLU rows' amax all-reduced, then each rank's own
            out = layers.apply_moe(x, w13_r, w2_r, tw, ids, config=cfg, tp_group=group)
            dist.all_reduce(out)                       # the engine's reduction of the ranks' partial sums
            outs.append(out)
        results[rank] = outs
    finally:
        dist.destroy_process_group()


def test_tp2_moe_equals_tp1_with_the_swiglu_rows_amax_all_reduced():
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_moe_worker, args=(free_port(), results), nprocs=WORLD, start_method="spawn", join=True)
    x, w13, w2, tw, ids = _moe_inputs()
    tp1 = reference.moe(x, w13, w2, tw, ids)
    for shared, own in results.values():
        # the same codes and scales on every rank as unsharded; only the FP32 partial sums' order differs
        assert torch.allclose(shared, tp1, rtol=1e-5, atol=1e-5 * tp1.abs().max().item())
        assert (own - tp1).abs().max() > 100 * (shared - tp1).abs().max()
