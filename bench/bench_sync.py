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

    GPU:  python bench/bench_sync.py --layers 4 --out $OUT/bench_sync.json
    CPU:  python bench/bench_sync.py --quick           (1 layer, 8 experts: checks the script)
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
from nvfp4_sampler.server import push as push_pipeline
from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server.process import sidecar

FULL_LAYERS = 48
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "max_position_embeddings": 4096, "tie_word_embeddings": False, "vocab_size": 512,
                 "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16"}
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


def model_tensors(cfg: dict, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen, device=device) * 0.02).to(torch.bfloat16),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
           "lm_head.weight": (torch.randn(v, h, generator=gen, device=device) * 0.02).to(torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        out |= layer_tensors(cfg, i, device, gen)
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


def _timed(device: str, fn) -> float:
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
           "copy_s": min(_timed(device, copy) for _ in range(3)),
           "convert_s": min(_timed(device, convert) for _ in range(3))}
    del dst
    total = sum(t.numel() * t.element_size() for t in state.values())
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.startswith("cuda"))

    def d2h():
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            host[off:off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            off += n
    out |= {"all_bytes": total, "d2h_s": min(_timed(device, d2h) for _ in range(2))}
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
    if st.missing:
        raise RuntimeError(f"{len(st.missing)} tensors missing after the IPC buckets")
    t2 = time.perf_counter()
    res = client.commit(st.update_id)
    t3 = time.perf_counter()
    return {"payload": res.bytes, "prepare": prepare, "send": t2 - t1, "commit": t3 - t2, "total": t3 - t0}


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
    ap.add_argument("--paths", default="http,ipc", help="comma-separated: http, ipc")
    ap.add_argument("--quick", action="store_true", help="CPU check: 1 layer, 8 experts, 1 repeat")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.experts, args.repeats = 1, 8, 1
    CFG = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers, "num_experts": args.experts}
    torch.manual_seed(0)
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

    paths = [p for p in args.paths.split(",") if p]
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
