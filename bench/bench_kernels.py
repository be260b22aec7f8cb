"""NVFP4 kernel benchmark on one CUDA GPU: every ratio is measured side by side in this process.

Rows: device copy bandwidth (the roofline, bytes read + written), per-token activation
quantization, weight conversion of a Qwen3-30B-A3B-shaped layer (x48 layers), W4A4 linear at
Qwen3-30B-A3B and Qwen3-8B shapes against cuBLAS BF16 (`torch.matmul`), the Qwen3-30B-A3B MoE
layer against BF16 `torch._grouped_mm` and, where vLLM is installed, vLLM's BF16 `fused_experts` (the Triton
MoE a BF16 vLLM engine runs), the plain torch-eager reference, and the memory ratio.
Linear at M = 1 and 16 also times the peer `humming-kernels` 0.1.19 (vLLM's quantized GEMM
backend) on the same ModelOpt NVFP4 weights, where installed (carry its wheel: `.whl/`, see
docs/BENCHMARKS.md); without it the rows say why.

Timing: CUDA-graph replays (`triton.testing.do_bench_cudagraph`, median), as engines run decode;
the eager reference (which syncs on its input checks) with `triton.testing.do_bench` (median).
Weights and routings rotate through copies larger than the 60 MB L2, so no weight is timed from L2.

  PYTHONPATH=. python3 bench/bench_kernels.py --json $OUT/bench.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch
import triton
import triton.language as tl
import triton.testing

from nvfp4_sampler.kernels import cuda_mma, dispatch, reference, triton_gemm, triton_gemv, triton_moe, triton_quant

L2_ROTATE_BYTES = 256 << 20
LINEAR_SHAPES = {          # name: (N, K)
    "30B-A3B qkv": (5120, 2048), "30B-A3B o": (2048, 4096),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
    "1.7B qkv": (4096, 2048), "1.7B o": (2048, 2048), "1.7B gate_up": (12288, 2048), "1.7B down": (2048, 6144),
}
MOE = dict(experts=128, hidden=2048, inter=768, top_k=8)
LAYERS_30B = 48
ACT_SWEEP = [dict(elements=e, num_warps=w, persist_stages=p) for e, w, p in
             [(2048, 4, 0), (4096, 4, 0), (4096, 8, 0), (8192, 8, 0), (16384, 16, 0), (8192, 16, 0),
              (4096, 4, 2), (8192, 8, 2)]]
WEIGHT_SWEEP = [dict(block_kb=b, num_warps=w, persist_stages=p) for b, w, p in
                [(16, 4, 0), (32, 4, 0), (32, 8, 0), (64, 8, 0), (64, 16, 0), (32, 8, 2), (64, 8, 2)]]
GEMV_SWEEP = [dict(), dict(block_n=32), dict(block_n=128), dict(block_b=4), dict(block_b=8), dict(block_b=32),
              dict(num_warps=8), dict(min_programs=264), dict(min_programs=1056)]
MMA_BENCH_MAX_M = 64      # the mma kernel is measured up to here (the default path takes it to cuda_mma.MMA_MAX_M)
MMA_RW_SWEEP = (2, 4, 8, 16)
MMA_STAGES_SWEEP = (2, 3, 4, 8)
MMA_CPS_SWEEP = (2, 4, 8, 16)
MMA_NT_SWEEP = (4, 8)                     # token tiles of 8 per CTA at M = 32, 64
PERSIST_SWEEP = ((False, 4, 8, 8), (False, 4, 8, 16), (False, 4, 16, 16), (True, 4, 8, 16), (True, 4, 16, 16),
                 (True, 8, 8, 8))                 # (wgmma, NT, RW, CPS) of persistent launches at M = 32, 64: the
                                                  # one-tile forms fastest at M = 64 on the H100 (2026-12-05; NT 8
                                                  # RW 16 does not fit beside the cluster's partial sums)
BF16_BLOCK_MIB = (8, 16, 32)              # column blocks of the bf16 path's FP32 product (`triton_gemm.BF16_BLOCK_BYTES`)
MMA_CPS_SWEEP_MOE = (4, 8, 16)            # chunks of 128 per split-K slice, MoE at 16-256 tokens
MMA_NT_SWEEP_MOE = (1, 2, 4)              # token tiles of 8 per expert tile, MoE at >= 128 tokens (fp32 out:
                                          # NT = 8 spills on sm_90)
LINEAR_STAGES_SWEEP = (3, 5, 8)
# (wgmma, RW, CPS) at M = 16 (NT = 2, `cuda_mma.tiles`): warps and MMA are free there (they change no bit,
# `cuda_mma.TILES`), the slice is `config`'s (the summation order of every M); 16 warps stage each token's
# K slice for twice the weight rows of the default 8
SMALL_SWEEP = [(g, r, c) for g in (False, True) for r in (4, 8, 16) for c in (4, 8, 16)]
EXACT_SMALL_SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=w)   # the exact GEMM at M = 16-64
                     for bn, bk, st, w in ((64, 128, 4, 4), (64, 256, 4, 4), (64, 64, 6, 4), (128, 128, 3, 8),
                                           (64, 128, 4, 8))]
PAIRS_SWEEP = [dict(block_n=bn, block_b=bb, num_warps=w, min_programs=mp)   # the MoE per-pair GEMVs at 1-4 tokens
               for bn, bb, w, mp in ((64, 8, 4, 264), (64, 8, 4, 528), (64, 8, 4, 132), (64, 8, 4, 66),
                                     (32, 8, 4, 264), (32, 8, 4, 132), (128, 8, 8, 264), (64, 16, 8, 132),
                                     (64, 4, 4, 264), (64, 8, 2, 264))] + [dict(pdl=False), dict(pdl=True)] + [
    dict(w2=dict(min_programs=mp)) for mp in (1, 528)]   # w2's split-K alone (at 1 token 256 tiles: 264 splits it in 2)
EXACT_MOE_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=0, SPLIT_K=1, W_CODES=True, num_warps=4,
                        num_stages=4)             # the exact MoE GEMM over 16-row expert tiles, codes decoded inside
EXACT_MOE_ORDER_SWEEP = [dict(GROUP_M=g) for g in (0, 1, 4, 8, 16)]   # the exact MoE at >= 1024 tokens: row tiles a
                                                                     # column sweep, on each weight's default form
EXACT_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w, W_CODES=c)   # the exact GEMM at
               for bm, bn, bk, st, w, c in ((128, 256, 64, 3, 8, False), (128, 256, 64, 4, 8, False),  # M >= 4096:
                                            (128, 128, 64, 4, 8, False), (256, 128, 64, 3, 8, False),  # tiles, weights
                                            (128, 128, 64, 4, 4, False), (128, 256, 64, 3, 8, True),   # as fp16 or codes
                                            (128, 128, 64, 4, 8, True), (256, 128, 64, 3, 8, True),
                                            (256, 128, 128, 3, 8, True))]
PEER = "humming-kernels 0.1.19 (NVFP4 weights, BF16 activations, default kernels)"


def peer_layers(w_q: list) -> tuple[list | None, str]:
    """The peer kernel's layers for the ModelOpt NVFP4 weights w_q (repacked by the peer), or
    (None, why) where the peer is not installed (carry its wheel: docs/BENCHMARKS.md)."""
    try:
        from humming.layer import HummingLayer
    except Exception as err:                  # not installed, or its native part fails to load
        return None, f"{PEER} not available: {type(err).__name__}: {err}"
    layers = []
    for w in w_q:
        n, k = w.shape
        with torch.device("cuda"):
            layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                                 torch_dtype=torch.bfloat16)
        layer.load_from_tensors({"weight": w.codes, "weight_scale": w.block_scales,
                                 "weight_scale_2": w.global_scale.reshape(1)})
        layer.transform()
        layers.append(layer)
    return layers, PEER


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def tried_ms(fn) -> float:
    """graph_ms of a candidate configuration, or NaN where it cannot run (a compile or launch refused:
    shared memory, registers), so that one candidate does not end its section; the reason is printed."""
    try:
        return graph_ms(fn)
    except Exception as err:  # noqa: BLE001 - any failure of a candidate is a result, not an end
        print(f"candidate failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return math.nan


def eager_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def rows_bytes(m: int, k: int) -> int:
    """Bytes a per-token quantizer must move: BF16 in, codes + E4M3 scales + FP32 S_dec out."""
    return m * k * 2 + m * k // 2 + m * k // 16 + 4 * m


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + off, tl.load(src + off, mask=off < n), mask=off < n)


def copy_ms(nbytes: int) -> dict:
    """Device copies moving nbytes in total (nbytes/2 read, nbytes/2 written), three ways."""
    n = max(nbytes // 8, 1)                                   # int32 elements each side
    src = torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", dtype=torch.int32)
    dst = torch.empty_like(src)
    return {"torch copy_ (graph)": graph_ms(lambda: dst.copy_(src)),
            "torch copy_ (eager)": eager_ms(lambda: dst.copy_(src)),
            "triton copy (graph)": graph_ms(lambda: _copy_kernel[(triton.cdiv(n, 8192),)](src, dst, n, BLOCK=8192, num_warps=8))}


def copies(make, one_bytes: int):
    n = max(1, math.ceil(L2_ROTATE_BYTES / max(one_bytes, 1)))
    return [make(i) for i in range(n)]


def bench_copy(log) -> float:
    nbytes = 2 << 30
    times = copy_ms(nbytes)
    for how, t in times.items():
        log("copy", dict(how=how, bytes=nbytes, ms=t, gbps=gbps(nbytes, t)))
    return gbps(nbytes, min(times.values()))


def bench_act_quant(log, peak_gbps: float, quick: bool) -> None:
    for k in (2048, 4096, 7168):
        x = torch.randn(16384, k, device="cuda", dtype=torch.bfloat16)
        sweep = {json.dumps(c): graph_ms(lambda c=c: triton_quant.quantize_per_token(x, config=c)) for c in ACT_SWEEP}
        best = json.loads(min(sweep, key=sweep.get))
        log("act_sweep", dict(k=k, m=16384, ms=sweep, best=best, default=triton_quant.ACT_CONFIG))
        for m in ((1, 16, 1024, 16384) if quick else (1, 16, 128, 1024, 4096, 16384)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = rows_bytes(m, k)
            ours = graph_ms(lambda: triton_quant.quantize_per_token(x))
            tuned = graph_ms(lambda: triton_quant.quantize_per_token(x, config=best))
            same = min(copy_ms(nbytes).values())
            ref = eager_ms(lambda: reference.quantize_per_token(x)) if m * k <= (1 << 27) else None
            # the engines' form: exact FP16 rows for the tensor-core GEMMs (BF16 in, FP16 + S_dec out)
            exact = graph_ms(lambda: triton_quant.quantize_per_token_exact(x, dtype=torch.float16))
            exact_bytes = m * k * 4 + 4 * m
            log("act_quant", dict(m=m, k=k, bytes=nbytes, ours_ms=ours, tuned_ms=tuned, copy_same_bytes_ms=same, ref_ms=ref,
                                  gbps=gbps(nbytes, ours), frac_peak_copy=gbps(nbytes, ours) / peak_gbps,
                                  tuned_frac_peak_copy=gbps(nbytes, tuned) / peak_gbps, frac_same_size_copy=same / ours,
                                  exact_ms=exact, exact_frac_peak_copy=gbps(exact_bytes, exact) / peak_gbps))


def layer_30b(device) -> dict[str, torch.Tensor]:
    """One Qwen3-30B-A3B decoder layer's quantized weights, synthetic BF16 (router stays BF16)."""
    h, q, kv, e, i = 2048, 4096, 512, MOE["experts"], MOE["inter"]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "experts.gate_proj": (e, i, h), "experts.up_proj": (e, i, h), "experts.down_proj": (e, h, i)}
    return {name: (torch.randn(s, device=device) * 0.02).to(torch.bfloat16) for name, s in shapes.items()}


