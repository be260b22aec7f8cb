"""Colocated weight sync into a real vLLM engine (issue 20: the whole Qwen3-30B-A3B in <= 1.0 s, as verl
and TRL colocate run vLLM), nvfp4_sampler vs a BF16 engine, side by side in one run.

No BF16 checkpoint touches the disk (the whole model's would not fit the device's): the nvfp4_sampler
engine loads a pre-quantized placeholder checkpoint of the shapes (~17 GB at 48 layers,
`bench_sync.write_nvfp4_folder`), the BF16 engine vLLM's dummy weights (`load_format="dummy"`, config.json
only). One process per engine, each with the engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and
the trainer's state beside it on the same GPU, built there after the engine (`bench_sync.model_tensors`:
random BF16 in transformers-5 form, experts fused), so the first update changes every value (the repeats write
the same values again, as before). Per path, a first update, then the median of --repeats (each timed to a
device synchronisation):
  nvfp4 colocated      `server.colocated.ColocatedRefit.update`: planned fused entries quantized into
                       buffers on the trainer's GPU, one NaN/Inf check, one copy per tensor kind per entry
  nvfp4 load_weights   `model.load_weights(...)` on the nvfp4_sampler engine (TRL's and verl's call, with
                       the checkpoint's per-expert names; each tensor quantized on arrival by its loader)
  bf16 load_weights    the same call on a BF16 engine: what colocated RL refits today
Seconds are scaled x48/--layers to the whole model (embeddings and lm_head counted once per layer count
here, so slightly over-scaled below 48). Memory: the BF16 process holds the model twice (engine and
trainer, ~123 GB at 48 layers: an H200), the nvfp4 one the trainer's BF16, the engine's NVFP4 and the
refit's buffers (~95 GB); 24 layers fit an 80 GB GPU, and so do 48 with --distinct-layers 12 (the trainer's
layers alias 12 layers' storage, `bench_sync.model_tensors`: every update still reads each layer's bytes).

    python3 bench/bench_sync_vllm.py [--layers 8] [--repeats 3] [--distinct-layers N] [--out FILE.json]
(on the device: `bash bench/h200.sh bench_sync_vllm`, `bench_sync_vllm_24`, `bench_sync_vllm_48`,
`bench_sync_vllm_whole`)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_LAYERS = 48
EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"
QUICK = {"num_hidden_layers": 1, "num_experts": 8, "vocab_size": 512}   # --quick: the script checked on the CPU


def engine_folders(cfg: dict, tmp: Path) -> dict[str, Path]:
    """What each engine starts from: a pre-quantized placeholder checkpoint (nvfp4_sampler) and a folder
    holding config.json only (BF16, dummy weights)."""
    from bench.bench_sync import write_nvfp4_folder

    bf16 = tmp / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"nvfp4_sampler": write_nvfp4_folder(cfg, tmp / "nvfp4"), "bf16": bf16}


def worker(folder: str, quant: str, repeats: int, distinct: int | None, out: str) -> None:
    """One engine: time every path it serves, write {path: {"first", "median", "runs"}} to `out`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    sys.path.insert(0, str(ROOT))
    import torch
    from vllm import LLM

    from bench.bench_sync import model_tensors, timed
    from nvfp4_sampler.converters import name_map

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpu = dict(kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.9) if cuda else {}
    llm = LLM(folder, quantization=None if quant == "bf16" else quant, load_format="dummy" if quant == "bf16" else "auto",
              dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
              enable_prefix_caching=False, seed=0, worker_extension_cls=EXTENSION, **gpu)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    config = json.loads((Path(folder) / "config.json").read_text())
    state = model_tensors(config, device, distinct)
    # load_weights takes checkpoint names (one tensor per expert): views of the trainer's fused tensors
    named = [(m.name, t if m.index is None else t[m.index])
             for n, t in state.items() for m in name_map.expand(n, tuple(t.shape))]
    paths = {f"{'bf16' if quant == 'bf16' else 'nvfp4'} load_weights": lambda: model.load_weights(named)}
    result: dict = {"tensors": len(named), "bytes": sum(t.numel() * t.element_size() for t in state.values())}
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
        runs = [timed(device, fn) for _ in range(repeats + 1)]
        result[name] = {"first": runs[0], "median": statistics.median(runs[1:]), "runs": runs}
        Path(out).write_text(json.dumps(result))
        print(f"{quant}: {name}: {result[name]}", flush=True)
    del llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="check of the script: 1 layer, 8 experts, 1 repeat (CPU: the "
                    "nvfp4_sampler engine only)")
    ap.add_argument("--distinct-layers", type=int, default=None,
                    help="trainer layers with storage of their own (the rest alias them): 48 layers on 80 GB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, metavar=("FOLDER", "QUANT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.repeats, args.distinct_layers, args.worker[2])
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not (cuda or args.quick):
        print("needs a CUDA GPU (vLLM's CUDA build); --quick checks the script on the CPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from nvfp4_sampler.testing import manifests

    cfg = {**manifests.QWEN3_30B_A3B, "num_hidden_layers": args.layers}
    if args.quick:
        cfg, args.layers, args.repeats = cfg | QUICK, 1, 1
    device = torch.cuda.get_device_name() if cuda else f"CPU x{os.cpu_count()}"
    results: dict = {"device": device, "layers": args.layers, "distinct_layers": args.distinct_layers, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="bench-sync-vllm-") as tmp:
        t0 = time.perf_counter()
        folders = engine_folders(cfg, Path(tmp))
        print(f"engine folders written in {time.perf_counter() - t0:.1f} s", flush=True)
        if not cuda:                            # vLLM's CPU build repacks BF16 linears at load, dropping weight_loader
            print("CPU: the BF16 engine's load_weights cannot run on vLLM's CPU build; nvfp4_sampler only", flush=True)
            del folders["bf16"]
        for quant, folder in folders.items():
            out = Path(tmp) / f"{quant}.json"
            distinct = ["--distinct-layers", str(args.distinct_layers)] if args.distinct_layers else []
            proc = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), *distinct, "--worker",
                                   str(folder), quant, str(out)], cwd=ROOT, capture_output=True, text=True)
            results["engines"][quant] = json.loads(out.read_text()) if out.exists() else {}
            if proc.returncode:
                results["engines"][quant]["error"] = proc.stderr[-3000:]
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
            shutil.rmtree(folder)                                          # its engine has loaded it
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
