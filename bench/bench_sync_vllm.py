"""Colocated weight sync into a real vLLM engine (issue 20: the whole Qwen3-30B-A3B in <= 1.0 s, as verl
and TRL colocate run vLLM), nvfp4_sampler vs a BF16 engine, side by side in one run.

A random BF16 Qwen3-30B-A3B-shaped checkpoint with --layers of its 48 layers is built on the GPU
(`testing/checkpoints.py`). One process per engine, each with the engine core in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and the trainer's state beside it on the same GPU: the checkpoint's
tensors, perturbed (x (1 + 2^-6)) so that every update writes new values. Per path, a first update, then
the median of --repeats (each timed to a device synchronisation):
  nvfp4 colocated      `server.colocated.ColocatedRefit.update`: planned fused entries quantized into
                       buffers on the trainer's GPU, one NaN/Inf check, one copy per tensor kind per entry
  nvfp4 load_weights   `model.load_weights(state.items())` on the nvfp4_sampler engine (TRL's and verl's
                       call; each tensor quantized on arrival by its weight loader)
  bf16 load_weights    the same call on a BF16 engine: what colocated RL refits today
Seconds are scaled x48/layers to the whole model (embeddings and lm_head counted once per layer count
here, so slightly over-scaled).

    python3 bench/bench_sync_vllm.py [--layers 8] [--repeats 3] [--out FILE.json]
(on the H200: `bash bench/h200.sh bench_sync_vllm`)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_LAYERS = 48
EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def worker(ckpt: str, quant: str, repeats: int, out: str) -> None:
    """One engine: time every path it serves, write {path: {"first", "median", "runs"}} to `out`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from safetensors.torch import load_file
    from vllm import LLM

    llm = LLM(ckpt, quantization=None if quant == "bf16" else quant, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=256, kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.9, enforce_eager=True,
              enable_prefix_caching=False, seed=0, worker_extension_cls=EXTENSION)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    state = load_file(str(Path(ckpt) / "model.safetensors"), device="cuda")
    for t in state.values():
        t.mul_(1 + 2 ** -6)
    config = json.loads((Path(ckpt) / "config.json").read_text())
    paths = {f"{'bf16' if quant == 'bf16' else 'nvfp4'} load_weights": lambda: model.load_weights(list(state.items()))}
    result: dict = {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}
    if quant != "bf16":
        from nvfp4_sampler.server.colocated import ColocatedRefit

        t0 = time.perf_counter()
        refit = ColocatedRefit(llm, state, config=config)
        result["colocated_setup_s"] = time.perf_counter() - t0
        result["colocated_entries"] = len(refit.plan.entries)
        result["colocated_buffer_bytes"] = sum(b.numel() for b in refit.buffers)
        version = iter(range(1, 1000))

        def colocated():
            result["colocated_report"] = refit.update(next(version))      # the last one's host seconds by step
        paths = {"nvfp4 colocated": colocated, **paths}
    for name, fn in paths.items():
        runs = [_timed(fn) for _ in range(repeats + 1)]
        result[name] = {"first": runs[0], "median": statistics.median(runs[1:]), "runs": runs}
        Path(out).write_text(json.dumps(result))
        print(f"{quant}: {name}: {result[name]}", flush=True)
    del llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, metavar=("CKPT", "QUANT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.repeats, args.worker[2])
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (vLLM's CUDA build)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from nvfp4_sampler.testing.checkpoints import build

    results: dict = {"device": torch.cuda.get_device_name(), "layers": args.layers, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="bench-sync-vllm-") as tmp:
        ckpt = build(Path(tmp) / "ckpt", "qwen3-30b-a3b", seed=0, layers=args.layers)
        torch.cuda.empty_cache()
        for quant in ("nvfp4_sampler", "bf16"):
            out = Path(tmp) / f"{quant}.json"
            proc = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--worker", str(ckpt),
                                   quant, str(out)], cwd=ROOT, capture_output=True, text=True)
            results["engines"][quant] = json.loads(out.read_text()) if out.exists() else {}
            if proc.returncode:
                results["engines"][quant]["error"] = proc.stderr[-3000:]
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    scale = FULL_LAYERS / args.layers
    print(f"\ncolocated weight sync, {results['device']}, Qwen3-30B-A3B shape, {args.layers} of 48 layers, "
          f"in-process engines, seconds per update (median of {args.repeats} after a first)")
    print("| path | first s | median s | x48 s |\n|---|---:|---:|---:|")
    for quant, r in results["engines"].items():
        for name, v in r.items():
            if isinstance(v, dict) and "median" in v:
                print(f"| {name} | {v['first']:.3f} | {v['median']:.3f} | {v['median'] * scale:.2f} |")
        if "error" in r:
            print(f"| {quant} | failed: {r['error'][-300:]!r} | | |")
    nv = results["engines"].get("nvfp4_sampler", {})
    if "colocated_entries" in nv:
        print(f"colocated plan: {nv['colocated_entries']} entries, buffers {nv['colocated_buffer_bytes'] / 1e9:.2f} GB, "
              f"set-up {nv['colocated_setup_s']:.2f} s; goal: x48 <= 1.0 s")
    rep = nv.get("colocated_report")
    if rep:
        steps = ", ".join(f"{k} {v:.3f}" for k, v in rep.get("steps", {}).items())
        print(f"last colocated update, host seconds: convert {rep['convert_seconds']:.3f}, check (waits for the "
              f"conversion) {rep['check_seconds']:.3f}, worker {rep['worker_seconds']:.3f} ({steps}), "
              f"all {rep['seconds']:.3f}")
    return 0 if all("error" not in r for r in results["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
