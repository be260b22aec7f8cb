"""Planned NVFP4 buckets through `torch.distributed` (issue #20 item 4): trainer and sampler on
different GPUs (NCCL) or processes (gloo on CPU), any number of ranks.

Every rank of `group` builds the same `TransferPlan` (the source rank broadcasts the manifest and
bucket size once: `share_plan`). Per update, the source packs each plan bucket into one reused flat
buffer and broadcasts it; every sampler rank validates it (one pass per value class into a device
flag) and keeps it. Then the ranks agree before anyone writes: each checks the whole update against
its own engine (`commit.apply_fused(check_only=True)` over its `reload_targets`: a tensor-parallel
rank's shards take their rows and K range of each checkpoint tensor), the verdicts are all-reduced
(MAX), and only if every rank and every bucket is good does each rank write. One bad bucket or one
refusing rank leaves every rank's old weights.

Each sampler rank receives whole buckets and writes only its shard; sending each rank only its
shard (a per-rank plan from the shard geometry, scatter instead of broadcast) is left open.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from nvfp4_sampler.sampler_plugin import commit

from .plan import TransferPlan


def share_plan(plan: TransferPlan | None, *, src: int = 0, group=None) -> TransferPlan:
    """The source's plan on every rank (its manifest and bucket size travel once, as an object)."""
    box = [plan.to_dict() if plan is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return plan if plan is not None else TransferPlan.from_dict(box[0])


def send_update(plan: TransferPlan, tensors: Mapping[str, torch.Tensor], *, src: int = 0, group=None,
                device: torch.device | str = "cpu") -> bool:
    """Source rank: broadcast every bucket of `tensors` (checkpoint-named, as `plan.pack` takes
    them) through one reused buffer on `device`, then take part in the verdict. Returns whether the
    update was applied everywhere."""
    flat = plan.new_buffer(device=device)
    for b, bk in enumerate(plan.buckets):
        plan.pack(b, tensors, flat)
        dist.broadcast(flat[:bk.nbytes], src=src, group=group)
    return _verdict(torch.zeros((), dtype=torch.int32, device=device), group)


def receive_update(plan: TransferPlan, targets: Mapping[str, commit.Target], *, config, src: int = 0,
                   group=None, device: torch.device | str = "cpu") -> list[str]:
    """Sampler rank: receive every bucket, validate, agree with the other ranks, then write (all
    ranks or none). Returns the names written; raises ValueError (on every rank) if any bucket or
    any rank's check failed, with nothing written anywhere."""
    flag = torch.zeros((), dtype=torch.bool, device=device)
    bufs = []
    for b, bk in enumerate(plan.buckets):
        buf = torch.empty(bk.nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=src, group=group)
        plan.validate(b, buf, flag)
        bufs.append(buf)
    problem = None
    entries = []
    if bool(flag):
        problem = next(m for b, buf in enumerate(bufs) if (m := plan.find_invalid(b, buf)))
    else:
        entries = [e for b, buf in enumerate(bufs) for e in plan.fused_entries(b, buf)]
        try:
            commit.apply_fused(targets, entries, config=config, check_only=True)
        except ValueError as e:
            problem = str(e)
    bad = torch.tensor(int(problem is not None), dtype=torch.int32, device=device)
    if not _verdict(bad, group):
        raise ValueError(problem or "another rank refused the update; nothing written")
    return commit.apply_fused(targets, entries, config=config)


def _verdict(bad: torch.Tensor, group) -> bool:
    """All-reduce (MAX) of every rank's refusal: True when no rank refused."""
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad)
