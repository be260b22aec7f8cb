"""Weight updates from a trainer to sampler ranks on other GPUs (`server.broadcast`, issue #20 item 4):
a Qwen3-30B-A3B-shaped NVFP4 update, broadcast to every rank against per-rank plans (each tensor-
parallel rank sent only its rows and K range), beside the transport's own roof (one NCCL send of the
same bytes per rank) in the same run.

Ranks: 0 the trainer (GPU 0), 1 .. --tp the samplers of one tensor-parallel engine (GPU r), all in one
`WeightGroup` (NCCL; gloo with --quick on CPU). The trainer holds the update as the converter emits it
(per-expert NVFP4 triplets, placeholder values: codes random, block scales 1.0, decode scales 1.0; BF16
norms, routers, embeddings); each sampler holds storage as vLLM does under tensor parallelism (q / k / v
fused and split by rows, o_proj by K, every layer's experts stacked, w13 split by rows, w2 by K).
Timed per update: the trainer's wall (packing and sending every bucket, the verdict) and each sampler's
(receiving, validating, checking, writing; CUDA synchronised), median of --repeats after one warm-up.

    GPU (1 + tp GPUs):  python bench/bench_sync_nccl.py --tp 1 --layers 48 --out $OUT/sync_nccl.json
                        python bench/bench_sync_nccl.py --tp 2 --layers 48
    CPU (checks it):    python bench/bench_sync_nccl.py --quick
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from nvfp4_sampler.sampler_format import SamplerConfig
from nvfp4_sampler.sampler_plugin import commit, layers
from nvfp4_sampler.server import broadcast
from nvfp4_sampler.server.plan import TransferPlan
from nvfp4_sampler.server.process import free_port
from nvfp4_sampler.server.protocol import TensorEntry
from nvfp4_sampler.testing import manifests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # run as a script: the repository's `bench`
from bench.bench_sync import timed  # noqa: E402

E4M3_ONE = 0x38


def _device(rank: int, backend: str) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def update_tensors(manifest: list[TensorEntry], device: torch.device) -> dict[str, torch.Tensor]:
    """The trainer's update: every manifest entry's tensors (NVFP4 triplets or BF16) on `device`."""
    out = {}
    for e in manifest:
        n, k = e.shape[0], e.shape[-1]
        if e.layout == "nvfp4":
            p = e.name.removesuffix(".weight")
            out[e.name] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
            out[f"{p}.weight_scale"] = torch.full((n, k // 16), E4M3_ONE, dtype=torch.uint8,
                                                  device=device).view(torch.float8_e4m3fn)
            out[f"{p}.weight_scale_2"] = torch.ones((), device=device)
        else:
            out[e.name] = torch.ones(e.shape, dtype=torch.bfloat16, device=device)
    return out


def sampler_targets(cfg: dict, tp_rank: int, tp: int, device: torch.device) -> dict[str, commit.Target]:
    """One tensor-parallel rank's storage of `cfg`, as vLLM holds it (fused qkv, stacked experts, the embedding and
    head vocab-parallel)."""
    h, hd, e, inter = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd // tp, cfg["num_key_value_heads"] * hd // tp
    vocab = -(-cfg["vocab_size"] // tp)
    t: dict[str, commit.Target] = {}
    for name, layout, _, shape in manifests.qwen3_moe_nvfp4_manifest(cfg):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = slice(tp_rank * vocab, min((tp_rank + 1) * vocab, shape[0]))
            t[name] = commit.Target(param=torch.empty((vocab, h), dtype=torch.bfloat16, device=device), rows=rows,
                                    shape=tuple(shape))
        elif layout == "dense":
            t[name] = commit.Target(param=torch.empty(shape, dtype=torch.bfloat16, device=device))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        qkv = layers.create_weight(q + 2 * kv, h, device=device)
        for i, (s, n) in enumerate((("q", q), ("k", kv), ("v", kv))):
            r0 = (0, q, q + kv)[i]
            rows = slice(tp_rank * n, (tp_rank + 1) * n)
            t[f"{p}.self_attn.{s}_proj"] = commit.Target(qkv, layers.Shard(
                f"{p}.self_attn.{s}_proj", (n * tp, h), slice(r0, r0 + n), src_rows=rows))
        t[f"{p}.self_attn.o_proj"] = commit.Target(layers.create_weight(h, q, device=device), layers.Shard(
            f"{p}.self_attn.o_proj", (h, q * tp), slice(0, h), src_cols=slice(tp_rank * q, (tp_rank + 1) * q)))
        w13 = layers.create_weight(2 * inter // tp, h, experts=e, device=device)
        w2 = layers.create_weight(h, inter // tp, experts=e, global_per_row=False, device=device)
        for x in range(e):
            for sid, sh in layers.expert_shards(f"{p}.mlp.experts", x, hidden=h, inter=inter // tp, tp_rank=tp_rank,
                                                tp_size=tp).items():
                t[sh.name] = commit.Target(w2 if sid == "w2" else w13, sh)
    return t


def _roof(group: broadcast.WeightGroup, nbytes: dict[int, int], device: torch.device) -> float:
    """One send of each sampler's bytes from the trainer (all at once), as the per-rank mode moves them."""
    if group.rank == 0:
        bufs = {r: torch.empty(n, dtype=torch.uint8, device=device) for r, n in nbytes.items()}
        return timed(str(device), lambda: [w.wait() for w in [group.send(b, r) for r, b in bufs.items()]])
    buf = torch.empty(nbytes[group.rank], dtype=torch.uint8, device=device)
    return timed(str(device), lambda: group.recv(buf, 0))


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    device = _device(rank, args.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = {**manifests.QWEN3_30B_A3B, "vocab_size": 512, "num_hidden_layers": args.layers,
           "num_experts": args.experts}
    manifest = [TensorEntry(name=n, layout=lay, dtype=d, shape=s) for n, lay, d, s in
                manifests.qwen3_moe_nvfp4_manifest(cfg)]
    group = broadcast.WeightGroup("127.0.0.1", port, rank, world, backend=args.backend)
    full = TransferPlan.build(manifest, bucket_bytes=args.bucket_mib << 20)
    config = SamplerConfig()
    if rank == 0:
        tensors = update_tensors(manifest, device)
        plans = broadcast.share_rank_plans(full, None, group)
        modes = {"broadcast": lambda: broadcast.send_update(full, tensors, group, device=device),
                 "per_rank": lambda: broadcast.send_rank_updates(plans, tensors, group, device=device)}
    else:
        targets = sampler_targets(cfg, rank - 1, world - 1, device)
        mine = broadcast.share_rank_plans(None, targets, group)
        modes = {"broadcast": lambda: broadcast.receive_update(full, targets, group, config=config, device=device),
                 "per_rank": lambda: broadcast.receive_rank_update(mine, targets, group, config=config,
                                                                   device=device)}
    nbytes = {r: n for d in group.all_gather_object({rank: mine.plan.nbytes} if rank else {}) for r, n in d.items()}
    result = {"rank": rank, "bytes": nbytes.get(rank, sum(nbytes.values())), "whole_bytes": full.nbytes}
    for mode, fn in modes.items():
        fn()                                                     # warm-up: NCCL communicators, allocations
        result[mode] = statistics.median(timed(str(device), fn) for _ in range(args.repeats))
    result["roof"] = statistics.median(_roof(group, nbytes, device) for _ in range(args.repeats))
    queue.put(result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="sampler ranks (one tensor-parallel engine), GPUs 1 .. tp")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--quick", action="store_true", help="CPU check: gloo, 2 samplers, 1 layer, 8 experts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.tp, args.layers, args.experts, args.backend, args.repeats, args.bucket_mib = 2, 1, 8, "gloo", 1, 4
    world = 1 + args.tp
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        raise SystemExit(f"{world} GPUs needed (trainer + {args.tp} samplers), {torch.cuda.device_count()} here")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a rank failed")
    device = torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu"
    print(f"device: {device} x {world}, backend {args.backend}, {args.layers} layers of Qwen3-30B-A3B, tp {args.tp}")
    print("| rank | bytes | broadcast s | per-rank s | roof s | per-rank / broadcast | roof / per-rank |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        print(f"| {r['rank']} | {r['bytes'] / 1e9:.3f} GB | {r['broadcast']:.4f} | {r['per_rank']:.4f} | "
              f"{r['roof']:.4f} | {r['per_rank'] / r['broadcast']:.2f}x | {r['roof'] / r['per_rank']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "ranks": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