def bench_weight_conversion(log, peak_gbps: float) -> None:
    layer = layer_30b("cuda")
    amax = {n: triton_quant.weight_amax(w) for n, w in layer.items()}
    in_bytes = sum(w.numel() * 2 for w in layer.values())
    out_bytes = sum(w.numel() // 2 + w.numel() // 16 for w in layer.values())
    nbytes = in_bytes + out_bytes
    sweep = {json.dumps(c): graph_ms(lambda c=c: [triton_quant.quantize_weight(w, amax=amax[n], check_finite=False, config=c)
                                                  for n, w in layer.items()]) for c in WEIGHT_SWEEP}
    best = json.loads(min(sweep, key=sweep.get))
    log("weight_sweep", dict(ms=sweep, best=best, default=triton_quant.WEIGHT_CONFIG))
    variants = {
        "1d, amax given (1 pass)": lambda: [triton_quant.quantize_weight(w, amax=amax[n], check_finite=False) for n, w in layer.items()],
        "1d, amax given (1 pass), best swept config": lambda: [triton_quant.quantize_weight(w, amax=amax[n], check_finite=False, config=best) for n, w in layer.items()],
        "2d, amax given (1 pass)": lambda: [triton_quant.quantize_weight(w, recipe="2d", amax=amax[n], check_finite=False) for n, w in layer.items()],
        "1d, amax computed (2 passes)": lambda: [triton_quant.quantize_weight(w, amax=triton_quant.weight_amax(w), check_finite=False) for n, w in layer.items()],
        "1d, amax computed (the default)": lambda: [triton_quant.quantize_weight(w, check_finite=False) for w in layer.values()],
    }
    for name, fn in variants.items():
        t = graph_ms(fn)
        log("weight_conversion", dict(variant=name, layer_bytes=nbytes, layer_ms=t, model_ms=t * LAYERS_30B,
                                      model_gb=nbytes * LAYERS_30B / 1e9, gbps=gbps(nbytes, t),
                                      frac_peak_copy=gbps(nbytes, t) / peak_gbps))
    t = eager_ms(lambda: [triton_quant.quantize_weight(w) for w in layer.values()])
    log("weight_conversion", dict(variant="1d, checked API (amax computed, NaN check: 1 sync/tensor)", layer_bytes=nbytes,
                                  layer_ms=t, model_ms=t * LAYERS_30B, gbps=gbps(nbytes, t),
                                  frac_peak_copy=gbps(nbytes, t) / peak_gbps))
    t = eager_ms(lambda: [reference.quantize_weight(w) for w in layer.values()])
    log("weight_conversion", dict(variant="torch-eager reference", layer_bytes=nbytes, layer_ms=t,
                                  model_ms=t * LAYERS_30B, gbps=gbps(nbytes, t), frac_peak_copy=gbps(nbytes, t) / peak_gbps))


def bench_linear(log, peak_gbps: float, quick: bool, shapes: list[str], sweep_configs: bool,
                 ms: tuple[int, ...] | None = None) -> None:
    ms = ms or ((1, 4, 16, 32, 64, 256, 4096) if quick else (1, 4, 16, 32, 64, 256, 1024, 4096, 8192))
    for name in shapes:
        n, k = LINEAR_SHAPES[name]
        w_bf = copies(lambda i: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), n * k * 2)
        w_q = copies(lambda i: triton_quant.quantize_weight((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)),
                     n * k * 9 // 16)
        log("memory", dict(shape=name, bf16_bytes=n * k * 2, nvfp4_bytes=w_q[0].nbytes, ratio=w_q[0].nbytes / (n * k * 2)))
        peers, peer_note = peer_layers(w_q)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_ms(lambda: [torch.matmul(x, w.t()) for w in w_bf]) / len(w_bf)
            row = dict(shape=name, m=m, n=n, k=k, cublas_ms=cublas)
            mma = m <= MMA_BENCH_MAX_M and cuda_mma.shape_ok(n, k)
            for path in (("mma",) * mma + ("gemv",) * (m <= triton_gemv.GEMV_KERNEL_MAX_M)
                         + ("packed",) * (m <= 1024) + ("bf16",)):
                row[f"{path}_ms"] = graph_ms(lambda: [triton_gemm.linear(x, w, path=path) for w in w_q]) / len(w_q)
            if m >= 4096:                                 # the bf16 path over column blocks of its FP32 product
                row["bf16_blocks_ms"] = {f"{mib} MiB": tried_ms(lambda mib=mib: [triton_gemm._linear_bf16(
                    x, w, None, torch.bfloat16, None, "vllm", block_bytes=mib << 20) for w in w_q]) / len(w_q)
                    for mib in BF16_BLOCK_MIB}
            if m >= 256:                                  # the exact path (forced: a candidate)
                row["exact_ms"] = tried_ms(lambda: [triton_gemm.linear(x, w, path="exact") for w in w_q]) / len(w_q)
            if m >= 256:                                  # the exact path with the codes decoded in the GEMM (no
                codes = dict(triton_gemm.EXACT_DENSE, W_CODES=True)              # FP16 copy of the weight)

                def exact_codes(w):
                    a = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
                    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    triton_gemm.launch_exact(a, w, out, config=codes)
                row["exact_codes_ms"] = tried_ms(lambda: [exact_codes(w) for w in w_q]) / len(w_q)
            if m >= 4096:                                 # the exact GEMM alone by tiles, operands prepared beforehand
                xq = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                row["exact_tiles_ms"] = {
                    "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} s{num_stages} w{num_warps}{}".format(" codes" * c["W_CODES"], **c): tried_ms(lambda c=c: [
                        triton_gemm.launch_exact(xq, w, out, config=dict(triton_gemm.EXACT_DENSE, **c))
                        for w in w_q]) / len(w_q) for c in EXACT_SWEEP}
            if mma:                                       # the mma kernel alone, activation quantized beforehand
                xq = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                row["mma_kernel_ms"] = graph_ms(
                    lambda: [cuda_mma.launch(xq.values, xq.global_scale, w, out) for w in w_q]) / len(w_q)
                w_t = [cuda_mma.tile_weight(w) for w in w_q]
                row["mma_tiled_kernel_ms"] = graph_ms(
                    lambda: [cuda_mma.launch(xq.values, xq.global_scale, w, out) for w in w_t]) / len(w_t)
                row["mma_tiled_linear_ms"] = graph_ms(    # as engines run it: quantizer, then the kernel (PDL at M = 1)
                    lambda: [triton_gemm.linear(x, w, path="mma") for w in w_t]) / len(w_t)
                tuned = cuda_mma.throughput_options(m, n, k, warpgroup=cuda_mma.has_wgmma(x.device),
                                                     slices=cuda_mma.small_slices(x.device))
                xc = triton_quant.quantize_per_token(x)   # the activation as codes + block scales (X_CODES)
                row["same_bits"] = same_bits_forms(xq, xc, w_t[0], out, tuned)
                row["wgmma_tiled_kernel_ms"] = tried_ms(   # the warpgroup-MMA variant, tiles as the default's
                    lambda: [cuda_mma.launch(xq.values, xq.global_scale, w, out, **(tuned | {"wgmma": True}))
                             for w in w_t]) / len(w_t)
                for form, opts in (("cluster", dict(cluster=True, push=False)), ("global", dict(cluster=False)),   # split-K
                                   ("push", dict(cluster=True, push=True, persist=False))):         # forms (same bits)
                    row[f"{form}_tiled_kernel_ms"] = tried_ms(lambda: [cuda_mma.launch(
                        xq.values, xq.global_scale, w, out, **(tuned | opts)) for w in w_t]) / len(w_t)
                row["codes_tiled_kernel_ms"] = tried_ms(lambda: [cuda_mma.launch(
                    xc.codes, xc.global_scale, w, out, x_scales=xc.block_scales, **tuned) for w in w_t]) / len(w_t)
                row["rows_tiled_linear_ms"] = tried_ms(lambda: with_x_codes(False,   # the linear on exact FP16 rows
                    lambda: [triton_gemm.linear(x, w, path="mma") for w in w_t])) / len(w_t)
                row["one_tile_kernel_ms"] = tried_ms(lambda: [cuda_mma.launch(   # one tile a CTA (the default up to
                    xq.values, xq.global_scale, w, out, persist=False, **tuned) for w in w_t]) / len(w_t)   # 16 tokens)
                # persistent CTAs (same bits, same tiles) by ring depth: their rings stream across row tiles
                # (NaN where a depth's shared memory does not fit)
                row["persist_stages_ms"] = {st: tried_ms(lambda st=st: [cuda_mma.launch(
                    xq.values, xq.global_scale, w, out, persist=True, stages=st, **tuned) for w in w_t]) / len(w_t)
                    for st in MMA_STAGES_SWEEP}
                row["prefetch_ms"] = {form: tried_ms(lambda persist=persist: [cuda_mma.launch(   # slices into L2 first
                    xq.values, xq.global_scale, w, out, persist=persist, prefetch=True, **tuned) for w in w_t]) / len(w_t)
                    for form, persist in (("one-tile", False), ("persistent", True))}
                if m in (32, 64):                         # persistent by MMA x token tiles x warps x split-K slice
                    row["persist_nt_rw_ms"] = {f"{'wgmma' if g else 'mma'} {t},{r},{c}": tried_ms(
                        lambda t=t, r=r, g=g, c=c: [cuda_mma.launch(xq.values, xq.global_scale, w, out, nt=t, rw=r,
                                                                    wgmma=g, cps=c, persist=True) for w in w_t]) / len(w_t)
                        for g, t, r, c in PERSIST_SWEEP if c <= k // cuda_mma.CHUNK}
                if tuned:                                 # the default from 9 tokens: `throughput_options`' launch
                    row["mma_tiled_tuned_kernel_ms"] = graph_ms(
                        lambda: [cuda_mma.launch(xq.values, xq.global_scale, w, out, **tuned) for w in w_t]) / len(w_t)
                if sweep_configs and m in (1, 16, 64):    # warps of 16 rows per CTA (`cuda_mma.tiles`)
                    row["mma_rw_ms"] = {rw: graph_ms(lambda rw=rw: [cuda_mma.launch(xq.values, xq.global_scale, w, out, rw=rw)
                                                                    for w in w_q]) / len(w_q) for rw in MMA_RW_SWEEP}
                if m in (1, 16):                          # pipeline depth x split-K slice, tiled weights
                    nt, rw = cuda_mma.tiles(m)
                    row["mma_stages_cps_ms"] = {f"{st},{c}": graph_ms(lambda st=st, c=c: [
                        cuda_mma.launch(xq.values, xq.global_scale, w, out, stages=st, cps=c) for w in w_t]) / len(w_t)
                        for st in MMA_STAGES_SWEEP for c in MMA_CPS_SWEEP
                        if c <= k // cuda_mma.CHUNK and cuda_mma._smem_bytes(nt, c, rw, st) <= cuda_mma._SMEM_LIMIT}
                if m in (32, 64):                         # token tiles x warps per CTA x split-K slice, tiled weights:
                    row["mma_nt_rw_cps_ms"] = {f"{t},{r},{c}": graph_ms(lambda t=t, r=r, c=c: [   # at M = 64 NT = 4
                        cuda_mma.launch(xq.values, xq.global_scale, w, out, nt=t, rw=r, cps=c)     # decodes every weight
                        for w in w_t]) / len(w_t)                                                 # twice; each CTA stages
                        for t in MMA_NT_SWEEP for r in (8, 16) for c in MMA_CPS_SWEEP             # its tokens' K slice
                        if c <= k // cuda_mma.CHUNK and cuda_mma._smem_bytes(t, c, r, cuda_mma.STAGES) <= cuda_mma._SMEM_LIMIT}
                if m == 64:                               # the wgmma variant by the same (NT = 8: one m64n64k16 per
                    row["wgmma_nt_rw_cps_ms"] = {f"{t},{r},{c}": tried_ms(lambda t=t, r=r, c=c: [   # k16 step and
                        cuda_mma.launch(xq.values, xq.global_scale, w, out, nt=t, rw=r, cps=c, wgmma=True)   # warpgroup,
                        for w in w_t]) / len(w_t)                         # each weight decoded once, the tokens read
                        for t in MMA_NT_SWEEP for r in (4, 8, 16) for c in MMA_CPS_SWEEP[1:]   # from shared memory)
                        if c <= k // cuda_mma.CHUNK and cuda_mma._smem_bytes(t, c, r, cuda_mma.STAGES) <= cuda_mma._SMEM_LIMIT}
                if m == 16:                               # MMA x warps per CTA x split-K slice at the default NT
                    row["small_rw_cps_ms"] = {f"{'wgmma' if g else 'mma'} {r},{c}": tried_ms(
                        lambda g=g, r=r, c=c: [cuda_mma.launch(xq.values, xq.global_scale, w, out, rw=r, cps=c, wgmma=g)
                                               for w in w_t]) / len(w_t)
                        for g, r, c in SMALL_SWEEP if c <= k // cuda_mma.CHUNK}
                if m in (1, 16):                          # quantizer + kernel (PDL) by stages: the weight chunks a
                    def chain(st):                        # warp has in flight while the quantizer still runs
                        for w in w_t:
                            q = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
                            cuda_mma.launch(q.values, q.global_scale, w, out, stages=st)
                    row["mma_tiled_linear_stages_ms"] = {st: graph_ms(lambda st=st: chain(st)) / len(w_t)
                                                         for st in LINEAR_STAGES_SWEEP}
                if m in (16, 32, 64):                     # the Triton wgmma route: codes decoded in registers as
                    cfgs = {"{BLOCK_N}x{BLOCK_K} s{num_stages} w{num_warps} split {SPLIT_K}".format(**c): c   # its
                            for c in (triton_gemm.exact_small_config(m, n, k, **o) for o in EXACT_SMALL_SWEEP)}   # first
                    row["exact_codes_kernel_ms"] = {label: tried_ms(                  # operand, tokens as its N
                        lambda c=c: [triton_gemm.launch_exact(xq, w, out, config=c) for w in w_q]) / len(w_q)
                        for label, c in cfgs.items()}
                    row["exact_tiled_kernel_ms"] = {label: tried_ms(                  # the same on the engines'
                        lambda c=c: [triton_gemm.launch_exact(xq, w, out, config=c) for w in w_t]) / len(w_t)   # layout
                        for label, c in cfgs.items() if c["BLOCK_K"] % 128 == 0}
                del w_t
                row["act_quant_ms"] = graph_ms(lambda: triton_quant.quantize_per_token_exact(x, dtype=torch.float16))
            if m <= triton_gemv.GEMV_KERNEL_MAX_M:        # gemv with the activation quantized in / before its launch
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                for fused in (True, False):
                    row[f"gemv_{'fused' if fused else 'unfused'}_ms"] = graph_ms(
                        lambda: [triton_gemv.launch_w4a4_gemv(x, w, out, fused=fused) for w in w_q]) / len(w_q)
            row["auto_path"] = triton_gemm.linear_path(m, "per_token", w_q[0])
            row["ours_ms"] = row[f"{row['auto_path']}_ms"]
            row["speedup_vs_cublas"] = cublas / row["ours_ms"]
            row["best_speedup_vs_cublas"] = cublas / min(row.get(f"{p}_ms", math.inf) for p in ("mma", "gemv", "packed", "bf16"))
            if m >= 256:                                  # the candidates, where they ran
                row["best_exact_speedup_vs_cublas"] = cublas / min(
                    (v for v in (row["exact_ms"], row["exact_codes_ms"]) if not math.isnan(v)), default=math.nan)
            row["weight_gbps"] = gbps(w_q[0].nbytes, row["ours_ms"])
            row["weight_frac_copy"] = row["weight_gbps"] / peak_gbps
            if m in (1, 16):
                if peers is None:
                    row["peer_note"] = peer_note
                else:
                    peers[0](x)                                   # JIT compile outside the graph
                    want = reference.linear(x, w_q[0]).float()
                    row["peer_rel_err"] = ((peers[0](x).float() - want).norm() / want.norm()).item()
                    row["peer_ms"] = graph_ms(lambda: [layer(x) for layer in peers]) / len(peers)
                    row["speedup_vs_peer"] = row["peer_ms"] / row["ours_ms"]
                    row["peer_speedup_vs_cublas"] = cublas / row["peer_ms"]
            if m in (1, 16) and sweep_configs:
                row["ref_ms"] = eager_ms(lambda: reference.linear(x, w_q[0]))
                sweep = {}
                for over in GEMV_SWEEP:
                    cfg = triton_gemv.gemv_config(m, n, k, **over)
                    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                    def run(cfg=cfg, out=out):
                        for w in w_q:
                            triton_gemv.launch_w4a4_gemv(x, w, out, config=cfg)
                    sweep[json.dumps(over)] = dict(cfg=cfg, ms=graph_ms(run) / len(w_q))
                best = min(sweep.values(), key=lambda v: v["ms"])
                row["sweep"] = sweep
                row["sweep_best_ms"] = best["ms"]
                row["sweep_best_cfg"] = best["cfg"]
                row["sweep_best_speedup_vs_cublas"] = cublas / best["ms"]
            log("linear", row)
        w_bf = w_q = peers = None                   # freed before the next shape's copies (not `del`: the loop's
        torch.cuda.empty_cache()                    # lambdas close over these names)


def bf16_grouped_moe(x, w13_t, w2_t, topk_w, topk_ids):
    """BF16 MoE baseline with torch._grouped_mm and the same routing / combine steps as ours."""
    t, k = topk_ids.shape
    e, _, two_i = w13_t.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[order // k], w13_t, offs=offs)
    act = torch.nn.functional.silu(h[:, : two_i // 2]) * h[:, two_i // 2:]
    y = torch._grouped_mm(act, w2_t, offs=offs).float() * topk_w.reshape(-1)[order, None]
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=x.device)
    return y[pos].view(t, k, -1).sum(1).to(x.dtype)


def vllm_bf16_moe():
    """vLLM's BF16 MoE, `fused_experts(x, w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids int32)` (what a
    BF16 vLLM engine runs for these experts), or (None, why) where vLLM is not installed."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as err:  # noqa: BLE001 - an ImportError, or vLLM failing at import on this build
        return None, f"vLLM fused_experts unavailable: {err!s:.200}"
    return (lambda x, w13, w2, tw, ti: fused_experts(x, w13, w2, tw, ti.to(torch.int32))), ""


def kernel_us(fn, repeats: int = 16) -> dict[str, float]:
    """GPU time of each kernel `fn` launches, µs per call (the torch profiler, eager launches, mean of `repeats`
    calls), by kernel name: where a launch sequence's time goes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return {ev.key[:60]: ev.self_device_time_total / repeats for ev in prof.key_averages()
            if ev.self_device_time_total > 0}


# The exact MoE GEMMs beside the defaults (`triton_moe.exact_form`): a candidate codes form (128-row tiles with
# w13's gate and up rows interleaved, one accumulator; the same bits) and the FP16 copies with the dequantization,
# the default beyond 4096 tokens until the thirtieth session (forms of the twenty-ninth: 128-row tiles)
EXACT_CODES_CANDIDATES = {"w13 codes interleaved": dict(BLOCK_N=64, num_warps=8, num_stages=4, INTERLEAVE=True)}
EXACT_FP16_FORMS = {"w13": dict(num_stages=4), "w2": dict(BLOCK_N=256, BLOCK_K=64, num_stages=4, GROUP_M=16)}


def exact_forms_ms(x, w13, w2, tw, ti) -> dict[str, float]:
    """Each weight's exact GEMM alone in its codes forms over 128- and 256-row tiles (`triton_moe.exact_form`),
    the EXACT_CODES_CANDIDATES and its FP16 copy (EXACT_FP16_FORMS, the dequantization included), and the layer on
    128- and 256-row tiles."""
    scheds = {bm: triton_moe.schedule_rows(ti, w13.shape[0], bm) for bm in (128, 256)}
    a = triton_quant.quantize_per_token_exact(x, dtype=torch.float16)
    act = torch.randn((ti.numel(), w2.shape[2]), dtype=x.dtype, device=x.device)
    b = triton_quant.quantize_per_token_exact(act, dtype=torch.float16)
    y = torch.empty((ti.numel(), w2.shape[1]), dtype=torch.float32, device=x.device)

    def launch(weight: str, cfg: dict) -> float:
        order, _, sched = scheds[cfg["BLOCK_M"]]
        index = order // ti.shape[1]                         # each pair's token row: made once, not timed
        if weight == "w13":
            return tried_ms(lambda: triton_gemm.launch_exact(a, w13, act, schedule=sched, swiglu=True, config=cfg,
                                                             a_index=index))
        return tried_ms(lambda: triton_gemm.launch_exact(b, w2, y, schedule=sched, config=cfg))
    out = {}
    for w in ("w13", "w2"):
        for rows in (128, 256):
            out[f"{w} codes {rows}-row"] = launch(w, triton_moe.exact_form(w, rows))
        out[f"{w} fp16"] = launch(w, dict(triton_moe.exact_form(w, 128), W_CODES=False, **EXACT_FP16_FORMS[w]))
    for name, form in EXACT_CODES_CANDIDATES.items():
        weight = name.split()[0]
        out[name] = launch(weight, dict(triton_moe.exact_form(weight, 128), **form))
    for rows in (128, 256):
        forms = {w: triton_moe.exact_form(w, rows) for w in ("w13", "w2")}
        out[f"layer, {rows}-row"] = tried_ms(lambda: triton_moe._moe_tiled(x, w13, w2, tw, ti, "vllm", gemm="exact",
                                                                           config=forms))
    return out


def bench_moe(log, quick: bool) -> None:
    e, h, i, k = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["top_k"]
    # as engines load a MoE layer: the tensor-core kernels compiled and the split-K tickets allocated
    dispatch.BACKENDS["triton_hopper"].prepare(torch.device("cuda"), "moe")
    w13_bf = (torch.randn(e, 2 * i, h, device="cuda") * 0.02).to(torch.bfloat16)
    w2_bf = (torch.randn(e, h, i, device="cuda") * 0.02).to(torch.bfloat16)
    w13 = triton_quant.quantize_weight(w13_bf)
    w2 = triton_quant.quantize_weight(w2_bf)
    bf_bytes = (w13_bf.numel() + w2_bf.numel()) * 2
    log("memory", dict(shape="30B-A3B MoE layer", bf16_bytes=bf_bytes, nvfp4_bytes=w13.nbytes + w2.nbytes,
                       ratio=(w13.nbytes + w2.nbytes) / bf_bytes))
    w13_t, w2_t = w13_bf.transpose(1, 2), w2_bf.transpose(1, 2)
    peer, peer_note = vllm_bf16_moe()
    for t in ((1, 4, 6, 8, 16, 32, 64, 128, 256, 1024, 8192) if quick else (1, 2, 4, 6, 8, 16, 32, 64, 128, 256, 1024, 8192)):
        n_routes = 16 if t <= 64 else 1
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        routes = [torch.topk(torch.softmax(torch.randn(t, e, device="cuda"), -1), k) for _ in range(n_routes)]
        ours = graph_ms(lambda: [triton_moe.moe(x, w13, w2, tw, ti) for tw, ti in routes]) / n_routes
        row = dict(tokens=t, ours_ms=ours, path=triton_moe.moe_path(t * k, x, w13, w2))
        if t <= 64:                               # the per-pair decode path, whichever the threshold picks
            row["pairs_ms"] = graph_ms(lambda: [triton_moe._moe_pairs(x, w13, w2, tw, ti, "vllm") for tw, ti in routes]) / n_routes
        if t in (1, 4):                           # its GEMV launches' tiles, warps and split-K target (bits may differ:
            row["pairs_config_ms"] = {            # split-K changes the order of the K sum)
                json.dumps(c): tried_ms(lambda c=c: [triton_moe._moe_pairs(x, w13, w2, tw, ti, "vllm", config=c)
                                                     for tw, ti in routes]) / n_routes for c in PAIRS_SWEEP}
        if t <= 8 or t >= 1024:                   # where the decode paths' (and the prefill path's) time goes,
            row["kernels_us"] = {path: kernel_us(lambda path=path: triton_moe.moe(x, w13, w2, *routes[0], path=path))
                                 for path in (("pairs", "mma") if t <= 8 else ("exact",))}   # kernel by kernel
        # the grouped Triton GEMM, the tensor-core kernels (forced); below 16 tokens the tensor-core grouped
        # launches alone: where they overtake the per-pair GEMVs (batch 1 is the MoE shape's missed e2e goal)
        for path in ("grouped", "mma", "exact") if t >= 16 else ("mma",):
            try:
                row[f"{path}_ms"] = graph_ms(lambda: [triton_moe.moe(x, w13, w2, tw, ti, path=path)
                                                      for tw, ti in routes]) / n_routes
            except Exception as err:  # noqa: BLE001 - e.g. the mma launch's tile limit at 8192 tokens, a
                row[f"{path}_error"] = str(err)[:300]      # Triton OutOfResources: the row goes on
        if t >= 16:                               # the exact GEMM decoding the codes itself (no FP16 copy), by
            row["exact_codes_ms"] = {                 # expert tile: wgmma N = 16 rows at decode sizes, 64 beyond
                tile: tried_ms(lambda cfg=cfg: [triton_moe._moe_tiled(x, w13, w2, tw, ti, "vllm", gemm="exact", config=cfg)
                                                for tw, ti in routes]) / n_routes
                for tile, cfg in (("16-row", EXACT_MOE_DECODE), ("64-row", dict(triton_gemm.EXACT_GROUPED, W_CODES=True)))
                if (tile == "16-row" and t <= 1024) or (tile == "64-row" and t >= 128)}
        if 16 <= t <= 1024:                       # the tensor-core kernel's warpgroup-MMA variant
            row["mma_wgmma_ms"] = {"NT 1": tried_ms(lambda: [triton_moe._moe_tiled(x, w13, w2, tw, ti, "vllm", wgmma=True)
                                                             for tw, ti in routes]) / n_routes}
            for form, opts in (("cluster", dict(cluster=True)), ("global", dict(cluster=False)),   # split-K forms
                               ("push", dict(cluster=True, push=True))):                     # (same bits)
                row[f"mma_{form}_ms"] = {"NT 1": tried_ms(lambda: [triton_moe._moe_tiled(
                    x, w13, w2, tw, ti, "vllm", **opts) for tw, ti in routes]) / n_routes}
        if 16 <= t <= 256:                        # split-K slice: `config` gives w13 4 chunks (4 slices of ~18 KB
            row["mma_cps_ms"] = {                 # of weights per CTA at 16 tokens); fewer, longer slices
                cps: tried_ms(lambda cps=cps: [triton_moe._moe_tiled(x, w13, w2, tw, ti, "vllm", cps=cps)
                                               for tw, ti in routes]) / n_routes for cps in MMA_CPS_SWEEP_MOE}
        if t >= 128:                              # token tiles of 8 per expert tile: rows per expert grow with t
            row["mma_nt_ms"] = {nt: graph_ms(lambda nt=nt: [triton_moe._moe_tiled(x, w13, w2, tw, ti, "vllm", nt=nt)
                                                            for tw, ti in routes]) / n_routes for nt in MMA_NT_SWEEP_MOE}
        if t >= 1024:   # the exact path's tile order, both weights (every order: the same bits): column tile
            default = triton_moe.exact_config(t * k, w13, w2)   # major re-reads the activations per column tile;
            row["exact_order_ms"] = {                           # GROUP_M row tiles of one expert share its weights in L2
                "G{GROUP_M}".format(**c): tried_ms(lambda c=c: [triton_moe._moe_tiled(
                    x, w13, w2, tw, ti, "vllm", gemm="exact", config={w: dict(d, **c) for w, d in default.items()})
                    for tw, ti in routes]) / n_routes
                for c in EXACT_MOE_ORDER_SWEEP}
            row["exact_forms_ms"] = exact_forms_ms(x, w13, w2, *routes[0])
        try:
            base = graph_ms(lambda: [bf16_grouped_moe(x, w13_t, w2_t, tw, ti) for tw, ti in routes]) / n_routes
            row.update(bf16_grouped_ms=base, speedup_vs_bf16_grouped=base / ours)
        except RuntimeError as err:          # record why the baseline could not run on this build
            row["bf16_grouped_error"] = str(err)[:300]
        if peer is None:
            row["vllm_bf16_note"] = peer_note
        else:
            try:
                peer(x, w13_bf, w2_bf, *routes[0])                 # its Triton kernels compiled outside the graph
                row["vllm_bf16_ms"] = graph_ms(lambda: [peer(x, w13_bf, w2_bf, tw, ti) for tw, ti in routes]) / n_routes
                row["speedup_vs_vllm_bf16"] = row["vllm_bf16_ms"] / ours
                if t <= 8 or t >= 1024:
                    row.setdefault("kernels_us", {})["vLLM BF16"] = kernel_us(lambda: peer(x, w13_bf, w2_bf, *routes[0]))
            except Exception as err:  # noqa: BLE001 - the row goes on with the reason
                row["vllm_bf16_note"] = f"vLLM fused_experts failed: {err!s:.200}"
        if t <= 16:
            tw, ti = routes[0]
            row["ref_ms"] = eager_ms(lambda: reference.moe(x, w13, w2, tw, ti))
        log("moe", row)


def same_bits_forms(xq, xc, w, out: torch.Tensor, tuned: dict) -> dict[str, bool | None]:
    """Whether each launch form that claims the default's bits on the exact rows xq (one tile a CTA, split-K
    pulled through clusters, pushed or through global planes, persistent CTAs by ring depth, the L2 prefetch, and
    the launch on the same activation's codes xc) gives them on weight w, out's shape; None where the form cannot
    run (a depth's shared memory)."""
    def run(x=xq.values, x_gs=xq.global_scale, **form) -> torch.Tensor:
        got = torch.empty_like(out)
        cuda_mma.launch(x, x_gs, w, got, **tuned, **form)
        return got.view(torch.int16)
    want, forms = run(), {"one-tile": dict(persist=False), "cluster": dict(cluster=True, push=False), "global": dict(cluster=False),
                          "push": dict(cluster=True, push=True, persist=False),
                          "prefetch": dict(prefetch=True), "persist+prefetch": dict(persist=True, prefetch=True),
                          "codes": dict(x=xc.codes, x_gs=xc.global_scale, x_scales=xc.block_scales)}
    forms |= {f"persist s{st}": dict(persist=True, stages=st) for st in MMA_STAGES_SWEEP}
    same = {}
    for name, form in forms.items():
        try:
            same[name] = torch.equal(run(**form), want)
        except Exception as err:  # noqa: BLE001 - a form that cannot run is a result
            print(f"form {name} failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
            same[name] = None
    return same


def with_x_codes(on: bool, fn):
    """fn() with the dense linears on the activation's codes (on) or its exact FP16 rows (`cuda_mma.X_CODES`),
    the switch restored after."""
    was, cuda_mma.X_CODES = cuda_mma.X_CODES, on
    try:
        return fn()
    finally:
        cuda_mma.X_CODES = was


def _decode_forms(r: dict) -> dict[str, float]:
    """A linear row's decode-size kernels alone on the engines' tiled weights, ms by form: the default tiles,
    one tile a CTA, the split-K pushed to its owners or pulled by them, the wgmma variant, persistent CTAs by ring depth, the L2 prefetch, persistent by MMA x NT x RW x CPS, the
    exact Triton GEMM by configuration."""
    forms = {"default": r.get("mma_tiled_tuned_kernel_ms", r["mma_tiled_kernel_ms"]), "wgmma": r["wgmma_tiled_kernel_ms"]}
    forms |= {"one-tile": r["one_tile_kernel_ms"]} if "one_tile_kernel_ms" in r else {}
    forms |= {"push": r["push_tiled_kernel_ms"]} if "push_tiled_kernel_ms" in r else {}
    forms |= {"pulled": r["cluster_tiled_kernel_ms"]} if "cluster_tiled_kernel_ms" in r else {}
    forms |= {"codes": r["codes_tiled_kernel_ms"]} if "codes_tiled_kernel_ms" in r else {}
    forms |= {f"persist s{st}": ms for st, ms in r.get("persist_stages_ms", {}).items()}
    forms |= {"prefetch" if f == "one-tile" else "persist+prefetch": ms for f, ms in r.get("prefetch_ms", {}).items()}
    forms |= {f"persist {c}": ms for c, ms in r.get("persist_nt_rw_ms", {}).items()}
    return forms | {f"exact {c}": ms for c, ms in r.get("exact_tiled_kernel_ms", {}).items()}


def _swept(r: dict, key: str, label: str, unit: str = "") -> str:
    """"; LABEL config: us, ...UNIT" of a row's sweep (a dict of ms by configuration), "" where it did not run."""
    return ("; " + label + " " + ", ".join(f"{c}: {ms * 1e3:.1f}" for c, ms in r[key].items()) + unit) if key in r else ""


def print_tables(records: list[dict], device: str, print=print) -> None:
    print(f"\n# {device}")
    by = lambda kind: [r for r in records if r["kind"] == kind]
    for r in by("copy"):
        print(f"copy bandwidth ({r['how']}): {r['gbps']:.0f} GB/s (bytes read + written)")
    for r in by("act_sweep") + by("weight_sweep"):
        print(f"{r['kind']} {r.get('k', '')}: best {r['best']}")
    print("\nactivation quantization (per token; codes, and exact FP16 rows as the GEMMs take them)\n"
          "     M      K   ours us   GB/s %peakcopy %tuned %samesizecopy  ref us  exact us %peakcopy")
    for r in by("act_quant"):
        ref = f"{r['ref_ms'] * 1e3:8.1f}" if r["ref_ms"] else "       -"
        print(f"{r['m']:6d} {r['k']:6d} {r['ours_ms'] * 1e3:9.2f} {r['gbps']:6.0f} {100 * r['frac_peak_copy']:9.1f}"
              f" {100 * r['tuned_frac_peak_copy']:6.1f} {100 * r['frac_same_size_copy']:13.1f} {ref}"
              f" {r['exact_ms'] * 1e3:9.2f} {100 * r['exact_frac_peak_copy']:9.1f}")
    print("\nweight conversion, Qwen3-30B-A3B layer x48")
    for r in by("weight_conversion"):
        print(f"  {r['variant']:68s} {r['model_ms']:8.1f} ms/model {r['gbps']:6.0f} GB/s {100 * r['frac_peak_copy']:5.1f}% of copy")
    print("\nlinear (us; speedup = cuBLAS / ours; peer = " + PEER + ")\n  shape           M    cuBLAS      mma     gemv"
          "   packed     bf16    exact  codes  path    speedup  wGB/s %copy    peer  peer/cuBLAS ours/peer  best-swept")
    for r in by("linear"):
        sw = f"{r['sweep_best_speedup_vs_cublas']:6.2f}x" if "sweep_best_ms" in r else ""
        peer = (f"{r['peer_ms'] * 1e3:7.1f} {r['peer_speedup_vs_cublas']:10.2f}x {r['speedup_vs_peer']:8.2f}x"
                if "peer_ms" in r else f"{'-':>7s} {'-':>11s} {'-':>9s}")
        print(f"  {r['shape']:13s} {r['m']:5d} {r['cublas_ms'] * 1e3:8.1f} {r.get('mma_ms', math.nan) * 1e3:8.1f}"
              f" {r.get('gemv_ms', math.nan) * 1e3:8.1f}"
              f" {r.get('packed_ms', math.nan) * 1e3:8.1f} {r['bf16_ms'] * 1e3:8.1f} {r.get('exact_ms', math.nan) * 1e3:8.1f} {r.get('exact_codes_ms', math.nan) * 1e3:6.1f}"
              f"  {r['auto_path']:6s} {r['speedup_vs_cublas']:5.2f}x {r['weight_gbps']:6.0f} {100 * r['weight_frac_copy']:5.1f}"
              f" {peer}  {sw}")
    for r in by("linear"):
        if "mma_kernel_ms" in r:
            print(f"  mma  {r['shape']:13s} M={r['m']:2d}: wgmma variant alone {r['wgmma_tiled_kernel_ms'] * 1e3:.1f} us, "
                  f"split-K pulled through clusters {r['cluster_tiled_kernel_ms'] * 1e3:.1f} us, pushed to their owners "
                  f"{r['push_tiled_kernel_ms'] * 1e3:.1f} us, through global planes "
                  f"{r['global_tiled_kernel_ms'] * 1e3:.1f} us vs the default "
                  f"{r.get('mma_tiled_tuned_kernel_ms', r['mma_tiled_kernel_ms']) * 1e3:.1f} (tiled weights, same tiles)"
                  + _swept(r, "persist_stages_ms", "persistent CTAs by stages")
                  + _swept(r, "prefetch_ms", "with the L2 prefetch")
                  + _swept(r, "persist_nt_rw_ms", "persistent by mma nt,rw,cps"))
            print(f"  mma  {r['shape']:13s} M={r['m']:2d}: tiled linear (quantizer + kernel) {r['mma_tiled_linear_ms'] * 1e3:.1f} us "
                  f"({r['cublas_ms'] / r['mma_tiled_linear_ms']:.2f}x cuBLAS), kernel alone {r['mma_kernel_ms'] * 1e3:.1f} us "
                  f"({r['cublas_ms'] / r['mma_kernel_ms']:.2f}x cuBLAS), tiled weights {r['mma_tiled_kernel_ms'] * 1e3:.1f} us "
                  f"({r['cublas_ms'] / r['mma_tiled_kernel_ms']:.2f}x), activation quantization {r['act_quant_ms'] * 1e3:.1f} us"
                  + (f", on exact rows (X_CODES=0): linear {r['rows_tiled_linear_ms'] * 1e3:.1f} us "
                     f"({r['cublas_ms'] / r['rows_tiled_linear_ms']:.2f}x cuBLAS); activation codes: kernel "
                     f"{r['codes_tiled_kernel_ms'] * 1e3:.1f} us" if "rows_tiled_linear_ms" in r else "")
                  + _swept(r, "mma_rw_ms", "by warps per CTA")
                  + _swept(r, "mma_stages_cps_ms", "tiled by stages,cps")
                  + _swept(r, "mma_tiled_linear_stages_ms", "linear by stages")
                  + _swept(r, "mma_nt_rw_cps_ms", "tiled by nt,rw,cps")
                  + _swept(r, "small_rw_cps_ms", "tiled by rw,cps")
                  + _swept(r, "wgmma_nt_rw_cps_ms", "wgmma by nt,rw,cps"))
    for r in by("linear"):
        if "exact_codes_kernel_ms" in r:
            print(f"  exact {r['shape']:13s} M={r['m']}: codes decoded in the wgmma kernel, alone (mma kernel "
                  f"{r['mma_kernel_ms'] * 1e3:.1f} us) " + ", ".join(f"{c}: {ms * 1e3:.1f}" for c, ms in
                                                                     r["exact_codes_kernel_ms"].items()) + " us"
                  + _swept(r, "exact_tiled_kernel_ms", "on mma_tiled codes", " us"))
        if "exact_tiles_ms" in r:
            print(f"  exact {r['shape']:13s} M={r['m']}: GEMM alone by tiles (cuBLAS {r['cublas_ms'] * 1e3:.1f} us) "
                  + ", ".join(f"{c}: {ms * 1e3:.1f}" for c, ms in r["exact_tiles_ms"].items()) + " us")
        if "bf16_blocks_ms" in r:
            print(f"  bf16 {r['shape']:13s} M={r['m']}: the path by column blocks of its FP32 product (one block "
                  f"{r['bf16_ms'] * 1e3:.1f} us, cuBLAS {r['cublas_ms'] * 1e3:.1f}) " + ", ".join(
                      f"{c}: {ms * 1e3:.1f} ({r['cublas_ms'] / ms:.2f}x)" for c, ms in r["bf16_blocks_ms"].items()) + " us")
    decode = [r for r in by("linear") if "mma_tiled_kernel_ms" in r]
    if decode:
        print("\nDecode forms, kernel alone on tiled weights, us (* the fastest; x: cuBLAS BF16 / the fastest)")
    for r in decode:
        forms = _decode_forms(r)
        best = min(forms, key=lambda f: math.inf if math.isnan(forms[f]) else forms[f])
        print(f"  {r['shape']:13s} M={r['m']:2d}: " + ", ".join(f"{'*' * (f == best)}{f} {ms * 1e3:.1f}" for f, ms in forms.items())
              + f"  ({r['cublas_ms'] / forms[best]:.2f}x cuBLAS, {forms['default'] / forms[best]:.2f}x the default)")
        differ = [f for f, same in r.get("same_bits", {}).items() if same is False]
        print(f"      bits of the default: {'DIFFER in ' + ', '.join(differ) if differ else 'same'} "
              f"({sum(v is not None for v in r.get('same_bits', {}).values())} forms checked)")
    for r in by("linear"):
        if "gemv_fused_ms" in r:
            print(f"  gemv {r['shape']:13s} M={r['m']:2d}: quantization fused {r['gemv_fused_ms'] * 1e3:.1f} us, "
                  f"separate launch {r['gemv_unfused_ms'] * 1e3:.1f} us")
    notes = {r["peer_note"] for r in by("linear") if "peer_note" in r}
    for note in notes:
        print(f"  note: {note}")
    print("\nMoE Qwen3-30B-A3B layer (128 experts, top-8, 2048 -> 768); us, speedup = BF16 grouped / ours, "
          "vs vLLM = vLLM BF16 fused_experts / ours\n"
          "  tokens   ours  path     pairs  grouped      mma    exact  bf16 grouped  speedup  vLLM bf16  vs vLLM   ref")
    us = lambda r, key: f"{r[key] * 1e3:8.1f}" if key in r else f"{'-':>8s}"
    for r in by("moe"):
        speed = f"{r['speedup_vs_bf16_grouped']:8.2f}x" if "bf16_grouped_ms" in r else f"{'error':>9s}"
        vs_vllm = f"{r['speedup_vs_vllm_bf16']:8.2f}x" if "vllm_bf16_ms" in r else f"{'-':>9s}"
        ref = f"{r['ref_ms'] * 1e3:6.0f}" if "ref_ms" in r else ""
        print(f"  {r['tokens']:6d} {us(r, 'ours_ms')}  {r['path']:7s}{us(r, 'pairs_ms')} {us(r, 'grouped_ms')} "
              f"{us(r, 'mma_ms')} {us(r, 'exact_ms')}  {us(r, 'bf16_grouped_ms'):>12s} {speed} "
              f"{us(r, 'vllm_bf16_ms'):>10s} {vs_vllm} {ref}")
    for note in {r["vllm_bf16_note"] for r in by("moe") if "vllm_bf16_note" in r}:
        print(f"  note: {note}")
    for key, label in (("mma_wgmma_ms", "mma, warpgroup-MMA variant"), ("mma_cluster_ms", "mma, split-K through clusters"),
                       ("mma_global_ms", "mma, split-K through global planes"),
                       ("mma_push_ms", "mma, split-K pushed to the owners"),
                       ("pairs_config_ms", "pairs by GEMV launch configuration"),
                       ("mma_cps_ms", "mma by split-K slice (chunks)"),
                       ("mma_nt_ms", "mma by NT (token tiles of 8 per expert tile)"),
                       ("exact_codes_ms", "exact, codes decoded in the GEMM, by expert tile"),
                       ("exact_order_ms", "exact (the default's forms), by row tiles per column sweep (G, 0: all)"),
                       ("exact_forms_ms", "exact, each weight's GEMM alone by form (codes by tile rows, candidates, FP16 experts)")):
        for r in by("moe"):
            if key in r:
                print(f"  {r['tokens']:6d} tokens, {label}: "
                      + ", ".join(f"{c}: {ms * 1e3:.1f}" for c, ms in r[key].items()) + " us")
    for r in by("moe"):
        for path, kernels in r.get("kernels_us", {}).items():
            print(f"  {r['tokens']:6d} tokens, {path} by kernel (profiler, eager): "
                  + ", ".join(f"{name}: {us:.1f}" for name, us in kernels.items()) + " us")
    for r in by("error"):
        print(f"\nERROR in {r['section']}: {r['error'][-600:]}")
    print("\nmemory (packed + scales) / BF16")
    for r in by("memory"):
        print(f"  {r['shape']:20s} {r['ratio']:.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench_kernels.json", help="where to write the records")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--only", default="act,weight,moe,linear", help="comma-separated sections (copy always runs)")
    p.add_argument("--shapes", default=",".join(LINEAR_SHAPES),
                   help="comma-separated linear shapes (spaces in names may be written as _)")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweeps and the eager reference")
    p.add_argument("--ms", help="comma-separated token counts of the linear section (default: by --quick)")
    args = p.parse_args(argv)
    shapes = [{k.replace(" ", "_"): k for k in LINEAR_SHAPES}.get(sh, sh) for sh in args.shapes.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    device = (f"{props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, triton {triton.__version__}, "
              f"CUDA {torch.version.cuda}, python {platform.python_version()}")
    records: list[dict] = []
    start = time.time()

    def log(kind, rec):
        records.append(dict(kind=kind, **rec))
        with open(args.json, "w") as f:                      # rewritten per record: a cut run keeps its numbers
            json.dump(dict(device=device, seconds=time.time() - start, records=records), f, indent=1)
        print(kind, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in rec.items() if k != "sweep"}, flush=True)

    only = set(args.only.split(","))
    peak = bench_copy(log)
    sections = {"act": lambda: bench_act_quant(log, peak, args.quick), "weight": lambda: bench_weight_conversion(log, peak),
                "moe": lambda: bench_moe(log, args.quick), "linear": lambda: bench_linear(
                    log, peak, args.quick, shapes, not args.no_sweep, tuple(map(int, args.ms.split(","))) if args.ms else None)}
    for name, run in sections.items():
        if name not in only:
            continue
        try:
            run()
        except Exception as err:             # keep the other sections' numbers; the error is recorded
            log("error", dict(section=name, error=f"{type(err).__name__}: {str(err)[-2000:]}"))
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(dict(device=device, seconds=time.time() - start, records=records), f, indent=1)
    print_tables(records, device)
    with open(args.json.rsplit(".", 1)[0] + ".txt", "w") as f:
        print_tables(records, device, print=lambda *a: f.write(" ".join(map(str, a)) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
