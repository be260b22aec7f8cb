"""Weight sync of a Qwen3-30B-A3B-shaped model: trainer-side NVFP4 vs BF16 quantized on arrival.

The trainer's BF16 state dict lives on --device (the H200: `cuda`). A sidecar (`nvfp4-sampler serve
--engine embedded`, the same machine) serves a checkpoint of the same shapes. For each path, one
update = conversion (NVFP4 only) + transfer + commit (stage + apply in the engine):
  http  `SamplerClient.push`: buckets converted on the tensors' device, staged through two pinned
        host buffers, streamed over loopback HTTP (server/push.py)
  ipc   begin + `SamplerClient.send_ipc` per bucket (CUDA IPC handles of device buffers, no host
        round trip on the trainer side; server/ipc.py) + commit
  layouts: nvfp4 (triplets converted on the trainer) and bf16 (the sampler quantizes on arrival).
Also: device copy bandwidth of the same BF16 bytes (goal: conversion >= 75% of it), device-to-host
bandwidth, and the conversion alone. Layers are the real 30B-A3B ones (hidden 2048, 32/4 heads of
128, 128 experts of 768); `--layers` of the 48 are built and results are scaled per layer to 48
(embeddings and lm_head use a small vocabulary and are left out of the per-layer figures).

  planned  (`--paths planned`, issue #20) the planned protocol (`server.planned`): the transfer plan
        built once (`server.plan`: fused entries, fixed offsets), each plan bucket quantized straight
        into one of two reused send buffers on the device (one launch per fused expert tensor, no
        pack step; double-buffered: the next bucket converts while the previous one is sent), sent as
        handle + index (`SamplerClient.send_bucket`), committed as fused entries (`commit.apply_fused`).
        Sub-steps: plan (version + begin), version (its first request), convert (host time enqueueing
        the fills), wait (the send thread waiting for a bucket's kernels), send (the request: handle,
        sidecar copy + its one validation + answer), sidecar (seconds inside the sidecar's bucket
        handler, from its /metrics, and by step: queue for a worker thread, open the buffer, copy +
        validation to the host sync, status) and in garbage-collector pauses (sidecar_gc; trainer_gc: this
        process's), buffer_wait,
        transfer (wall of all buckets), commit; counted: entries, buckets, host syncs and (with
        --profile) the trainer's CUDA kernels (launches, GPU time, the largest). Its sidecar's embedded engine runs on
        --device and serves a pre-quantized checkpoint of the same shapes (placeholder NVFP4 values,
        ~17 GB on disk for all 48 layers, written before the trainer state is built), so the whole
        model fits one H200: `--paths planned --layers 48`.

    GPU:  python bench/bench_sync.py --layers 4 --out $OUT/bench_sync.json
          python bench/bench_sync.py --paths planned --layers 48 --out $OUT/bench_sync_planned.json
          (an 80 GB GPU: --distinct-layers 12, the trainer's 48 layers aliasing 12 layers' BF16 storage)
    CPU:  python bench/bench_sync.py --quick           (1 layer, 8 experts: checks the script)
          python bench/bench_sync.py --quick --paths planned
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from nvfp4_sampler.converters.convert import ConvertOptions, iter_buckets
from nvfp4_sampler.server import ipc
from nvfp4_sampler.server import push as push_pipeline
from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server.process import sidecar
from nvfp4_sampler.testing import manifests

FULL_LAYERS = 48
# the 30B-A3B shape with a small vocabulary (the sync measures the layers; lm_head and embeddings are a
# constant part of every update)
QWEN3_30B_A3B = {**manifests.QWEN3_30B_A3B, "vocab_size": 512}
ANCHORS = "anchors: the report's NVFP4 sync 55.26 s per step (BF16 9.94 s); NeMo-RL Qwen3-30B BF16 refit 0.48-0.74 s"


def layer_tensors(cfg: dict, layer: int, device: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """BF16 weights of one decoder layer as a transformers-5 trainer holds them: experts fused,
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows) and `mlp.experts.down_proj` [E, H, I]."""
    h, hd, e, inter = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = f"model.layers.{layer}."
    shapes = {f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
              f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
              f"{p}mlp.gate.weight": (e, h), f"{p}mlp.experts.gate_up_proj": (e, 2 * inter, h),
              f"{p}mlp.experts.down_proj": (e, h, inter)}
    out = {n: (torch.randn(s, generator=gen, device=device) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    for n in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}{n}.weight"] = torch.ones(h, dtype=torch.bfloat16, device=device)
    for n in ("q_norm", "k_norm"):
        out[f"{p}self_attn.{n}.weight"] = torch.ones(hd, dtype=torch.bfloat16, device=device)
    return out


def model_tensors(cfg: dict, device: str, distinct: int | None = None) -> dict[str, torch.Tensor]:
    """The trainer's BF16 state dict. distinct: layers with storage of their own; layer i holds layer
    i % distinct's tensors under its own names (the whole model's updates on a GPU that cannot hold its BF16
    state beside the sampler's: each update still reads every layer's bytes from DRAM, `distinct` layers
    being far larger than L2)."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen, device=device) * 0.02).to(torch.bfloat16),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
           "lm_head.weight": (torch.randn(v, h, generator=gen, device=device) * 0.02).to(torch.bfloat16)}
    distinct = min(distinct or layers, layers)
    for i in range(distinct):
        out |= layer_tensors(cfg, i, device, gen)
    for i in range(distinct, layers):
        src = f"model.layers.{i % distinct}."
        out |= {f"model.layers.{i}.{n[len(src):]}": t for n, t in list(out.items()) if n.startswith(src)}
    return out


