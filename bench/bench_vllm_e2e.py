"""End-to-end decode throughput in real CUDA vLLM: nvfp4_sampler vs BF16, same compilation mode (H200).

For each model shape (random BF16 checkpoints built on the GPU, `testing/checkpoints.py`) two
engines, one per process: BF16 and `quantization="nvfp4_sampler"` (online quantization of the same
checkpoint). Each measures, per batch size B, decode tokens/s = B * (N - 1) / (t(N) - t(1)) where t(n)
is the wall time of `generate` for B prompts of PROMPT_LEN tokens and n new tokens (greedy, ignore_eos):
subtracting the one-token run removes prefill and scheduling start-up. Layer counts are cut (shown in the
table) so the run fits one device command; lm_head and embeddings are BF16 in both engines, so fewer
layers weigh the common lm_head more than the full model would (the ratio is then closer to 1).

    python3 bench/bench_vllm_e2e.py [--quick | --shapes qwen3-8b:12,...] [--mode compiled|graphs|eager] [--out FILE.json]

(on the H200: `bash bench/h200.sh bench_e2e`, which installs vLLM and this checkout first; results JSON
under $OUT by default, ratio table printed)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, NEW_TOKENS = 32, 128
BATCHES = (1, 16, 64)
FULL = (("qwen3-1.7b", 28), ("qwen3-8b", 12), ("qwen3-30b-a3b", 8))
QUICK = (("qwen3-1.7b", 8), ("qwen3-30b-a3b", 2))
CAPTURE = [1, 2, 4, 8, 16, 32, 64]
MODES = {"eager": dict(enforce_eager=True),
         "graphs": dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                            "cudagraph_capture_sizes": CAPTURE}),
         "compiled": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE})}


def worker(model: str, quant: str, mode: str, out: str) -> None:
    """One engine: decode tokens/s per batch size, written to `out` as JSON."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model, quantization=None if quant == "bf16" else quant, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=PROMPT_LEN + NEW_TOKENS + 16, max_num_seqs=max(BATCHES), gpu_memory_utilization=0.6,
              attention_backend="TRITON_ATTN", enable_prefix_caching=False, seed=0, **MODES[mode])
    result = {"start_seconds": round(time.time() - t0, 1), "tokens_per_s": {}}

    def run(b: int, n: int) -> float:
        prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 30000 + 10 for j in range(PROMPT_LEN)]} for i in range(b)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    for b in BATCHES:
        run(b, 8)                                                   # warm-up (JIT, allocator)
        t1, tn = min(run(b, 1) for _ in range(2)), min(run(b, NEW_TOKENS) for _ in range(2))
        result["tokens_per_s"][b] = b * (NEW_TOKENS - 1) / (tn - t1)
        Path(out).write_text(json.dumps(result))
    print(f"{quant} {Path(model).name}: {result}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes with fewer layers (~3 min)")
    ap.add_argument("--shapes", help="comma-separated SHAPE:LAYERS (shapes of testing/checkpoints.py)")
    ap.add_argument("--mode", choices=sorted(MODES), default="compiled")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "bench_vllm_e2e.json"))
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "QUANT", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    import torch

    from nvfp4_sampler.testing.checkpoints import build

    results: dict = {"mode": args.mode, "device": torch.cuda.get_device_name(), "prompt_len": PROMPT_LEN,
                     "new_tokens": NEW_TOKENS, "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    shapes = [(s, int(n)) for s, n in (x.split(":") for x in args.shapes.split(","))] if args.shapes else \
        QUICK if args.quick else FULL
    for shape, layers in shapes:
        path = build(tmp / shape, shape, seed=0, layers=layers)
        torch.cuda.empty_cache()
        entry = results["models"][shape] = {"layers": layers}
        for quant in ("bf16", "nvfp4_sampler"):
            out = tmp / f"{shape}-{quant}.json"
            proc = subprocess.run([sys.executable, __file__, "--worker", str(path), quant, args.mode, str(out)],
                                  cwd=ROOT, capture_output=True, text=True)
            entry[quant] = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-3000:]}
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nDecode tokens/s, {results['device']}, vLLM mode {args.mode}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens")
    print("| model (layers) | batch | BF16 tok/s | nvfp4_sampler tok/s | ratio |\n|---|---|---|---|---|")
    for shape, entry in results["models"].items():
        for b in BATCHES:
            bf, nv = (entry[q].get("tokens_per_s", {}).get(str(b), entry[q].get("tokens_per_s", {}).get(b))
                      for q in ("bf16", "nvfp4_sampler"))
            ratio = f"{nv / bf:.2f}x" if bf and nv else "n/a"
            print(f"| {shape} ({entry['layers']}) | {b} | {bf or 0:.0f} | {nv or 0:.0f} | {ratio} |")
        for q in ("bf16", "nvfp4_sampler"):
            if "error" in entry[q]:
                print(f"{shape} {q} failed:\n{entry[q]['error']}")


if __name__ == "__main__":
    main()
