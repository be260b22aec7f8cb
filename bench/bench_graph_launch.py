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

    python3 bench/bench_graph_launch.py [--layers 36] [--ms 16,64] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nvfp4_sampler.kernels import cuda_mma, triton_gemm, triton_quant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}   # (N, K)
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


def print_table(results: dict, device: str, layers: int, print=print) -> None:
    print(f"\n# {device}; Qwen3-8B linears x {layers} layers as one CUDA graph; medians of {REPEATS}")
    print(f"  {'M':>3}  {'form':<22} {'kernels':>7} {'host us':>9} {'us/kernel':>9} {'GPU us':>9} {'host/GPU':>8}")
    for m, rows in results.items():
        for form, r in rows.items():
            print(f"  {m:>3}  {form:<22} {r['kernels']:>7} {r['host_us']:>9.1f} {r['host_us'] / max(r['kernels'], 1):>9.2f}"
                  f" {r['gpu_us']:>9.1f} {r['host_us'] / r['gpu_us']:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--ms", default="16,64", help="comma-separated token counts")
    ap.add_argument("--json")
    args = ap.parse_args()
    ok, reason = cuda_mma.prepare(torch.device("cuda"))
    if not ok:
        raise SystemExit(f"cuda_mma cannot run here: {reason}")
    device = torch.cuda.get_device_name()
    results = {}
    for m in (int(v) for v in args.ms.split(",")):
        results[m] = run(args.layers, m)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "layers": args.layers, "results": results}, f, indent=1)
    print_table(results, device, args.layers)


if __name__ == "__main__":
    main()
