"""Planned NVFP4 buckets through a `server.broadcast.WeightGroup` on CPU with gloo: rank 0 is
the trainer, ranks 1.. are samplers (a tensor-parallel pair with its own shards of the experts).
Broadcast and per-rank plans (each rank sent only its shard, point to point): the result equals the
direct apply bitwise; a corrupted bucket leaves every rank's old weights; a tensor no rank holds is
refused on every rank before any update."""
from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from nvfp4_sampler.sampler_plugin import commit
from nvfp4_sampler.server import broadcast
from nvfp4_sampler.server.plan import TransferPlan
from nvfp4_sampler.server.wire import iter_entries
from tests.test_fused_update import CFG, engine_targets, state
from tests.test_plan import moe_update


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = "model.layers.1.mlp.experts.2.down_proj.weight_scale"   # its first block: tensor-parallel rank 0's K range


def _run(rank: int, world: int, port: int, out: str, per_rank: bool) -> None:
    group = broadcast.WeightGroup("127.0.0.1", port, rank, world, backend="gloo")
    good, bad = moe_update(seed=1), moe_update(seed=2)
    bad[BAD] = bad[BAD].clone()
    bad[BAD].view(torch.uint8)[0, 0] = 0x7F
    targets = None if rank == 0 else engine_targets(tp=(rank - 1, world - 1))
    full = TransferPlan.build(iter_entries(good), bucket_bytes=1 << 14)
    if per_rank:
        stray = {**good, "model.layers.1.mlp.stray.weight": torch.ones(4)}
        try:
            broadcast.share_rank_plans(TransferPlan.build(iter_entries(stray)) if rank == 0 else None, targets,
                                       group)
            raise AssertionError("a tensor no rank holds was planned")
        except ValueError as e:
            assert "model.layers.1.mlp.stray.weight: no sampler rank holds" in str(e), e
        plan = broadcast.share_rank_plans(full if rank == 0 else None, targets, group)
        send, receive = broadcast.send_rank_updates, broadcast.receive_rank_update
    else:
        plan = broadcast.share_plan(full if rank == 0 else None, group)
        send, receive = broadcast.send_update, broadcast.receive_update
    if rank == 0:
        assert not per_rank or sorted(plan) == list(range(1, world))
        assert send(plan, good, group)
        assert not send(plan, bad, group)
        return
    receive(plan, targets, group, config=CFG)
    after_good = state(targets)
    try:
        receive(plan, targets, group, config=CFG)
        raise AssertionError("a corrupted bucket was applied")
    except ValueError as e:                  # per rank, the second rank never sees the bad block
        assert (BAD if rank == 1 or not per_rank else "another rank refused") in str(e), e
    ref = engine_targets(tp=(rank - 1, world - 1))
    commit.apply_update(ref, good, config=CFG)
    torch.save({"good": after_good, "bad": state(targets), "ref": state(ref), "whole": full.nbytes,
                "received": (plan.plan if per_rank else plan).nbytes}, f"{out}/rank{rank}.pt")


def _check_ranks(out, world: int) -> list[dict]:
    results = [torch.load(out / f"rank{rank}.pt") for rank in range(1, world)]
    for rank, r in enumerate(results, 1):
        for k in r["ref"]:
            assert torch.equal(r["good"][k], r["ref"][k]), (rank, k)
            assert torch.equal(r["bad"][k], r["ref"][k]), (rank, k)
    return results


def test_broadcast_to_tensor_parallel_samplers(tmp_path):
    world = 3
    mp.spawn(_run, args=(world, _free_port(), str(tmp_path), False), nprocs=world, join=True)
    for r in _check_ranks(tmp_path, world):
        assert r["received"] == r["whole"]


def test_per_rank_updates_send_each_tensor_parallel_rank_its_shard(tmp_path):
    world = 3
    mp.spawn(_run, args=(world, _free_port(), str(tmp_path), True), nprocs=world, join=True)
    for r in _check_ranks(tmp_path, world):
        assert r["received"] < r["whole"], (r["received"], r["whole"])    # experts: half each (test_fused_update)
