"""`nvfp4-sampler convert SRC DST ...`: a Hugging Face folder -> a sampler checkpoint folder."""
from __future__ import annotations

import argparse
import sys

from nvfp4_sampler.sampler_format.args import add_recipe_args, recipe_from_args

from .convert import DEFAULT_BUCKET_BYTES, ConvertOptions, convert
from .sources import SafetensorsFolder


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `convert` subcommand (its handler is `main`) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert", help="convert a BF16/FP32 Hugging Face checkpoint to the NVFP4 sampler layout",
        description="Convert a Hugging Face safetensors folder (Llama, Qwen2, Qwen3, Qwen3-MoE) into a "
                    "pre-quantized nvfp4_sampler checkpoint: NVFP4 linear weights with per-tensor decode "
                    "scales, everything else as in the source, plus config.json and tokenizer files. "
                    "DST must not exist; nothing appears there unless the conversion succeeds.")
    p.add_argument("src", metavar="SRC", help="source folder (config.json + model.safetensors or shards with index)")
    p.add_argument("dst", metavar="DST", help="destination folder (must not exist)")
    add_recipe_args(p)
    p.add_argument("--shared-group-scale", action="store_true",
                   help="q/k/v and gate/up (per expert) share one second-level scale, as learners that "
                        "quantize fused QKV / gate-up tensors (Megatron) hold them")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="write N pre-sharded tensor-parallel rank folders DST/rank-00 ... (default 1: unsharded)")
    p.add_argument("--keep-bf16", default="", metavar="PREFIXES",
                   help="comma-separated module-name prefixes kept in BF16 (lm_head, embeddings and MoE "
                        "routers always are), e.g. model.layers.0.,model.layers.1.mlp")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda",
                   help="where weights are quantized (cuda uses the GPU conversion kernel); default cpu")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, metavar="N",
                   help=f"output bytes per shard, bounds host memory (default {DEFAULT_BUCKET_BYTES})")
    p.add_argument("--no-report", action="store_true", help="skip the per-tensor error report (faster)")
    p.add_argument("--top", type=int, default=10, help="rows of the error table in the summary (default 10)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run the conversion with a progress bar and print the summary. Returns the exit code
    (0, or 2 for bad input after printing the error; DST is then untouched)."""
    from tqdm import tqdm

    try:
        options = ConvertOptions(recipe=recipe_from_args(args), shared_group_scale=args.shared_group_scale,
                                 tp=args.tp, device=args.device, bucket_bytes=args.bucket_bytes,
                                 keep_bf16=tuple(p for p in args.keep_bf16.split(",") if p),
                                 report=not args.no_report)
        source = SafetensorsFolder(args.src)
        with tqdm(total=source.nbytes, unit="B", unit_scale=True, desc="convert") as bar:
            summary = convert(source, args.dst, options, progress=bar.update)
    except (ValueError, FileNotFoundError, FileExistsError) as e:      # bad input: one clear line, no traceback
        print(f"nvfp4-sampler convert: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {summary.tensors_in} tensors -> {summary.tensors_out} in {args.dst}")
    print(f"bytes in {summary.bytes_in / 1e9:.3f} GB, out {summary.bytes_out / 1e9:.3f} GB; "
          f"{summary.seconds:.2f} s, {summary.gb_per_s:.3f} GB/s; "
          f"peak tracked {summary.peak_tracked_bytes / 1e6:.1f} MB")
    if summary.reports:
        print(summary.table(top=args.top))
    return 0
