"""Throughput of the converter on Qwen3-30B-A3B-shaped weights (synthetic BF16), on the CPU (default)
or, with --device cuda, end to end on a GPU (the conversion kernel alone is benchmarked by the
kernels owner in docs/BENCHMARKS.md).

One decoder layer's attention (q [4096, 2048], k/v [512, 2048], o [2048, 4096]) plus the first
`--experts` of its 128 experts (gate/up [768, 2048], down [2048, 768]) are converted as an
in-memory learner state dict through `iter_buckets` (no disk), for each source kind:
  bf16-1d / bf16-2d   BF16 masters quantized on --device (kernels.dispatch: kernels.cpu_quant on CPU)
  te-2d               TransformerEngine NVFP4 storage (compact padded scales): a lossless byte copy
  keep-bf16           all linears kept BF16 (the streaming floor: NaN check + bucketing)
each with and without the per-tensor error report. Also one end-to-end file conversion (HF folder
-> sampler folder) of the same tensors. GB/s counts source bytes (BF16 bytes for BF16 sources);
seconds are the best of --repeat runs.

Usage: python bench/bench_convert_cpu.py [--experts 8] [--threads 2] [--device cpu|cuda] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from nvfp4_sampler.converters.convert import ConvertOptions, convert, iter_buckets
from nvfp4_sampler.converters.report import ConvertSummary
from nvfp4_sampler.converters.sources import StateDictSource, TENVFP4Weight
from nvfp4_sampler.kernels import dispatch, reference
from nvfp4_sampler.sampler_format import Recipe

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
          "moe_intermediate_size": 768, "num_experts": 128, "num_hidden_layers": 48, "vocab_size": 151936}


def layer_weights(experts: int, device: str) -> dict[str, torch.Tensor]:
    """BF16 weights of layer 0: attention and the first `experts` experts."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {f"{p}self_attn.q_proj.weight": (4096, 2048), f"{p}self_attn.k_proj.weight": (512, 2048),
              f"{p}self_attn.v_proj.weight": (512, 2048), f"{p}self_attn.o_proj.weight": (2048, 4096)}
    for e in range(experts):
        shapes |= {f"{p}mlp.experts.{e}.gate_proj.weight": (768, 2048), f"{p}mlp.experts.{e}.up_proj.weight": (768, 2048),
                   f"{p}mlp.experts.{e}.down_proj.weight": (2048, 768)}
    return {n: (torch.randn(s, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16) for n, s in shapes.items()}


def te_weights(weights: dict[str, torch.Tensor]) -> dict[str, TENVFP4Weight]:
    """The same weights as a 2D-recipe TE learner stores them (compact padded scale_inv)."""
    out = {}
    for name, w in weights.items():
        q = dispatch.quantize_weight_on(w, recipe="2d")
        m, ksf = q.block_scales.shape
        scale_inv = torch.zeros(-(-m // 128) * 128, -(-ksf // 4) * 4, dtype=torch.uint8, device=w.device)
        scale_inv[:m, :ksf] = q.block_scales.view(torch.uint8)
        out[name] = TENVFP4Weight(q.codes, scale_inv, w.abs().float().amax().reshape(1))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(source_tensors: dict, device: str, **options) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) to stream all buckets of the source (buckets stay on `device`)."""
    summary = ConvertSummary()
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in iter_buckets(StateDictSource(source_tensors, config=CONFIG), ConvertOptions(device=device, **options),
                          summary=summary):
        pass
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def run_reference(weights: dict) -> tuple[float, float]:
    """The executable spec (kernels.reference.quantize_weight) on the same tensors, for comparison."""
    start, cpu = time.perf_counter(), time.process_time()
    for w in weights.values():
        reference.quantize_weight(w.cpu())
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (the CPU machine is shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = layer_weights(args.experts, args.device)
    bf16_bytes = sum(w.numel() * 2 for w in weights.values())
    te = te_weights(weights)
    keep_all = ("model.layers.",)
    rows = []
    for label, tensors, opts in (("bf16-1d", weights, {"recipe": Recipe(weight="1d")}), ("bf16-2d", weights, {"recipe": Recipe(weight="2d")}),
                                 ("te-2d", te, {"recipe": Recipe(weight="2d")}), ("keep-bf16", weights, {"keep_bf16": keep_all})):
        for report in (True, False):
            if args.device != "cpu":
                run(tensors, args.device, report=report, **opts)      # warm-up (kernel compilation)
            secs, cpu = min(run(tensors, args.device, report=report, **opts) for _ in range(args.repeat))
            rows.append({"source": label, "report": report, "seconds": round(secs, 3), "cpu": round(cpu, 3),
                         "GB/s (BF16-equivalent)": round(bf16_bytes / secs / 1e9, 4)})
    secs, cpu = run_reference(weights)
    rows.append({"source": "bf16-1d with kernels.reference (the spec, before cpu_quant)", "report": False,
                 "seconds": round(secs, 3), "cpu": round(cpu, 3), "GB/s (BF16-equivalent)": round(bf16_bytes / secs / 1e9, 4)})
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        save_file({n: w.cpu() for n, w in weights.items()}, src / "model.safetensors")
        (src / "config.json").write_text(json.dumps(CONFIG))
        s = convert(src, Path(tmp) / "dst", ConvertOptions(recipe=Recipe(weight="2d"), report=False, bucket_bytes=64 << 20,
                                                          device=args.device))
        rows.append({"source": "file bf16-2d (HF folder -> sampler folder)", "report": False,
                     "seconds": round(s.seconds, 3), "cpu": None, "GB/s (BF16-equivalent)": round(s.gb_per_s, 4)})
    print(f"{len(weights)} tensors, {bf16_bytes / 1e6:.1f} MB BF16, device {args.device}, "
          f"torch threads {args.threads}, load average {os.getloadavg()[0]:.1f}\n")
    print("| source | report | seconds | GB/s | process CPU s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {'yes' if r['report'] else 'no'} | {r['seconds']} | {r['GB/s (BF16-equivalent)']} "
              f"| {r['cpu'] if r['cpu'] is not None else '-'} |")


if __name__ == "__main__":
    main()