def write_folder(state: dict[str, torch.Tensor], cfg: dict, path: Path) -> Path:
    """The served checkpoint (per-expert checkpoint names, as `save_pretrained` writes them)."""
    from nvfp4_sampler.converters import name_map
    from nvfp4_sampler.testing.models import tokenizer

    path.mkdir(parents=True)
    tensors = {m.name: (t if m.index is None else t[m.index]).cpu().contiguous()
               for n, t in state.items() for m in name_map.expand(n, tuple(t.shape))}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer(path)
    return path


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn) -> float:
    """Seconds of fn() between two synchronisations of device."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bandwidths(state: dict[str, torch.Tensor], device: str) -> dict[str, float]:
    """Seconds for a device copy of the quantized linears' BF16 bytes, their conversion alone
    (iter_buckets, no report), and a device-to-host copy of everything into one pinned buffer."""
    linears = {n: t for n, t in state.items() if "_proj" in n}
    dst = {n: torch.empty_like(t) for n, t in linears.items()}
    copy = lambda: [dst[n].copy_(t) for n, t in linears.items()]                      # noqa: E731
    src = push_pipeline.plan(state, config=CFG).source
    convert = lambda: [None for _ in iter_buckets(src, ConvertOptions(report=False, bucket_bytes=512 << 20))]  # noqa: E731
    copy(), convert()                                                                  # warm-up (kernel compilation)
    out = {"linear_bf16_bytes": sum(t.numel() * 2 for t in linears.values()),
           "copy_s": min(timed(device, copy) for _ in range(3)),
           "convert_s": min(timed(device, convert) for _ in range(3))}
    del dst
    total = sum(t.numel() * t.element_size() for t in state.values())
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.startswith("cuda"))

    def d2h():
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            host[off:off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            off += n
    out |= {"all_bytes": total, "d2h_s": min(timed(device, d2h) for _ in range(2))}
    return out


def push_http(client: SamplerClient, state, layout: str) -> dict[str, float]:
    r = client.push(state, layout=layout, config=CFG, progress=False)
    return {"payload": r.payload_bytes, "prepare": r.prepare_seconds, "send": r.send_seconds,
            "commit": r.commit_seconds, "total": r.total_seconds}


def push_ipc(client: SamplerClient, state, layout: str) -> dict[str, float]:
    """One update through CUDA IPC (CPU: shared-memory files) buckets, converted on the device."""
    t0 = time.perf_counter()
    plan = push_pipeline.plan(state, layout=layout, config=CFG)
    st = client.begin(client.version().weight_version + 1, list(plan.entries.values()))
    prepare = 0.0
    t1 = time.perf_counter()
    buckets = iter_buckets(plan.source, plan.options)
    while True:
        tp = time.perf_counter()
        bucket = next(buckets, None)
        prepare += time.perf_counter() - tp
        if bucket is None:
            break
        st = client.send_ipc(st.update_id, bucket)
    if st.missing_count:
        raise RuntimeError(f"{st.missing_count} tensors missing after the IPC buckets")
    t2 = time.perf_counter()
    res = client.commit(st.update_id)
    t3 = time.perf_counter()
    return {"payload": res.bytes, "prepare": prepare, "send": t2 - t1, "commit": t3 - t2, "total": t3 - t0}


# ---- planned mode ---------------------------------------------------------------------------------

def nvfp4_manifest(cfg: dict) -> list:
    """The NVFP4 update manifest of `cfg` as the converter emits it for `model_tensors`
    (`testing.manifests`), as protocol entries (no tensors needed)."""
    from nvfp4_sampler.server.protocol import TensorEntry
    return [TensorEntry(name=n, layout=lay, dtype=d, shape=shape)
            for n, lay, d, shape in manifests.qwen3_moe_nvfp4_manifest(cfg)]


def plan_counts(plan) -> dict[str, int]:
    """What a planned update of `plan` costs in entries, tensors, buckets and (by construction) the
    sidecar's kernels: one copy + one validation pass per checked value class per bucket, and one
    copy per fused tensor at commit (+ one gather per per-row decode scale)."""
    checked = sum(1 for b in plan.buckets for r, _, _ in b.regions if r != "codes")
    return {"manifest_entries": len(plan.manifest),
            "manifest_tensors": sum(3 if e.layout == "nvfp4" else 1 for e in plan.manifest),
            "planned_entries": len(plan.entries), "planned_tensors": plan.tensor_count(),
            "buckets": len(plan.buckets), "bucket_bytes": plan.bucket_bytes, "plan_bytes": plan.nbytes,
            "sidecar_validation_passes": checked, "sidecar_host_syncs": len(plan.buckets) + 1}


def write_nvfp4_folder(cfg: dict, path: Path) -> Path:
    """A pre-quantized checkpoint of `cfg`'s shapes (codes 0, block scales 0, decode scales 1): what
    the planned mode's sidecar serves before the first update (only its shapes matter)."""
    from nvfp4_sampler.testing.models import tokenizer

    path.mkdir(parents=True)
    tensors = {}
    for e in nvfp4_manifest(cfg):
        n, k = e.shape[0], e.shape[-1]
        if e.layout == "nvfp4":
            p = e.name.removesuffix(".weight")
            tensors[e.name] = torch.zeros(n, k // 2, dtype=torch.uint8)
            tensors[f"{p}.weight_scale"] = torch.zeros(n, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
            tensors[f"{p}.weight_scale_2"] = torch.ones(())
        else:
            tensors[e.name] = torch.ones(e.shape, dtype=torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer(path)
    return path


def push_planned(client: SamplerClient, state, *, bucket_bytes: int, device: str, buffers: int = 2,
                 held: dict | None = None) -> dict[str, float]:
    """One update with the planned protocol (`server.planned`): plan (first call: build + begin with
    the manifest, the sender's jobs and `buffers` send buffers; later: begin with the held plan_id),
    every bucket quantized straight into a send buffer and sent while the next one converts, commit.
    Returns seconds per sub-step and counts."""
    from nvfp4_sampler.server.app import GcPauses
    from nvfp4_sampler.server.planned import PlannedSender

    held = held if held is not None else {}
    sidecar_s = sidecar_bucket_seconds(client)
    trainer_gc: list[float] = []
    with GcPauses(lambda generation, seconds: trainer_gc.append(seconds)):
        t0 = time.perf_counter()
        version = client.version().weight_version + 1
        t_version = time.perf_counter() - t0
        if "sender" not in held:
            sender = PlannedSender.of(state, config=CFG, bucket_bytes=bucket_bytes)
            st = client.begin(version, list(sender.plan.manifest), bucket_bytes=bucket_bytes)
            if st.plan_id != sender.plan.plan_id:
                raise RuntimeError(f"plan ids differ: sidecar {st.plan_id}, trainer {sender.plan.plan_id}")
            held.update(sender=sender, send=sender.new_buffers(device, buffers))
        else:
            sender = held["sender"]
            st = client.begin(version, bucket_bytes=None, plan_id=sender.plan.plan_id)
        t_plan = time.perf_counter() - t0
        syncs = sender.host_syncs
        times: dict[str, float] = {}
        t1 = time.perf_counter()
        st = sender.push(client, st.update_id, held["send"], times=times)
        t2 = time.perf_counter()
        if st.missing_count:
            raise RuntimeError(f"{st.missing_count} tensors missing after the planned buckets")
        res = client.commit(st.update_id)
        t3 = time.perf_counter()
    sidecar_s = {k: v - sidecar_s[k] for k, v in sidecar_bucket_seconds(client).items()}
    return {"payload": res.bytes, "plan": t_plan, "version": t_version, **times, **sidecar_s,
            "trainer_gc": sum(trainer_gc), "transfer": t2 - t1, "commit": t3 - t2,
            "engine_apply": res.apply_seconds, "total": t3 - t0, "entries": len(sender.plan.entries),
            "buckets": len(sender.plan.buckets), "trainer_host_syncs": sender.host_syncs - syncs,
            "sidecar_host_syncs": len(sender.plan.buckets) + 1}

def sidecar_bucket_seconds(client: SamplerClient) -> dict[str, float]:
    """Seconds the sidecar has spent in its IPC bucket handler so far, in all ("sidecar") and by step
    ("sidecar_queue", "sidecar_open", "sidecar_copy", "sidecar_status"), and in garbage-collector pauses
    ("sidecar_gc", whatever it was doing): its /metrics histograms' sums."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for f in text_string_to_metric_families(client.metrics()):
        for s in f.samples:
            if s.name == "nvfp4_sampler_ipc_bucket_seconds_sum":
                out["sidecar"] = s.value
            elif s.name == "nvfp4_sampler_ipc_bucket_step_seconds_sum":
                out[f"sidecar_{s.labels['step']}"] = s.value
            elif s.name == "nvfp4_sampler_gc_pause_seconds_sum":
                out["sidecar_gc"] = out.get("sidecar_gc", 0.0) + s.value
    return {k: out.get(k, 0.0) for k in SIDECAR_STEPS}


def profile_kernels(fn, device: str) -> dict | None:
    """CUDA kernels `fn()` launches in this process (torch profiler): count, GPU seconds, and the five
    largest by time (name, count, seconds); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:60], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:5]
    return {"launches": sum(c for c, _ in kernels.values()), "gpu_s": sum(t for _, t in kernels.values()),
            "top": [(n, c, round(t, 4)) for n, (c, t) in top]}


SIDECAR_STEPS = ("sidecar", "sidecar_queue", "sidecar_open", "sidecar_copy", "sidecar_status", "sidecar_gc")
SUBSTEPS = ("plan", "version", "convert", "wait", "send", *SIDECAR_STEPS, "buffer_wait", "transfer", "commit",
            "engine_apply", "trainer_gc", "total")


def timing_table(rows: dict[str, dict], *, scale: float = 1.0) -> str:
    """A markdown table of planned-mode runs: one row per label, seconds per sub-step, then counts;
    `scale` (48 / layers) adds an "x48 total" column."""
    head = "| run | " + " | ".join(f"{k} s" for k in SUBSTEPS) + " | x48 total s | entries | buckets | host syncs |"
    lines = [head, "|---|" + "---:|" * (len(SUBSTEPS) + 4)]
    for label, r in rows.items():
        if "error" in r:
            lines.append(f"| {label} | not available: {r['error']} |" + "|" * (len(SUBSTEPS) + 3))
            continue
        cells = [f"{r[k]:.3f}" if k in r else "-" for k in SUBSTEPS]
        syncs = f"{r.get('trainer_host_syncs', 0)} + {r.get('sidecar_host_syncs', 0)}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['total'] * scale:.2f} | {r.get('entries', '-')} | "
                     f"{r.get('buckets', '-')} | {syncs} |")
    return "\n".join(lines)


