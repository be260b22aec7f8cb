"""`nvfp4-sampler diagnose` live against CUDA vLLM on the H200, default vs strict (issue 21 item 4).

For random BF16 checkpoints of real shapes (`testing/checkpoints.py`: Qwen3-8B with 4 layers,
Qwen3-30B-A3B with 2 layers; the tiny test tokenizer, whose ids fit both vocabularies), a sidecar over
a vLLM child on the GPU (`nvfp4-sampler serve --engine vllm`, `--strict` for the strict runs, which sets
VLLM_BATCH_INVARIANT=1 in the child) and the diagnose CLI against it: 8 prompts x 64 sampled tokens
(temperature 1, all 8 in flight at once: mixed decode batches), the sampler's own recomputation of them
(/v1/logprobs: decode vs recompute, bitwise in strict mode), the learner (transformers BF16 + per-token
W4A4 of the same weights, on the same GPU: `--device cuda`; on the CPU the 8B shape's learner had not
finished in ~8 minutes, H100 seventeenth session) teacher-forced on the same sequences, the operator layer
(`--operators`), synthetic advantages. The vLLM child takes a fixed 1 GiB KV cache, so the learner has the rest of the GPU.
Writes each report under OUT/SHAPE-EXECUTION/ (report.json, operators.json, plots) and prints one row
per run: the gap (mean, max, quantiles), kl / k3, the operator layer's activation-code mismatch, and
decode vs recompute.

    python3 bench/diagnose_h200.py --out DIR        (on the H200: `bash bench/h200.sh diagnose`)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SHAPES = (("qwen3-8b", 4), ("qwen3-30b-a3b", 2))
EXECUTIONS = ("default", "strict")


def summary(out: Path) -> dict:
    """The numbers of one diagnose report folder this bench prints."""
    report = json.loads((out / "report.json").read_text())
    m = report["metrics"]
    row = {k: m.get(k) for k in ("tokens", "mean_abs_gap", "max_abs_gap", "kl", "k3")}
    again = report.get("sampler_recompute", {})
    row |= {"recompute_max_abs": again.get("max_abs"), "recompute_equal_share": again.get("equal_share")}
    ops_file = out / "operators.json"
    if ops_file.exists():
        rows = [r for per_op in json.loads(ops_file.read_text()).values() for r in per_op]
        codes = [r["act_code_mismatch"] for r in rows if r.get("act_code_mismatch") is not None]
        row["act_code_mismatch_mean"] = sum(codes) / len(codes) if codes else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shapes", default=",".join(f"{s}:{n}" for s, n in SHAPES), help="SHAPE:LAYERS,...")
    args = ap.parse_args()
    import torch

    from nvfp4_sampler.server.cli import main as cli
    from nvfp4_sampler.server.process import sidecar
    from nvfp4_sampler.testing.checkpoints import build
    from nvfp4_sampler.testing.models import tokenizer

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (vLLM's CUDA build)", file=sys.stderr)
        return 2
    out_root = Path(args.out)
    rows, failed = {}, False
    with tempfile.TemporaryDirectory(prefix="diagnose-h200-") as tmp:
        for shape, layers in (item.split(":") for item in args.shapes.split(",")):
            layers = int(layers)
            ckpt = build(Path(tmp) / shape, shape, seed=0, layers=layers)
            tokenizer(ckpt)
            torch.cuda.empty_cache()
            for execution in EXECUTIONS:
                key = f"{shape}-{execution}"
                extra = ["--vllm-arg=--max-model-len=1024", "--vllm-arg=--gpu-memory-utilization=0.3",
                         f"--vllm-arg=--kv-cache-memory-bytes={1 << 30}"] + (["--strict"] if execution == "strict" else [])
                try:
                    with sidecar(ckpt, engine="vllm", log=out_root / f"{key}.sidecar.log", extra=extra,
                                 env={"NVFP4_SAMPLER_DEVICE": "cuda"}) as srv:
                        rc = cli(["diagnose", "--url", srv.url, "--model", str(ckpt), "--out", str(out_root / key),
                                  "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
                                  "--synthetic-advantages", "--operators", "--device", "cuda"])
                    rows[key] = summary(out_root / key) if rc == 0 else {"error": f"diagnose exit {rc}"}
                except Exception as e:  # noqa: BLE001 - one failed run is reported; the others still run
                    rows[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                failed |= "error" in rows[key]
                (out_root / "diagnose_h200.json").write_text(json.dumps(rows, indent=1))
                print(key, rows[key], flush=True)
    print("\n| model (layers) | execution | tokens | mean abs gap | max abs gap | kl | k3 | act code mismatch "
          "| decode vs recompute: max abs | bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        shape, execution = key.rsplit("-", 1)
        if "error" in r:
            print(f"| {shape} | {execution} | failed: {r['error']} | | | | | | | |")
            continue
        cm, rm, re = r.get("act_code_mismatch_mean"), r.get("recompute_max_abs"), r.get("recompute_equal_share")
        print(f"| {shape} | {execution} | {r['tokens']} | {r['mean_abs_gap']:.4f} | {r['max_abs_gap']:.4f} | "
              f"{r['kl']:.2e} | {r['k3']:.2e} | {'-' if cm is None else f'{cm:.4f}'} | "
              f"{'-' if rm is None else f'{rm:.3g}'} | {'-' if re is None else f'{re:.3f}'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
