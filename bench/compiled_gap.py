"""Which part of vLLM's compiled mode moves nvfp4_sampler's log-probs away from eager's (issue 21 item 3).

For random BF16 checkpoints built on the device (`testing/checkpoints.py`: "dense-small", 4 layers;
"moe-small", 2 layers), one engine per process (in-process engine core, TRITON_ATTN, 1 GiB KV cache
each, several at once), BF16 and nvfp4_sampler, in the modes:
  eager                          the anchor
  compiled                       vLLM's default (inductor + piecewise/full CUDA graphs)
  compiled_custom_ops            vLLM's CUDA kernels for RMSNorm, SiLU-and-mul, rotary (custom_ops=["all"])
  compiled_emulate_casts         inductor rounds every fused intermediate to its storage dtype, as eager does
  compiled_custom_ops_no_fusion  both, and vLLM's fusion passes off
  compiled_dynamo                dynamo's graphs run by the eager backend: no inductor code, CUDA graphs kept
Each engine computes the prompt log-probs and greedy tokens of three prompts (24, 40, 9 tokens: 70 scored
tokens). Prints, per kind and mode, the mean and max |dlogp| against the same quantization's eager
engine, and whether they are bitwise equal; the BF16 rows say what
compilation alone changes, the nvfp4_sampler rows what per-token NVFP4 makes of it.

    python3 bench/compiled_gap.py [--kinds dense,moe] [--parallel 6] [--out FILE.json]
(on the H200: `bash bench/h200.sh compiled_gap`)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"dense": ("dense-small", 4), "moe": ("moe-small", 2)}
CAPTURE = [1, 2, 4, 8]
_EMULATE = {"inductor_compile_config": {"emulate_precision_casts": True}}
MODES = {
    "eager": dict(enforce_eager=True),
    "compiled": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE}),
    "compiled_custom_ops": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE, "custom_ops": ["all"]}),
    "compiled_emulate_casts": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE, **_EMULATE}),
    "compiled_custom_ops_no_fusion": dict(compilation_config={
        "cudagraph_capture_sizes": CAPTURE, "custom_ops": ["all"], **_EMULATE,
        "pass_config": {"eliminate_noops": False, "fuse_norm_quant": False, "fuse_act_quant": False,
                        "enable_qk_norm_rope_fusion": False, "fuse_act_padding": False}}),
    "compiled_dynamo": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE, "backend": "eager"}),
}
QUANTS = ("bf16", "nvfp4_sampler")
PROMPTS = [[(7 * i + 3 * j) % 997 + 10 for j in range(n)] for i, n in enumerate((24, 40, 9))]


def worker(model: str, quant: str, mode: str, out: str) -> None:
    """One engine: {"start": {"prompt_lp": [per prompt], "tokens": [greedy, 16 each]}} or {"errors": ...}."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model, quantization=None if quant == "bf16" else quant, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=512, gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30,
              attention_backend="TRITON_ATTN", seed=0, enable_prefix_caching=False, **MODES[mode])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    Path(out).write_text(json.dumps({"start": {
        "prompt_lp": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, PROMPTS)],
        "tokens": [list(o.outputs[0].token_ids) for o in outs]}}))


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
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "QUANT", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import torch

    from nvfp4_sampler.testing.checkpoints import build

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
            out, log = d / f"{'_'.join(key)}.json", d / f"{'_'.join(key)}.log"
            with open(log, "w") as f:
                proc = subprocess.run([sys.executable, __file__, "--worker", str(ckpts[kind]), quant, mode, str(out)],
                                      cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=400)
            result = json.loads(out.read_text()) if out.exists() else {}
            if proc.returncode:
                result["errors"] = {"process": log.read_text()[-2000:]}
            return result

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
