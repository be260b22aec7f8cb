"""End-to-end decode throughput in real CUDA vLLM: nvfp4_sampler vs BF16, same compilation mode (H200).

For each model shape (random BF16 checkpoints built on the GPU, `testing/checkpoints.py`) two
engines, one per process: BF16 and `quantization="nvfp4_sampler"` (online quantization of the same
checkpoint). Each engine runs as users run vLLM: engine core in its own process, async scheduling as
vLLM defaults it (both recorded in the JSON). Each measures, per batch size B, decode tokens/s =
B * (N - 1) / (t(N) - t(1)) where t(n) is the wall time of `generate` for B prompts of PROMPT_LEN tokens
and n new tokens (greedy, ignore_eos): subtracting the one-token run removes prefill and scheduling
start-up (t(1): the fastest of REPEATS runs); the median of REPEATS long runs is reported with its range, and
every run's seconds in run order are kept in the JSON ("seconds"). Then a per-step breakdown at the
PROFILED batches through vLLM's own torch profiler (`profiler_config`, `llm.start_profile` / `stop_profile`; it runs in
the engine core's process and writes a chrome trace there): GPU time by kernel category (ours,
attention, BF16 GEMMs, norms and other compiled elementwise kernels, sampling), the wall time of the
profiled runs (their difference is GPU idle time; the profiler's host overhead is in it) and the
unprofiled wall per step (B / tokens/s), and from the trace's timeline the kernels per step and the
GPU's idle time split into launch gaps (< GAP_SPLIT_US between busy spans) and waits for the host; on
the host's side the CUDA graph replays, the kernels launched one by one, the torch operators, the time
in each CUDA runtime / driver call and which GPU work each wait for the host preceded. These come from the
difference of a long and a short profiled run; beside them the long run's own decode steps (forward to
forward on the GPU timeline, `decode_steps`) give medians that a stall in either run cannot turn negative
(the difference read negative host rows in the thirteenth and fourteenth sessions). Layer counts
(shown in the table) may be cut so a run fits one device command, but cut models mislead twice: lm_head and
embeddings are BF16 in both engines, so fewer layers weigh the common lm_head more; and vLLM's host work
per step (~2-3 ms on the H200 machine) then outlasts the GPU step, so the ratio measures the host (the
8B shape at 12 layers read 0.89-1.16x at batch 16 in three runs of one commit; at 36 layers 1.24x, GPU-bound).
FULL runs the dense shapes at full depth and the MoE shape at 16 of 48 layers (its checkpoint on disk).
--strict adds a third engine, nvfp4_sampler in strict mode (`quantization_config.strict` and
VLLM_BATCH_INVARIANT=1: batch-invariant NVFP4 kernels plus vLLM's batch-invariant attention, norms,
BF16 GEMMs and log_softmax), same mode and batches: the cost of strict mode, side by side with the
default and BF16. --dynamo adds nvfp4_sampler with dynamo's graphs run by the eager backend
(`compilation_config.backend = "eager"`: no inductor code, CUDA graphs kept; the compiled-mode
configuration whose log-probs equal eager's bitwise, docs/VLLM.md): its cost against the default mode.
--wgmma adds nvfp4_sampler with `cuda_mma`'s warpgroup-MMA variant in every decode launch
(NVFP4_SAMPLER_MMA=wgmma in that engine's processes), --exact with the exact Triton GEMM on the tiled codes at 33-64
tokens (NVFP4_SAMPLER_EXACT_MIN_M=33), --one-tile with one tile a CTA at every size
(NVFP4_SAMPLER_PERSIST=0: the default before persistent CTAs from 17 tokens), --pdl with the decode kernel
launched as a programmatic dependent of the quantizer up to 16 tokens (NVFP4_SAMPLER_PDL_MAX_M=16; the
default: at one token only; at every size it lost at batch 64 in four runs of four: its batch 1 and 64 are
the default's launches, a control of the spread),
--global-split-k with split-K through global planes instead of clusters (NVFP4_SAMPLER_SPLIT_K=global): the
kernel choice measured end to end.

    python3 bench/bench_vllm_e2e.py [--quick | --shapes qwen3-8b:12,...] [--mode compiled|graphs|eager] [--strict]
                                    [--dynamo] [--wgmma] [--exact] [--one-tile] [--pdl]
                                    [--global-split-k] [--out FILE.json]

(on the H200: `bash bench/h200.sh bench_e2e`, which installs vLLM and this checkout first; results JSON
under $OUT by default, ratio table printed)
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, NEW_TOKENS = 32, 128
BATCHES = (1, 16, 64)
PROFILED = (16, 64)     # the batches whose decode steps are profiled (--profiled)
FULL = (("qwen3-1.7b", 28), ("qwen3-8b", 36), ("qwen3-30b-a3b", 16))
QUICK = (("qwen3-1.7b", 8), ("qwen3-30b-a3b", 2))
CAPTURE = [1, 2, 4, 8, 16, 32, 64]
MODES = {"eager": dict(enforce_eager=True),
         "graphs": dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                            "cudagraph_capture_sizes": CAPTURE}),
         "compiled": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE})}


# Kernel-name patterns of a decode step's GPU time, first match wins (torch profiler, CUDA kernels). From 33
# (token, expert) pairs the MoE experts run the same NVFP4 GEMM kernels as the linears; up to 32 (batch 1-4 of a
# top-8 model) the per-pair Triton GEMVs, which the engines' dense linears do not run (`hopper_mma` serves every
# K % 128 == 0 linear; others fall back to `triton_hopper`, whose M = 1 linears run it too); their routing sorts
# run torch's sort kernels.
CATEGORIES = (("nvfp4 GEMVs (Triton: the MoE's per-pair decode)", ("_w4a4_gemv",)),
              ("nvfp4 GEMMs (linears, MoE experts)", ("w4a16_mma", "_w4a4_kernel", "_scale_epilogue",
                                                      "_dequant_exact", "w4_dequant", "_exact_gemm")),
              ("nvfp4 activation quantization", ("_act_quant",)),
              ("MoE routing glue (ours: schedule, combine; vLLM: gating, align, sum)",
               ("_schedule_kernel", "_combine_kernel", "moe::", "moe_align", "moe_sum")),
              ("attention", ("attention", "attn", "flash", "fmha", "paged", "reshape_and_cache")),
              ("bf16 gemm (cuBLAS / lm_head / router)", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas", "splitk",
                                                         "matmul_kernel",        # vLLM's batch-invariant matmul
                                                         "fused_moe_kernel")),   # vLLM's BF16 experts (Triton)
              ("sort, top-k, softmax (sampling, MoE routing)", ("sampl", "topk", "softmax", "argmax", "sort", "cumsum",
                                                               "gumbel")),
              ("norms, rotary, activations, elementwise (compiled)", ("triton", "rms", "norm", "rotary", "silu",
                                                                      "elementwise", "vectorized", "act_and_mul")))
REPEATS = 5
STRICT = "nvfp4_strict"          # nvfp4_sampler in strict mode (--strict)
DYNAMO = "nvfp4_dynamo"          # nvfp4_sampler, dynamo on the eager backend (--dynamo)
# nvfp4_sampler on a kernel variant, one more engine each: engine name -> (its flag, the environment its
# processes get (read by kernels.cuda_mma and triton_gemm at import, in the engine core too), the flag's help)
KERNEL_VARIANTS = {
    "nvfp4_wgmma": ("--wgmma", {"NVFP4_SAMPLER_MMA": "wgmma"}, "the wgmma decode kernel in every launch"),
    "nvfp4_exact": ("--exact", {"NVFP4_SAMPLER_EXACT_MIN_M": "33"}, "the Triton exact GEMM at 33-64 tokens"),
    "nvfp4_one_tile": ("--one-tile", {"NVFP4_SAMPLER_PERSIST": "0"}, "one tile a CTA at every size"),
    "nvfp4_pdl": ("--pdl", {"NVFP4_SAMPLER_PDL_MAX_M": "16"},
                  "the decode kernel a programmatic dependent of the quantizer up to 16 tokens"),
    "nvfp4_moe_mma": ("--moe-mma", {"NVFP4_SAMPLER_PAIRED_MAX_PAIRS": "0"},
                      "the MoE's tensor-core grouped launches from 1 token (no per-pair GEMVs)"),
    "nvfp4_global": ("--global-split-k", {"NVFP4_SAMPLER_SPLIT_K": "global"},
                     "split-K through global FP32 planes instead of thread-block clusters (no cluster launches)"),
}


def _category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k.lower() in low for k in keys)), "other")


def _by_category(us: dict[str, float]) -> dict[str, float]:
    """GPU microseconds per kernel name summed per CATEGORIES entry."""
    cats: dict[str, float] = {}
    for name, v in us.items():
        cats[_category(name)] = cats.get(_category(name), 0.0) + v
    return cats


def profiler_config(trace_dir: str | Path) -> dict:
    """vLLM's torch profiler writing plain chrome traces into trace_dir (absolute), no stacks, no printed
    tables, no frontend trace. It only records between `llm.start_profile()` and `llm.stop_profile()`;
    fields of vLLM 0.26 and later (`vllm.config.ProfilerConfig`)."""
    return {"profiler": "torch", "torch_profiler_dir": str(Path(trace_dir).resolve()),
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}


def worker(model: str, quant: str, mode: str, out: str, profiled: str) -> None:
    """One engine (quant: "bf16", "nvfp4_sampler", STRICT: nvfp4_sampler in strict mode, DYNAMO:
    nvfp4_sampler with `compilation_config.backend = "eager"`, or a KERNEL_VARIANTS engine): decode
    tokens/s per batch size (median and spread of REPEATS) and per-step profiles at the batches in
    `profiled` (comma-separated), written to `out` as JSON as they come."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
    strict, engine_mode = {}, MODES[mode]
    if quant == DYNAMO:
        quant = "nvfp4_sampler"
        engine_mode = {**engine_mode, "compilation_config": {**engine_mode.get("compilation_config", {}),
                                                             "backend": "eager"}}
    if quant in KERNEL_VARIANTS:
        os.environ.update(KERNEL_VARIANTS[quant][1])
        quant = "nvfp4_sampler"
    if quant == STRICT:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"           # read by vLLM at import (and by the engine core)
        from nvfp4_sampler.sampler_format import SamplerConfig
        quant, strict = "nvfp4_sampler", {"hf_overrides": {"quantization_config": SamplerConfig(strict=True).to_dict()}}
    import vllm
    from vllm import LLM, SamplingParams

    trace_dir = Path(out).resolve().with_suffix(".traces")
    t0 = time.time()
    llm = LLM(model, quantization=None if quant == "bf16" else quant, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=PROMPT_LEN + NEW_TOKENS + 16, max_num_seqs=max(BATCHES), gpu_memory_utilization=0.6,
              attention_backend="TRITON_ATTN", enable_prefix_caching=False, seed=0,
              profiler_config=profiler_config(trace_dir), jit_monitor_verbose=True, **strict, **engine_mode)
    result = {"start_seconds": round(time.time() - t0, 1), "vllm": vllm.__version__,
              "engine_core": "separate process", "async_scheduling": async_scheduling(llm),
              "tokens_per_s": {}, "spread": {}, "seconds": {}, "profiles": {}}

    def run(b: int, n: int) -> float:
        prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 30000 + 10 for j in range(PROMPT_LEN)]} for i in range(b)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    for b in BATCHES:
        print(f"{PHASE} batch {b} warm-up", flush=True)
        run(b, 8)                                                   # warm-up (JIT, allocator)
        print(f"{PHASE} batch {b} timed", flush=True)
        # the prefill + first token, subtracted from each long run: its fastest, so that slow short runs cannot
        # turn a rate negative or huge (the median still did when 3 of 5 stalled: the nvfp4 engine at batch 64,
        # twenty-second session, 0.755 / 0.725 / 0.068 / 2.333 / 0.091 s against long runs of 0.62 s); a
        # stall inside a long run shows as its spread
        firsts = [run(b, 1) for _ in range(REPEATS)]
        first = min(firsts)
        longs = [run(b, NEW_TOKENS) for _ in range(REPEATS)]
        result["seconds"][b] = {"first": firsts, "long": longs}        # in run order: drifts and outliers
        rates = sorted(b * (NEW_TOKENS - 1) / (t - first) for t in longs)
        result["tokens_per_s"][b] = rates[REPEATS // 2]
        result["spread"][b] = [rates[0], rates[-1]]
        Path(out).write_text(json.dumps(result))
    print(f"{PHASE} profiles", flush=True)
    for b in map(int, profiled.split(",")):
        result["profiles"][b] = profile_decode(llm, run, b, trace_dir)
        result["profiles"][b]["wall_us_per_step_unprofiled"] = b / result["tokens_per_s"][b] * 1e6
        Path(out).write_text(json.dumps(result))
    print(f"{quant} {Path(model).name}: {result}", flush=True)


def async_scheduling(llm) -> bool | None:
    """Whether the engine resolved async scheduling on (None where this vLLM does not say)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return getattr(getattr(config, "scheduler_config", None), "async_scheduling", None)


GAP_SPLIT_US = 10.0     # GPU idle gaps shorter than this: launch gaps (between the kernels of a CUDA graph or of
                        # back-to-back launches); longer: the GPU waiting for the host


def load_trace(path: Path) -> list[dict]:
    """The events of a chrome trace (.json or .json.gz) written by the torch profiler."""
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def _device_events(trace: list[dict]) -> list[dict]:
    return [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


# The first kernel of a forward: the token embedding (inductor fuses it with the first norm in compiled mode,
# e.g. triton_red_fused__to_copy_embedding_rms_norm_0; eager runs torch's index_select), not the rotary
# embedding of every layer (vllm::rotary_embedding_kernel)
STEP_MARKERS, NOT_MARKERS = ("embedding", "indexselect"), ("rotary",)


def _starts_forward(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in STEP_MARKERS) and not any(k in low for k in NOT_MARKERS)


def decode_steps(trace: list[dict]) -> dict:
    """Per decode step from one profiled generate's trace alone (no difference of two runs): the steps are the
    intervals between the starts of consecutive forwards (STEP_MARKERS), the first (the prefill's) dropped;
    medians over them of the step's period on the GPU timeline (marker to marker: what sets tokens/s while
    the profiler runs), its busy time (kernel spans merged), its kernel count and GPU microseconds by
    category. {} with fewer than 3 forwards."""
    events = sorted(_device_events(trace), key=lambda e: float(e["ts"]))
    ts = [float(e["ts"]) for e in events]
    starts = [t for t, e in zip(ts, events) if _starts_forward(e["name"])]
    steps: list[dict] = []
    for lo, hi in zip(starts[1:], starts[2:]):
        inside = events[bisect.bisect_left(ts, lo):bisect.bisect_left(ts, hi)]
        busy, end, us = 0.0, lo, {}
        for e in inside:
            start, stop = float(e["ts"]), min(hi, float(e["ts"]) + float(e["dur"]))
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
            us[e["name"]] = us.get(e["name"], 0.0) + float(e["dur"])
        steps.append({"period_us": hi - lo, "busy_us": busy, "kernels": float(len(inside)), "gpu_us": _by_category(us)})
    if not steps:
        return {}
    med = statistics.median
    return {"steps": len(steps), **{k: med(st[k] for st in steps) for k in ("period_us", "busy_us", "kernels")},
            "period_us_range": [min(st["period_us"] for st in steps), max(st["period_us"] for st in steps)],
            "gpu_us": {c: med(st["gpu_us"].get(c, 0.0) for st in steps) for c in set().union(*(st["gpu_us"] for st in steps))}}


def trace_device(trace: list[dict]) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
    """One profiler trace's events (`load_trace`): (GPU microseconds per kernel
    name, memcpy and memset included; the timeline: "kernels" (count), "busy_us" (the union of their
    spans: kernels overlapping under programmatic dependent launch count once), "idle_short_us" / "short_gaps"
    (total and count of the gaps < GAP_SPLIT_US between busy spans, all streams merged), "idle_long_us"
    (the longer gaps), and the host's side: "graph_launches" (CUDA graph replays), "kernel_launches"
    (kernels launched one by one: runtime and driver API), "cpu_ops" (torch operators run on the host);
    where the time went: {"host_calls": microseconds per CUDA runtime / driver call name (a blocking
    synchronize or copy shows here), "gaps_before": microseconds of the long gaps per name of the GPU
    work that ended them})."""
    events = _device_events(trace)
    us: dict[str, float] = {}
    for e in events:
        us[e["name"]] = us.get(e["name"], 0.0) + float(e["dur"])
    line = {"kernels": float(len(events)), "busy_us": 0.0, "idle_short_us": 0.0, "short_gaps": 0.0, "idle_long_us": 0.0,
            "graph_launches": 0.0, "kernel_launches": 0.0, "cpu_ops": 0.0}
    where: dict[str, dict[str, float]] = {"host_calls": {}, "gaps_before": {}}
    for e in trace:                                         # the host: what launched the kernels, what blocked
        cat, name = e.get("cat"), e.get("name", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            line["graph_launches"] += name.startswith(("cudaGraphLaunch", "cuGraphLaunch"))
            line["kernel_launches"] += name.startswith(("cudaLaunchKernel", "cuLaunchKernel"))
            where["host_calls"][name] = where["host_calls"].get(name, 0.0) + float(e.get("dur", 0.0))
        line["cpu_ops"] += cat == "cpu_op"
    end = None
    for start, stop, name in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events):
        if end is not None and start > end:
            short = start - end < GAP_SPLIT_US
            line["idle_short_us" if short else "idle_long_us"] += start - end
            line["short_gaps"] += short
            if not short:
                where["gaps_before"][name] = where["gaps_before"].get(name, 0.0) + start - end
        line["busy_us"] += stop - start if end is None else max(0.0, stop - max(start, end))
        end = stop if end is None else max(end, stop)
    return us, line, where


def profile_decode(llm, run, b: int, trace_dir: str | Path, *, steps: int = 32) -> dict:
    """Per decode step at batch b: GPU microseconds by kernel category and the wall time (their
    difference is host time the GPU waited for), from runs of steps + 1 and 1 new tokens (the faster of
    two), each between
    `llm.start_profile()` and `llm.stop_profile()` (llm built with `profiler_config(trace_dir)`; the
    traces the profiler writes into trace_dir on stop are read back). `run(b, n)` -> wall seconds."""
    trace_dir = Path(trace_dir)

    def profiled(n: int) -> tuple[dict, dict, float, list, dict, dict]:
        before = set(trace_dir.glob("*")) if trace_dir.exists() else set()
        llm.start_profile()
        try:
            wall = run(b, n)
        finally:
            llm.stop_profile()                              # returns once the trace is written
        traces = sorted(p for p in set(trace_dir.glob("*")) - before if p.name.endswith((".json", ".json.gz")))
        if not traces:
            raise RuntimeError(f"vLLM's profiler wrote no trace into {trace_dir}")
        kernels: dict = {}
        line: dict = {}
        where: dict = {"host_calls": {}, "gaps_before": {}}
        steps: dict = {}
        for path in traces:                                 # one per worker (rank)
            trace = load_trace(path)
            steps = steps or decode_steps(trace)            # the first rank's
            names, timeline, places = trace_device(trace)
            for total, part in [(kernels, names), (line, timeline)] + [(where[k], places[k]) for k in where]:
                for name, v in part.items():
                    total[name] = total.get(name, 0.0) + v
        top = sorted(((us, name) for name, us in kernels.items()), reverse=True)
        return _by_category(kernels), line, wall, [(round(us, 1), name[:80]) for us, name in top[:12]], where, steps

    # the one-token run before and after the long one, the faster kept: a one-off host stall in it (in the
    # 36-layer run the short run at batch 16 stalled ~60 ms) would otherwise turn the differences negative
    short_first = profiled(1)
    long, line_long, wall_long, top, where_long, steps_long = profiled(steps + 1)
    short, line_short, wall_short, _, where_short, _ = min(short_first, profiled(1), key=lambda r: r[2])
    per_step = {c: (long.get(c, 0.0) - short.get(c, 0.0)) / steps for c in set(long) | set(short)}
    wall = (wall_long - wall_short) / steps * 1e6
    timeline = {f"{key}_per_step": (line_long[key] - line_short.get(key, 0.0)) / steps for key in line_long}
    where = {k: sorted(((round((v - where_short[k].get(n, 0.0)) / steps, 1), n[:60])
                        for n, v in where_long[k].items()), reverse=True)[:6] for k in where_long}
    return {"batch": b, "wall_us_per_step": wall, "gpu_us_per_step": per_step,
            "gpu_total_us_per_step": sum(per_step.values()), **timeline, "top_kernels_long_run": top,
            "host_calls_us_per_step": where["host_calls"], "long_gaps_before_us_per_step": where["gaps_before"],
            "decode_steps": steps_long}


PHASE = "bench phase:"          # the worker's markers in its log, between the engine's own lines
JIT_LINE = re.compile(r"JIT compilation during inference: (\S+?)[.(\s]")
WARM_UP_LINE = re.compile(r"kernels warmed at \d+ token counts in ([\d.]+) s")   # `core.LayerCore.warm_up`'s log


def jit_compiles(log: str) -> dict[str, list[str]]:
    """Kernels vLLM's JIT monitor (verbose: every compilation) saw compiled during inference, by the
    worker's phase ("batch B warm-up", "batch B timed", "profiles"; "start" before the first): a
    compilation in a timed phase stalled a timed run."""
    phase, out = "start", {}
    for line in log.splitlines():
        if line.startswith(PHASE):
            phase = line[len(PHASE):].strip()
        elif (m := JIT_LINE.search(line)):
            out.setdefault(phase, []).append(m.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes with fewer layers (~3 min)")
    ap.add_argument("--shapes", help="comma-separated SHAPE:LAYERS (shapes of testing/checkpoints.py)")
    ap.add_argument("--mode", choices=sorted(MODES), default="compiled")
    ap.add_argument("--strict", action="store_true", help="also nvfp4_sampler in strict mode (one more engine)")
    ap.add_argument("--dynamo", action="store_true", help="also nvfp4_sampler on dynamo's eager backend (one more engine)")
    for name, (flag, _, text) in KERNEL_VARIANTS.items():
        ap.add_argument(flag, action="append_const", const=name, dest="variants", help=f"also nvfp4_sampler: {text}")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "bench_vllm_e2e.json"))
    ap.add_argument("--profiled", default=",".join(map(str, PROFILED)),
                    help="comma-separated batches whose decode steps are profiled (of %s)" % (BATCHES,))
    ap.add_argument("--worker", nargs=5, metavar=("MODEL", "QUANT", "MODE", "OUT", "PROFILED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    profiled = tuple(int(b) for b in args.profiled.split(","))
    if not set(profiled) <= set(BATCHES):
        ap.error(f"--profiled takes batches of {BATCHES}, got {args.profiled}")
    import torch

    from nvfp4_sampler.testing.checkpoints import build

    results: dict = {"mode": args.mode, "device": torch.cuda.get_device_name(), "prompt_len": PROMPT_LEN,
                     "new_tokens": NEW_TOKENS, "models": {}}
    quants = (("bf16", "nvfp4_sampler") + ((STRICT,) if args.strict else ()) + ((DYNAMO,) if args.dynamo else ())
              + tuple(name for name in KERNEL_VARIANTS if name in (args.variants or ())))
    if args.dynamo and args.mode != "compiled":
        ap.error("--dynamo compares against the compiled mode: --mode compiled")
    tmp = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    shapes = [(s, int(n)) for s, n in (x.split(":") for x in args.shapes.split(","))] if args.shapes else \
        QUICK if args.quick else FULL
    for shape, layers in shapes:
        path = build(tmp / shape, shape, seed=0, layers=layers)
        torch.cuda.empty_cache()
        entry = results["models"][shape] = {"layers": layers}
        for quant in quants:
            out = tmp / f"{shape}-{quant}.json"
            proc = subprocess.run([sys.executable, __file__, "--worker", str(path), quant, args.mode, str(out),
                                   args.profiled],
                                  cwd=ROOT, capture_output=True, text=True)
            entry[quant] = json.loads(out.read_text()) if out.exists() else {}
            log = proc.stdout + proc.stderr
            entry[quant]["jit_compiles"] = jit_compiles(log)
            entry[quant]["warm_up_seconds"] = sum(map(float, WARM_UP_LINE.findall(log)))
            # each engine's log beside the results (vLLM's resolved CUDA graph mode, its captures, warnings)
            Path(args.out).with_name(f"{Path(args.out).stem}.{shape}.{quant}.log").write_text(log)
            if proc.returncode:                             # what it measured before failing is kept
                entry[quant]["error"] = proc.stderr[-3000:]
            Path(args.out).write_text(json.dumps(results, indent=1))
        shutil.rmtree(tmp / shape)       # its checkpoint (up to ~20 GB): a device's disk holds few of them
    shutil.rmtree(tmp)
    asyncs = sorted({str(e[q].get("async_scheduling")) for e in results["models"].values() for q in quants})
    print(f"\nDecode tokens/s, {results['device']}, vLLM mode {args.mode}, engine core in its own process, async "
          f"scheduling {'/'.join(asyncs)}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens")
    # nvfp4 vs BF16, then each further engine (strict, dynamo, kernel variants) vs both
    ratios = [(quants[1], quants[0])] + [(v, base) for v in quants[2:] for base in quants[:2]]
    print("| model (layers) | batch | " + " | ".join(f"{q} tok/s" for q in quants) + " | "
          + " | ".join(f"{a} / {b}" for a, b in ratios) + f" | spread of {REPEATS} ({' / '.join(quants)}) |\n|"
          + "---|" * (3 + len(quants) + len(ratios)))
    for shape, entry in results["models"].items():
        for b in BATCHES:
            tps = {q: entry[q].get("tokens_per_s", {}).get(str(b), entry[q].get("tokens_per_s", {}).get(b))
                   for q in quants}
            cells = [f"{tps[x] / tps[y]:.2f}x" if tps[x] and tps[y] else "n/a" for x, y in ratios]
            spread = " / ".join("{:.0f}-{:.0f}".format(*entry[q].get("spread", {}).get(str(b), (0, 0)))
                                for q in quants)
            print(f"| {shape} ({entry['layers']}) | {b} | " + " | ".join(f"{tps[q] or 0:.0f}" for q in quants)
                  + " | " + " | ".join(cells) + f" | {spread} |")
        for q in quants:
            print(f"\n{shape}, {q}: start {entry[q].get('start_seconds')} s (load-time kernel warm-up "
                  f"{entry[q].get('warm_up_seconds', 0):.1f} s); kernels JIT-compiled while serving (vLLM's JIT "
                  "monitor), by phase: " + ("; ".join(f"{phase}: {len(names)} ({', '.join(sorted(set(names)))})"
                                                     for phase, names in entry[q].get("jit_compiles", {}).items())
                                           or "none"))
        for b in profiled:
            print(f"\nper decode step at batch {b}, {shape}: GPU us by kernel category ({' / '.join(quants)})")
            prof = {q: entry[q].get("profiles", {}).get(str(b), {}) for q in quants}
            cats = sorted(set().union(*(p.get("gpu_us_per_step", {}) for p in prof.values())))
            totals = {"GPU total (kernel durations summed)": "gpu_total_us_per_step",
                      "GPU busy (overlapping kernels counted once)": "busy_us_per_step",
                      f"GPU idle in gaps < {GAP_SPLIT_US:.0f} us (launch gaps)": "idle_short_us_per_step",
                      f"GPU idle in gaps >= {GAP_SPLIT_US:.0f} us (waiting for the host)": "idle_long_us_per_step",
                      "kernels (count)": "kernels_per_step", "launch gaps (count)": "short_gaps_per_step",
                      "host: CUDA graph replays (count)": "graph_launches_per_step",
                      "host: kernels launched one by one (count)": "kernel_launches_per_step",
                      "host: torch operators run (count)": "cpu_ops_per_step",
                      "wall (profiled)": "wall_us_per_step",
                      f"wall (unprofiled, {b} / tokens/s)": "wall_us_per_step_unprofiled"}
            for c in cats + list(totals):
                vals = [p.get(totals[c]) if c in totals else p.get("gpu_us_per_step", {}).get(c) for p in prof.values()]
                print(f"  {c:55s} " + " / ".join("-" if v is None else f"{v:8.1f}" for v in vals))
            steps = {q: p.get("decode_steps") or {} for q, p in prof.items()}
            print("  per step of the long profiled run alone (median of its decode steps, forward to forward):")
            for c, key in (("step on the GPU timeline (profiled)", "period_us"), ("GPU busy in it", "busy_us"),
                           ("kernels in it (count)", "kernels")):
                print(f"    {c:53s} " + " / ".join(f"{st[key]:8.1f}" if key in st else "-" for st in steps.values()))
            for c in sorted(set().union(*(st.get("gpu_us", {}) for st in steps.values()))):
                print(f"    {c:53s} " + " / ".join(f"{st['gpu_us'].get(c, 0.0):8.1f}" if st else "-"
                                                  for st in steps.values()))
            for q in quants:
                for key, what in (("host_calls_us_per_step", "CUDA calls on the host, us per step"),
                                  ("long_gaps_before_us_per_step", "host waits, us per step, by the GPU work after")):
                    if prof[q].get(key):
                        print(f"  {q} {what}: " + ", ".join(f"{n} {v}" for v, n in prof[q][key]))
        for q in quants:
            if "error" in entry[q]:
                print(f"{shape} {q} failed:\n{entry[q]['error']}")


if __name__ == "__main__":
    main()
