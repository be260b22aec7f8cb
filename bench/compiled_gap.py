"""Which part of vLLM's compiled mode moves nvfp4_sampler's log-probs away from eager's (issue 21 item 3).

For random BF16 checkpoints built on the device (`testing/checkpoints.py`: "dense-small", 4 layers;
"moe-small", 2 layers), one engine per process (`tests/gpu_scripts/vllm_engine.py`, in-process engine
core, TRITON_ATTN, 1 GiB KV cache each, several at once), BF16 and nvfp4_sampler, in the modes:
  eager                          the anchor
  compiled                       vLLM's default (inductor + piecewise/full CUDA graphs)
  compiled_custom_ops            vLLM's CUDA kernels for RMSNorm, SiLU-and-mul, rotary (custom_ops=["all"])
  compiled_emulate_casts         inductor rounds every fused intermediate to its storage dtype, as eager does
  compiled_custom_ops_no_fusion  both, and vLLM's fusion passes off
  compiled_dynamo                dynamo's graphs run by the eager backend: no inductor code, CUDA graphs kept
Prints, per kind and mode, the prompt log-probs' mean and max |dlogp| against the same quantization's
eager engine over the same 70 prompt tokens, and whether they are bitwise equal; the BF16 rows say what
compilation alone changes, the nvfp4_sampler rows what per-token NVFP4 makes of it.

    python3 bench/compiled_gap.py [--kinds dense,moe] [--parallel 6] [--out FILE.json]
(on the H200: `bash bench/h200.sh compiled_gap`)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = {"dense": ("dense-small", 4), "moe": ("moe-small", 2)}
MODES = ("eager", "compiled", "compiled_custom_ops", "compiled_emulate_casts", "compiled_custom_ops_no_fusion",
         "compiled_dynamo")
QUANTS = ("bf16", "nvfp4_sampler")


def gaps(results: dict) -> list[dict]:
    """Rows (kind, quant, mode, mean, max, bitwise, greedy_equal) against the same (kind, quant)'s eager run;
    a run without its prompt log-probs gives a row with its error."""
    rows = []
    for (kind, quant, mode), r in results.items():
        eager = results.get((kind, quant, "eager"), {})
        if mode == "eager":
            continue
        if "start" not in r or "start" not in eager:
            rows.append(dict(kind=kind, quant=quant, mode=mode, error=sorted({**eager.get("errors", {}),
                                                                            **r.get("errors", {})})))
            continue
        a = [v for row in r["start"]["prompt_lp"] for v in row]
        b = [v for row in eager["start"]["prompt_lp"] for v in row]
        d = [abs(x - y) for x, y in zip(a, b)]
        rows.append(dict(kind=kind, quant=quant, mode=mode, mean=sum(d) / len(d), max=max(d), tokens=len(d),
                         bitwise=a == b, greedy_equal=r["start"]["tokens"] == eager["start"]["tokens"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="dense,moe")
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from nvfp4_sampler.testing.checkpoints import build
    from tests.gpu_scripts import run_script

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (vLLM's CUDA build)", file=sys.stderr)
        return 2
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="compiled-gap-") as tmp:
        d = Path(tmp)
        ckpts = {kind: build(d / kind, KINDS[kind][0], seed=0, layers=KINDS[kind][1]) for kind in kinds}
        jobs = [(kind, quant, mode) for kind in kinds for quant in QUANTS for mode in MODES]

        def run(key):
            kind, quant, mode = key
            name = "_".join(key)
            return run_script("tests.gpu_scripts.vllm_engine",
                              ["--model", str(ckpts[kind]), "--mode", mode, "--quant", quant],
                              d / f"{name}.json", d / f"{name}.log", timeout=400)

        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            results = dict(zip(jobs, pool.map(run, jobs)))
    rows = gaps(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "runs": {"|".join(k): v for k, v in results.items()}}))
    print("\nprompt log-probs vs the same quantization's eager engine (70 prompt tokens, same weights)")
    print("| kind | quantization | mode | mean abs dlogp | max abs dlogp | bitwise | greedy equal |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | {r['quant']} | {r['mode']} | failed: {', '.join(r['error'])} | | | |")
        else:
            print(f"| {r['kind']} | {r['quant']} | {r['mode']} | {r['mean']:.3e} | {r['max']:.3e} | {r['bitwise']} | "
                  f"{r['greedy_equal']} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
