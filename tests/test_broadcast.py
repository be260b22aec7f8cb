"""Planned NVFP4 buckets through a `server.broadcast.WeightGroup` on CPU with gloo: rank 0 is
the trainer, ranks 1.. are samplers (a tensor-parallel pair with its own shards of the experts).
Broadcast and per-rank plans (each rank sent only its shard, point to point): the result equals the
direct apply bitwise; a corrupted bucket leaves every rank's old weights; a tensor no rank holds is
refused on every rank before any update."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from nvfp4_sampler.sampler_plugin import commit
from nvfp4_sampler.server import broadcast
from nvfp4_sampler.server.plan import TransferPlan
from nvfp4_sampler.server.process import free_port
from nvfp4_sampler.server.wire import iter_entries
from tests.test_fused_update import CFG, engine_targets, state
from tests.test_plan import moe_update


BAD = "model.layers.1.mlp.experts.2.down_proj.weight_scale"   # its first block: tensor-parallel rank 0's K range


def _on(targets: dict[str, commit.Target], device: torch.device) -> dict[str, commit.Target]:
    """The targets with their storage on `device` (shared storage stays shared)."""
    moved = {}

    def weight(w):
        return moved.setdefault(id(w), w.to(device)) if w is not None else None
    return {n: dataclasses.replace(t, weight=weight(t.weight), param=None if t.param is None else t.param.to(device))
            for n, t in targets.items()}


def _run(rank: int, world: int, port: int, out: str, per_rank: bool, backend: str = "gloo") -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = broadcast.WeightGroup("127.0.0.1", port, rank, world, backend=backend)
    good, bad = moe_update(seed=1), moe_update(seed=2)
    bad[BAD] = bad[BAD].clone()
    bad[BAD].view(torch.uint8)[0, 0] = 0x7F
    good, bad = ({n: t.to(device) for n, t in u.items()} for u in (good, bad))
    targets = None if rank == 0 else _on(engine_targets(tp=(rank - 1, world - 1)), device)
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
    receive(plan, targets, group, config=CFG, device=device)
    after_good = state(targets)
    try:
        receive(plan, targets, group, config=CFG, device=device)
        raise AssertionError("a corrupted bucket was applied")
    except ValueError as e:                  # per rank, the second rank never sees the bad block
        assert (BAD if rank == 1 or not per_rank else "another rank refused") in str(e), e
    ref = _on(engine_targets(tp=(rank - 1, world - 1)), device)
    commit.apply_update(ref, good, config=CFG)
    cpu = {k: {n: t.cpu() for n, t in v.items()} for k, v in (("good", after_good), ("bad", state(targets)),
                                                               ("ref", state(ref)))}
    torch.save({**cpu, "whole": full.nbytes,
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
    mp.spawn(_run, args=(world, free_port(), str(tmp_path), False), nprocs=world, join=True)
    for r in _check_ranks(tmp_path, world):
        assert r["received"] == r["whole"]


def test_per_rank_updates_send_each_tensor_parallel_rank_its_shard(tmp_path):
    world = 3
    mp.spawn(_run, args=(world, free_port(), str(tmp_path), True), nprocs=world, join=True)
    for r in _check_ranks(tmp_path, world):
        assert r["received"] < r["whole"], (r["received"], r["whole"])    # experts: half each (test_fused_update)


def test_senders_pack_a_bucket_while_the_one_before_is_in_flight():
    """The senders' schedule (`_double_buffered`): bucket b is packed into slot b % 2 while bucket b - 1's
    transfers are still open, and a slot is packed again only after its previous bucket's transfers were
    waited for; every transfer is waited for before the call returns."""
    log, open_ = [], set()

    class Work:
        def __init__(self, b):
            self.b = b

        def wait(self):
            open_.discard(self.b)
            log.append(("wait", self.b))

    def start(b, slot):
        assert slot == b % 2 and b - 2 not in open_, (b, open_)      # the slot's last bucket is done
        log.append(("start", b, b - 1 in open_))
        open_.add(b)
        return [Work(b)]
    broadcast._double_buffered(5, start)
    assert not open_
    assert [e for e in log if e[0] == "start"] == [("start", 0, False)] + [("start", b, True) for b in range(1, 5)]


def test_weight_group_refuses_what_it_cannot_run():
    for kwargs, message in (({"rank": 2, "size": 2}, "rank 2 is not in a weight group of 2"),
                            ({"backend": "mpi"}, "backend must be 'gloo' or 'nccl'"),
                            ({"backend": "nccl"}, "this torch build has no NCCL")):
        if kwargs.get("backend") == "nccl" and torch.distributed.is_nccl_available():
            continue
        with pytest.raises(ValueError, match=message):
            broadcast.WeightGroup("127.0.0.1", free_port(), **{"rank": 0, "size": 2, **kwargs})


@pytest.mark.gpu
@pytest.mark.parametrize("per_rank", [False, True], ids=["broadcast", "per-rank"])
def test_nccl_updates_between_gpus(tmp_path, per_rank):
    """The same over NCCL, a rank a GPU: the trainer and a sampler (two GPUs), or two tensor-parallel samplers
    (three or more). `pytest -m gpu tests/test_broadcast.py` on a multi-GPU machine."""
    world = min(torch.cuda.device_count(), 3)
    if world < 2:
        pytest.skip("needs two GPUs or more")
    mp.spawn(_run, args=(world, free_port(), str(tmp_path), per_rank, "nccl"), nprocs=world, join=True)
    _check_ranks(tmp_path, world)
