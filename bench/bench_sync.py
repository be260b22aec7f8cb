"""Weight sync through the sidecar on loopback, and log-prob recompute overhead.

In one run, against one served model:
  NVFP4 push: trainer-side conversion (converters) + stream + commit (triplets loaded as they are)
  BF16 push:  stream + commit (the sampler quantizes on arrival)
each `--repeats` times (median reported), then log-prob recompute through the sidecar vs the
engine's own /v1/completions (vLLM only). Prints a markdown table for docs/BENCHMARKS.md.

    flock /tmp/nvfp4-engine.lock .venv/bin/python bench/bench_sync.py [--model smollm2|tiny|PATH] [--engine vllm|embedded]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from server.client import SamplerClient
from server.engines.vllm import vllm_server
from server.process import free_port, remote_sidecar, sidecar

ROOT = Path(__file__).resolve().parents[1]
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "2048"]


def _model(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name)
    builder = {"smollm2": "smollm2", "tiny": "tiny_qwen3"}[name]
    args = [] if name == "smollm2" else [tempfile.mkdtemp(prefix="bench-tiny-")]
    out = subprocess.run([sys.executable, "-m", "tests.models", builder, *args], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return Path(out)


def _pushes(client: SamplerClient, model: Path, layout: str, repeats: int) -> dict[str, float]:
    runs = [client.push(model, layout=layout, progress=False) for _ in range(repeats)]
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    return {"bytes": runs[0].payload_bytes, "prepare": med(lambda r: r.prepare_seconds),
            "send": med(lambda r: r.send_seconds), "commit": med(lambda r: r.commit_seconds),
            "apply": med(lambda r: r.commit.apply_seconds), "total": med(lambda r: r.total_seconds)}


def _recompute(url: str, direct: str | None, model_id: str, seqs: list[list[int]], repeats: int) -> dict[str, float]:
    """Median seconds of one batched recompute through the sidecar and (vLLM) directly."""
    plens = [len(s) // 4 for s in seqs]
    with httpx.Client(timeout=600) as h:
        calls = {"sidecar": lambda: h.post(f"{url}/v1/logprobs", json={"sequences": seqs, "prompt_lens": plens})}
        if direct is not None:
            body = {"model": model_id, "prompt": seqs, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                    "return_tokens_as_token_ids": True}
            calls["engine"] = lambda: h.post(f"{direct}/v1/completions", json=body)
        for name, call in calls.items():
            call().raise_for_status()                     # warm-up
        times = {name: [] for name in calls}
        for _ in range(repeats):                          # interleaved, so drift hits both alike
            for name, call in calls.items():
                t = time.perf_counter()
                call().raise_for_status()
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | a HF folder")
    p.add_argument("--engine", choices=("vllm", "embedded"),
                   default="vllm" if importlib.util.find_spec("vllm") else "embedded")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences per log-prob request")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()

    model = _model(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    with contextlib.ExitStack() as stack:
        if args.engine == "vllm":
            engine = stack.enter_context(vllm_server(model, port=free_port(), log=work / "vllm.log", extra=VLLM_ARGS))
            srv = stack.enter_context(remote_sidecar(engine.url, log=work / "sidecar.log"))
            direct = engine.url
        else:
            srv = stack.enter_context(sidecar(model, engine="embedded", log=work / "sidecar.log"))
            direct = None
        client = stack.enter_context(SamplerClient(srv.url))
        nv = _pushes(client, model, "nvfp4", args.repeats)
        bf = _pushes(client, model, "bf16", args.repeats)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        seqs = torch.randint(0, vocab, (args.seqs, args.seq_len), generator=gen).tolist()
        rec = _recompute(srv.url, direct, client.version().model, seqs, args.repeats * 3)

    print(f"\nmodel {model.name}, engine {args.engine}, medians of {args.repeats} pushes, loopback HTTP\n")
    print("| push | payload MB | prepare s | send s | commit s (apply) | total s | payload GB/s (send) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in (("NVFP4 (converted on trainer side)", nv), ("BF16 (quantized on sampler side)", bf)):
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {r['prepare']:.2f} | {r['send']:.2f} | "
              f"{r['commit']:.2f} ({r['apply']:.2f}) | {r['total']:.2f} | {r['bytes'] / r['send'] / 1e9:.2f} |")
    print(f"\nNVFP4 / BF16: total {nv['total'] / bf['total']:.2f}x, bytes {nv['bytes'] / bf['bytes']:.2f}x")
    line = f"log-prob recompute, {args.seqs} x {args.seq_len} tokens: sidecar {rec['sidecar'] * 1e3:.0f} ms"
    if "engine" in rec:
        line += f", engine directly {rec['engine'] * 1e3:.0f} ms ({rec['sidecar'] / rec['engine']:.2f}x)"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
