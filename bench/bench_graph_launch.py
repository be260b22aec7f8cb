"""Host cost of launching a decode step's linears as one CUDA graph, by launch form (one CUDA GPU).

The twelfth session's e2e profile (docs/BENCHMARKS.md, H100, qwen3-8b at batch 64) read the nvfp4 engine's
host spending 1145 us a step in cudaGraphLaunch against BF16's 584, and its GPU waiting 444 us a step for the
host. This bench measures the launch alone: the Qwen3-8B linears (qkv, o, gate_up, down) of LAYERS layers at
M tokens, captured as one CUDA graph per form, as engines run them (per-token quantizer, then `cuda_mma`):
BF16 cuBLAS (`torch.mm`), and nvfp4 with and without programmatic dependent launch (`cuda_mma.PDL` "1" /
"0") and with split-K through thread-block clusters or global planes (`cuda_mma.CLUSTER`). For each: kernels
a step, the host's time in one `replay()` (cudaGraphLaunch) with the GPU idle before it, and the GPU's time a
step (CUDA events), medians of REPEATS. Every form gives the same bits (tests/test_gpu_mma_persist.py); one
layer's weights serve every layer (the launches, not the weights' bytes, are what is timed). Its first run
(thirteenth session, H100) found the programmatic launches the host's extra cost (M = 16: 254 vs 153 us),
which the e2e bench confirmed; the default launches them at one token only since (`cuda_mma.pdl_default`).

--chain MODEL times something else: a decode step's linears of MODEL over LAYERS layers with **distinct** weights
(their bytes beyond L2, as in an engine), BF16 cuBLAS against nvfp4 as engines run it and nvfp4 with each linear's
kernel asking L2 for the next linear's weight (`triton_gemm.linear(next_weight=...)`, the same bits): whether the
next weight's DRAM time hides behind the launch before it (the small decode launches sit near a latency floor, 5-9
µs for 2-14 MB: docs/BENCHMARKS.md). Attention, norms and the quantizer-free BF16 ops of a real step run between
the linears there and give the prefetch more time than this chain does.

    python3 bench/bench_graph_launch.py [--layers 36] [--ms 16,64] [--chain 1.7b|8b|30b-a3b] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nvfp4_sampler.kernels import cuda_mma, triton_gemm, triton_quant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}   # (N, K)
CHAIN_SHAPES = {"8b": SHAPES,                                    # --chain: a layer's linears in execution order
                "1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
                "30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096)}}   # its attention (the MoE between: bench_moe)
FORMS = {"nvfp4 PDL": ("1", True), "nvfp4 no PDL": ("0", True),     # name: (`cuda_mma.PDL`, split-K through clusters)
         "nvfp4 PDL global split-K": ("1", False), "nvfp4 global split-K": ("0", False)}
REPEATS = 50


def kernels_per_step(step) -> int:
    """CUDA kernels one eager call of step launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def time_graph(step) -> dict:
    """{kernels, host_us, gpu_us} of step captured as one CUDA graph (after an eager warm-up call)."""
    step()
    torch.cuda.synchronize()
    kernels = kernels_per_step(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return dict(kernels=kernels, host_us=statistics.median(host), gpu_us=statistics.median(gpu))


def run(layers: int, m: int) -> dict[str, dict]:
    """Every form's `time_graph` at M tokens."""
    dense = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
    tiled = {name: cuda_mma.tile_weight(triton_quant.quantize_weight(w)) for name, w in dense.items()}
    rows = {"bf16": time_graph(lambda: [torch.mm(xs[s], dense[s].t()) for _ in range(layers) for s in SHAPES])}
    saved = cuda_mma.PDL, cuda_mma.CLUSTER
    try:
        for form, (pdl, cluster) in FORMS.items():
            cuda_mma.PDL, cuda_mma.CLUSTER = pdl, cluster          # read at each launch
            rows[form] = time_graph(lambda: [triton_gemm.linear(xs[s], tiled[s]) for _ in range(layers) for s in SHAPES])
    finally:
        cuda_mma.PDL, cuda_mma.CLUSTER = saved
    return rows


def run_chain(model: str, layers: int, m: int) -> dict[str, dict]:
    """`time_graph` of MODEL's linears over `layers` layers of distinct weights at M tokens: BF16, nvfp4, and nvfp4
    with each launch prefetching the next linear's weight (the last linear's: none)."""
    shapes = CHAIN_SHAPES[model]
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in shapes.items()}
    dense, tiled = [], []
    for _ in range(layers):
        layer = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in shapes.items()}
        dense.append(layer)
        tiled.append({name: cuda_mma.tile_weight(triton_quant.quantize_weight(w)) for name, w in layer.items()})
    order = [(layer, name) for layer in range(layers) for name in shapes]
    nxt = {step: (tiled[order[i + 1][0]][order[i + 1][1]] if i + 1 < len(order) else None)
           for i, step in enumerate(order)}
    return {"bf16": time_graph(lambda: [torch.mm(xs[s], dense[l][s].t()) for l, s in order]),
            "nvfp4": time_graph(lambda: [triton_gemm.linear(xs[s], tiled[l][s]) for l, s in order]),
            "nvfp4 next prefetched": time_graph(lambda: [triton_gemm.linear(xs[s], tiled[l][s], next_weight=nxt[l, s])
                                                         for l, s in order])}


