"""Planned NVFP4 buckets through torch.distributed (`server.broadcast`) on CPU with gloo: rank 0 is
the trainer, ranks 1.. are samplers (a tensor-parallel pair with its own shards of the experts).
Broadcast and per-rank plans (each rank sent only its shard, point to point): the result equals the
direct apply bitwise; a corrupted bucket leaves every rank's old weights; a tensor no rank holds is
refused on every rank before any update."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
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


def _run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        samplers = world - 1
        tp = (rank - 1, samplers)
        good, bad = moe_update(seed=1), moe_update(seed=2)
        x = bad["model.layers.1.mlp.experts.2.down_proj.weight_scale"].clone()
        x.view(torch.uint8).view(-1)[0] = 0x7F
        bad["model.layers.1.mlp.experts.2.down_proj.weight_scale"] = x
        plan = broadcast.share_plan(TransferPlan.build(iter_entries(good), bucket_bytes=1 << 14)
                                    if rank == 0 else None)
        if rank == 0:
            assert broadcast.send_update(plan, good)
            assert not broadcast.send_update(plan, bad)
            return
        targets = engine_targets(tp=tp)
        broadcast.receive_update(plan, targets, config=CFG)
        after_good = state(targets)
        try:
            broadcast.receive_update(plan, targets, config=CFG)
            raise AssertionError("a corrupted bucket was applied")
        except ValueError as e:
            assert "experts.2.down_proj.weight_scale" in str(e), e
        after_bad = state(targets)
        ref = engine_targets(tp=tp)
        commit.apply_update(ref, good, config=CFG)
        torch.save({"good": after_good, "bad": after_bad, "ref": state(ref)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_per_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tp = (rank - 1, world - 1)
        good, bad = moe_update(seed=1), moe_update(seed=2)
        name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"    # rank 1's K range holds its first block
        bad[name] = bad[name].clone()
        bad[name].view(torch.uint8)[0, 0] = 0x7F
        stray = {**good, "model.layers.1.mlp.stray.weight": torch.ones(4)}
        targets = None if rank == 0 else engine_targets(tp=tp)
        full = TransferPlan.build(iter_entries(good), bucket_bytes=1 << 14)
        try:
            broadcast.share_rank_plans(TransferPlan.build(iter_entries(stray)) if rank == 0 else None, targets)
            raise AssertionError("a tensor no rank holds was planned")
        except ValueError as e:
            assert "model.layers.1.mlp.stray.weight: no sampler rank holds" in str(e), e
        plans = broadcast.share_rank_plans(full if rank == 0 else None, targets)
        if rank == 0:
            assert sorted(plans) == list(range(1, world))
            assert broadcast.send_rank_updates(plans, good)
            assert not broadcast.send_rank_updates(plans, bad)
            return
        received = plans.plan.nbytes
        broadcast.receive_rank_update(plans, targets, config=CFG)
        after_good = state(targets)
        try:
            broadcast.receive_rank_update(plans, targets, config=CFG)
            raise AssertionError("a corrupted bucket was applied")
        except ValueError as e:
            assert (name if rank == 1 else "another rank refused") in str(e), e
        ref = engine_targets(tp=tp)
        commit.apply_update(ref, good, config=CFG)
        torch.save({"good": after_good, "bad": state(targets), "ref": state(ref), "received": received,
                    "whole": full.nbytes}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _check_ranks(out, world: int) -> list[dict]:
    results = [torch.load(out / f"rank{rank}.pt") for rank in range(1, world)]
    for rank, r in enumerate(results, 1):
        for k in r["ref"]:
            assert torch.equal(r["good"][k], r["ref"][k]), (rank, k)
            assert torch.equal(r["bad"][k], r["ref"][k]), (rank, k)
    return results


def test_broadcast_to_tensor_parallel_samplers(tmp_path):
    world = 3
    mp.spawn(_run, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    _check_ranks(tmp_path, world)


def test_per_rank_updates_send_each_tensor_parallel_rank_its_shard(tmp_path):
    world = 3
    mp.spawn(_run_per_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for r in _check_ranks(tmp_path, world):
        assert r["received"] < r["whole"], (r["received"], r["whole"])    # experts: half each (test_fused_update)