def run_planned(args, results: dict) -> None:
    """The planned mode: its own sidecar (embedded engine on --device) serving a pre-quantized
    folder written first, then the trainer state, then per bucket size (--bucket-mib) a first update
    (plan built) and `--repeats` planned updates."""
    from nvfp4_sampler.server.plan import TransferPlan

    sizes = [int(mib) << 20 for mib in args.bucket_mib.split(",")]
    counts = {}
    for size in sizes:
        t0 = time.perf_counter()
        plan = TransferPlan.build(nvfp4_manifest(CFG), bucket_bytes=size)
        counts[size >> 20] = plan_counts(plan) | {"plan_build_s": time.perf_counter() - t0}
        print(f"plan, {size >> 20} MiB buckets: {counts[size >> 20]}", flush=True)
    results["planned-counts"] = counts
    env = {"NVFP4_SAMPLER_DEVICE": args.device} if args.device.startswith("cuda") else {}
    if args.profile_commits:                                # every commit of this sidecar under the profiler
        env["NVFP4_SAMPLER_PROFILE_COMMITS"] = str(Path(args.profile_commits).resolve())
    rows = {}
    t0 = time.perf_counter()
    phase = lambda what: print(f"[{time.perf_counter() - t0:7.1f} s] {what}", flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-sync-planned-") as tmp, contextlib.ExitStack() as stack:
        folder = write_nvfp4_folder(CFG, Path(tmp) / "model")
        phase(f"pre-quantized folder written ({(folder / 'model.safetensors').stat().st_size / 1e9:.1f} GB)")
        log = Path(args.out).with_suffix(".sidecar.log") if args.out else Path(tmp) / "sidecar.log"
        srv = stack.enter_context(sidecar(folder, engine="embedded", env=env, log=log))
        client = stack.enter_context(SamplerClient(srv.url, timeout=3600))
        phase(f"sidecar serving it (its log: {log})")
        (folder / "model.safetensors").unlink()             # the engine holds it now; free the disk
        state = model_tensors(CFG, args.device, args.distinct_layers)
        phase("trainer state built")
        for size in sizes:
            held: dict = {}                                 # a new plan, sender and send buffers per size
            runs = []
            for i in range(args.repeats + 1):               # the first run builds the plan and warms up
                r = push_planned(client, state, bucket_bytes=size, device=args.device, buffers=args.buffers, held=held)
                runs.append(r)
                print(f"planned {size >> 20} MiB run {i}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
            if args.profile and "planned-kernels" not in results:
                results["planned-kernels"] = profile_kernels(
                    lambda: push_planned(client, state, bucket_bytes=size, device=args.device,
                                         buffers=args.buffers, held=held), args.device)
            rows[f"{size >> 20} MiB first (plan built)"] = runs[0]
            rows[f"{size >> 20} MiB steady (median)"] = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[1]} \
                if len(runs) > 1 else runs[0]
            del held
        del state
    results["planned"] = rows
    print(f"\nplanned NVFP4, {args.layers} of 48 layers ({args.experts} experts), {args.buffers} send buffers of "
          f"the bucket size; sidecar: seconds inside its bucket handler (send - sidecar: HTTP, handle, client), "
          f"sidecar_*: by step; "
          f"host syncs: trainer + sidecar\n")
    print(timing_table(rows, scale=FULL_LAYERS / args.layers))
    if results.get("planned-kernels") is not None:
        k = results["planned-kernels"]
        print(f"trainer CUDA kernels per update (quantize + amax + dense copies + flags): {k['launches']} launches, "
              f"{k['gpu_s']:.3f} GPU s; largest: {k['top']}")
    if args.profile_commits:
        tables = sorted(Path(args.profile_commits).glob("commit-*.txt"), key=lambda f: int(f.stem.split("-")[1]))
        print(f"\nthe commits ran under the profiler (their times above include it and a final synchronize); "
              f"the last commit's operators and kernels ({tables[-1] if tables else 'none written'}):")
        if tables:
            print(tables[-1].read_text())
    entries = ", ".join(f"{c['planned_entries']} entries at {mib} MiB" for mib, c in counts.items())
    print(f"goal: whole 30B-A3B (x48) <= 0.5 s including conversion, commit <= 50 ms, <= 600 entries "
          f"(these plans: {entries} for {args.layers} layers)")


def median_runs(fn, repeats: int) -> dict[str, float]:
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    global CFG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers built (of 48)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2, help="pushes per path (median)")
    ap.add_argument("--paths", default="http,ipc", help="comma-separated: http, ipc, planned")
    ap.add_argument("--bucket-mib", default="512", help="planned: plan bucket sizes in MiB, comma-separated")
    ap.add_argument("--buffers", type=int, default=2, help="planned: reused send buffers (2: double-buffered)")
    ap.add_argument("--profile", action="store_true", help="planned: count the trainer's CUDA kernel launches")
    ap.add_argument("--profile-commits", default=None,
                    help="planned: a folder where the sidecar writes each commit's profiler table (printed: the last)")
    ap.add_argument("--distinct-layers", type=int, default=None,
                    help="planned: trainer layers with storage of their own, the others alias them (default: all; "
                         "12 fits the whole model's update on an 80 GB GPU)")
    ap.add_argument("--quick", action="store_true", help="CPU check: 1 layer, 8 experts, 1 repeat")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.experts, args.repeats = 1, 8, 1
    CFG = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers, "num_experts": args.experts}
    torch.manual_seed(0)
    paths = [p for p in args.paths.split(",") if p]
    if "planned" in paths:                                   # before the other paths' state: the whole model fits
        dev = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else f"CPU x{os.cpu_count()}"
        print(f"device {dev}; torch {torch.__version__}; planned mode, {args.layers} layers x {args.experts} "
              f"experts" + (f", the trainer's BF16 in {args.distinct_layers} distinct layers" if args.distinct_layers
                            else ""), flush=True)
        results = {"device": dev, "layers": args.layers, "experts": args.experts,
                   "distinct_layers": args.distinct_layers or args.layers}
        try:
            run_planned(args, results)
        except Exception as e:  # noqa: BLE001 - reported, the other paths still run
            results["planned"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"planned: {results['planned']}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        paths.remove("planned")
        if not paths:
            return 0 if "error" not in results["planned"] else 1
        if args.out:
            args.out = str(Path(args.out).with_suffix("")) + "-paths.json"
    state = model_tensors(CFG, args.device)
    layer_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("model.layers."))
    dev = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else f"CPU x{os.cpu_count()}"
    print(f"device {dev}; torch {torch.__version__}; {args.layers} layers x {args.experts} experts, "
          f"{layer_bytes / 1e9:.2f} GB BF16 in layers, {len(state)} tensors", flush=True)

    results: dict = {"device": dev, "layers": args.layers, "experts": args.experts, "layer_bytes": layer_bytes}
    results["bandwidth"] = bw = bandwidths(state, args.device)
    print(f"device copy {bw['linear_bf16_bytes'] * 2 / bw['copy_s'] / 1e9:.0f} GB/s (read+write), conversion "
          f"{bw['linear_bf16_bytes'] / bw['convert_s'] / 1e9:.1f} GB/s of BF16 -> conversion time = "
          f"{bw['copy_s'] / bw['convert_s']:.2f}x of a copy of the same BF16 (goal >= 0.75); device-to-host "
          f"{bw['all_bytes'] / bw['d2h_s'] / 1e9:.1f} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp, contextlib.ExitStack() as stack:
        folder = write_folder(state, CFG, Path(tmp) / "model")
        srv = stack.enter_context(sidecar(folder, engine="embedded", log=Path(tmp) / "sidecar.log"))
        client = stack.enter_context(SamplerClient(srv.url, timeout=3600))
        for path in paths:
            fn = push_http if path == "http" else push_ipc
            for layout in ("nvfp4", "bf16"):
                try:
                    results[f"{path}-{layout}"] = median_runs(lambda: fn(client, state, layout), args.repeats)
                except Exception as e:  # noqa: BLE001 - reported in the table, the other paths still run
                    results[f"{path}-{layout}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{path} {layout}: {results[f'{path}-{layout}']}", flush=True)
                if args.out:                                   # a cut run keeps what it measured
                    Path(args.out).write_text(json.dumps(results, indent=2))

    scale = FULL_LAYERS / args.layers
    print(f"\n{dev}, {args.layers} of 48 layers ({args.experts} experts), medians of {args.repeats}; "
          f"x48: per-layer time scaled to 48 layers\n")
    print("| path | layout | payload GB | prepare s | send s | commit s | total s | per layer s | x48 s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        for layout in ("nvfp4", "bf16"):
            r = results[f"{path}-{layout}"]
            if "error" in r:
                print(f"| {path} | {layout} | not available: {r['error']} |||||||")
                continue
            print(f"| {path} | {layout} | {r['payload'] / 1e9:.2f} | {r['prepare']:.2f} | {r['send']:.2f} | "
                  f"{r['commit']:.2f} | {r['total']:.2f} | {r['total'] / args.layers:.3f} | {r['total'] * scale:.1f} |")
    for path in paths:
        nv, bf = results[f"{path}-nvfp4"], results[f"{path}-bf16"]
        if "error" not in nv and "error" not in bf:
            print(f"{path}: NVFP4 / BF16 total {nv['total'] / bf['total']:.2f}x (goal <= 0.4), "
                  f"bytes {nv['payload'] / bf['payload']:.2f}x")
    if "ipc-nvfp4" in results and "error" not in results["ipc-nvfp4"]:
        print(f"ipc NVFP4, whole 30B-A3B (x48): {results['ipc-nvfp4']['total'] * scale:.2f} s (goal <= 1 s)")
    print(ANCHORS)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


CFG: dict = {}

if __name__ == "__main__":
    sys.exit(main())