def print_table(results: dict, device: str, layers: int, print=print) -> None:
    print(f"\n# {device}; Qwen3-8B linears x {layers} layers as one CUDA graph; medians of {REPEATS}")
    print(f"  {'M':>3}  {'form':<22} {'kernels':>7} {'host us':>9} {'us/kernel':>9} {'GPU us':>9} {'host/GPU':>8}")
    for m, rows in results.items():
        for form, r in rows.items():
            print(f"  {m:>3}  {form:<22} {r['kernels']:>7} {r['host_us']:>9.1f} {r['host_us'] / max(r['kernels'], 1):>9.2f}"
                  f" {r['gpu_us']:>9.1f} {r['host_us'] / r['gpu_us']:>8.2f}")


def print_chain(results: dict, device: str, model: str, layers: int, print=print) -> None:
    print(f"\n# {device}; {model} linears x {layers} layers (distinct weights) as one CUDA graph; GPU us a layer, "
          f"medians of {REPEATS}")
    print(f"  {'M':>3}  {'bf16':>8} {'nvfp4':>8} {'+ next':>8}  {'nvfp4/bf16':>10} {'+next/bf16':>10} {'+next/nvfp4':>11}")
    for m, r in results.items():
        b, n, p = (r[f]["gpu_us"] / layers for f in ("bf16", "nvfp4", "nvfp4 next prefetched"))
        print(f"  {m:>3}  {b:>8.1f} {n:>8.1f} {p:>8.1f}  {b / n:>9.2f}x {b / p:>9.2f}x {n / p:>10.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--ms", default="16,64", help="comma-separated token counts")
    ap.add_argument("--chain", choices=sorted(CHAIN_SHAPES), help="time MODEL's linears with the next-weight prefetch")
    ap.add_argument("--json")
    args = ap.parse_args()
    ok, reason = cuda_mma.prepare(torch.device("cuda"))
    if not ok:
        raise SystemExit(f"cuda_mma cannot run here: {reason}")
    device = torch.cuda.get_device_name()
    results = {}
    for m in (int(v) for v in args.ms.split(",")):
        results[m] = run_chain(args.chain, args.layers, m) if args.chain else run(args.layers, m)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "layers": args.layers, "chain": args.chain, "results": results}, f,
                          indent=1)
    if args.chain:
        print_chain(results, device, args.chain, args.layers)
    else:
        print_table(results, device, args.layers)


if __name__ == "__main__":
    main()
