"""Planned NVFP4 buckets through `torch.distributed` (issue #20 item 4): trainer and sampler on
different GPUs (NCCL) or processes (gloo on CPU), any number of ranks.

Two ways, one verdict:
  * broadcast (`share_plan`, `send_update`, `receive_update`): every rank of `group` builds the same
    `TransferPlan` (the source rank broadcasts the manifest and bucket size once) and receives every
    bucket through one reused flat buffer; a tensor-parallel rank writes only its shard of each.
  * per rank (`share_rank_plans`, `send_rank_updates`, `receive_rank_update`): each sampler rank
    tells the source once what it holds (`commit.held_regions`: its rows and K range of every NVFP4
    tensor, which names at all), and both ends build that rank's plan from the manifest cut to it
    (`TransferPlan.for_rank`; the plan ids are compared once). Per update the source packs each rank's
    slices (`plan.RankTensors`, no copy until the pack) into a buffer of that rank's and sends it
    point to point: a rank receives only its shard (1/tp of the experts, plus the tensors it holds
    whole) and writes it as whole storage (`commit.local_targets`: the fused entries' batched copies).
Every sampler rank validates what it received (one pass per value class into a device flag) and
checks the whole update against its own engine (`commit.apply_fused(check_only=True)`); the
verdicts are all-reduced (MAX), and only if every rank and every bucket is good does each rank
write. One bad bucket or one refusing rank leaves every rank's old weights.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from nvfp4_sampler.sampler_plugin import commit

from .plan import RankTensors, TransferPlan


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
    return _receive(plan, targets, lambda buf: dist.broadcast(buf, src=src, group=group), config=config,
                    group=group, device=device)


class RankPlan(NamedTuple):
    """One sampler rank's plan and what it was cut by (`commit.held_regions`)."""

    plan: TransferPlan
    held: dict[str, commit.Region | None]


def share_rank_plans(plan: TransferPlan | None, targets: Mapping[str, commit.Target] | None = None, *, src: int = 0,
                     group=None) -> dict[int, RankPlan] | RankPlan:
    """Once per run, on every rank of `group`: the source passes its full plan, each sampler rank its
    engine's `targets`. Returns on the source {sampler global rank: RankPlan}, on a sampler its own
    RankPlan. Raises ValueError on every rank, before any update, when a manifest tensor is held by no
    sampler rank, a rank holds part of a tensor sent dense (`plan.rank_manifest`), or two ends built
    different plans (different package versions)."""
    plan = share_plan(plan, src=src, group=group)
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    held = [None] * len(ranks)
    dist.all_gather_object(held, None if me == src else commit.held_regions(targets), group=group)
    holdings = {r: h for r, h in zip(ranks, held) if r != src}
    unheld = next((e.name for e in plan.manifest if not any(e.name in h for h in holdings.values())), None)
    if unheld is not None:
        raise ValueError(f"{unheld}: no sampler rank holds this tensor (not in any engine's model)")
    mine = {r: RankPlan(plan.for_rank(h), h) for r, h in holdings.items() if me in (src, r)}
    ids = [None] * len(ranks)
    dist.all_gather_object(ids, {r: p.plan.plan_id for r, p in mine.items()}, group=group)
    source = ids[ranks.index(src)]
    if any(source[r] != i[r] for r, i in zip(ranks, ids) if r != src):
        raise ValueError("the trainer and a sampler rank built different per-rank plans from one manifest "
                         "(different nvfp4_sampler versions?)")
    return mine if me == src else mine[me]


def send_rank_updates(plans: Mapping[int, RankPlan], tensors: Mapping[str, torch.Tensor], *, src: int = 0,
                      group=None, device: torch.device | str = "cpu") -> bool:
    """Source rank: send each sampler rank the buckets of its plan (`share_rank_plans`), its slices of
    the checkpoint-named `tensors` packed into one reused buffer per rank, point to point, bucket b to
    every rank before bucket b + 1; then take part in the verdict. Returns whether the update was
    applied everywhere."""
    bufs = {r: p.plan.new_buffer(device=device) for r, p in plans.items()}
    cut = {r: RankTensors(tensors, p.held) for r, p in plans.items()}
    for b in range(max((len(p.plan.buckets) for p in plans.values()), default=0)):
        sends = []
        for r, p in plans.items():
            if b < len(p.plan.buckets):
                p.plan.pack(b, cut[r], bufs[r])
                sends.append(dist.isend(bufs[r][:p.plan.buckets[b].nbytes], dst=r, group=group))
        for w in sends:
            w.wait()
    return _verdict(torch.zeros((), dtype=torch.int32, device=device), group)


def receive_rank_update(plan: RankPlan, targets: Mapping[str, commit.Target], *, config, src: int = 0, group=None,
                        device: torch.device | str = "cpu") -> list[str]:
    """Sampler rank: `receive_update` for a per-rank plan: only this rank's slices arrive, written into
    `targets` (the engine's, as given to `share_rank_plans`) as whole storage of this rank."""
    return _receive(plan.plan, commit.local_targets(targets), lambda buf: dist.recv(buf, src=src, group=group),
                    config=config, group=group, device=device)


def _receive(plan: TransferPlan, targets: Mapping[str, commit.Target], fetch: Callable[[torch.Tensor], object], *,
             config, group, device) -> list[str]:
    """Fetch every bucket (`fetch(buffer)` fills it), validate, agree with the other ranks, write or raise."""
    flag = torch.zeros((), dtype=torch.bool, device=device)
    bufs = []
    for b, bk in enumerate(plan.buckets):
        buf = torch.empty(bk.nbytes, dtype=torch.uint8, device=device)
        fetch(buf)
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
