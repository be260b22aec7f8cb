"""Planned NVFP4 buckets between processes or GPUs (issue #20 item 4): trainer and sampler ranks
in a `WeightGroup` of their own (NCCL between GPUs, gloo on CPU), any number of ranks, the trainer
rank 0 by default.

Two ways, one verdict:
  * broadcast (`share_plan`, `send_update`, `receive_update`): every rank builds the same
    `TransferPlan` (the source broadcasts the manifest and bucket size once) and receives every
    bucket; a tensor-parallel rank writes only its shard of each.
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
write. One bad bucket or one refusing rank leaves every rank's old weights (so a rank holds its
received buckets until the verdict). The source packs into two buffers a destination, one bucket's
pack overlapping the transfer of the one before. vLLM workers take part through
`BroadcastWorkerExtension`.
"""
from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from nvfp4_sampler.sampler_plugin import commit
from nvfp4_sampler.sampler_plugin.vllm.worker_extension import NVFP4SamplerWorkerExtension

from .plan import RankTensors, TransferPlan


class WeightGroup:
    """The trainer's and the sampler ranks' own process group for weight updates, apart from any
    torch.distributed world (an engine's workers already have one): a TCPStore rendezvous at host:port
    (rank 0, the trainer, hosts it), a gloo (CPU tensors) or NCCL (CUDA tensors) backend used directly,
    small objects (the manifest, what each rank holds) through the store. Every method is collective
    over the group but `send` / `recv`. Ranks are this group's: 0 .. size - 1."""

    def __init__(self, host: str, port: int, rank: int, size: int, *, backend: str = "nccl",
                 timeout_s: float = 600.0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a weight group of {size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise ValueError("backend 'nccl': this torch build has no NCCL; 'gloo' moves CPU tensors")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.backend = rank, size, backend
        self.store = dist.PrefixStore("nvfp4_sampler_weights", dist.TCPStore(host, port, size, rank == 0,
                                                                             timeout=timeout))
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(self.store, rank, size, options)
        self._calls = 0

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Start broadcasting `tensor` from rank src; returns the work to wait for before the tensor is
        read (a receiver) or reused (the source)."""
        return self._pg.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int):
        """Start sending `tensor` to rank dst; returns the work to wait for before the tensor is reused."""
        return self._pg.send([tensor], dst, 0)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive `tensor` from rank src (filled once this returns, in stream order under NCCL)."""
        self._pg.recv([tensor], src, 0).wait()

    def any(self, flag: torch.Tensor) -> bool:
        """Whether any rank's int32 scalar `flag` is non-zero (all-reduce MAX, in place)."""
        self._pg.allreduce([flag], dist.ReduceOp.MAX).wait()
        return bool(flag)

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (picklable), by rank."""
        key = self._next_key()
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.size)]

    def broadcast_object(self, obj, src: int):
        """Rank src's `obj` on every rank."""
        key = self._next_key()
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def _next_key(self) -> str:
        self._calls += 1                          # collective calls come in the same order on every rank
        return f"object/{self._calls}"


def share_plan(plan: TransferPlan | None, group: WeightGroup, *, src: int = 0) -> TransferPlan:
    """The source's plan on every rank (its manifest and bucket size travel once, as an object)."""
    d = group.broadcast_object(plan.to_dict() if plan is not None else None, src)
    return plan if plan is not None else TransferPlan.from_dict(d)


def send_update(plan: TransferPlan, tensors: Mapping[str, torch.Tensor], group: WeightGroup, *, src: int = 0,
                device: torch.device | str = "cpu") -> bool:
    """Source rank: broadcast every bucket of `tensors` (checkpoint-named, as `plan.pack` takes
    them) through two reused buffers on `device` (`_double_buffered`), then take part in the verdict.
    Returns whether the update was applied everywhere."""
    flats = [plan.new_buffer(device=device) for _ in range(2)]

    def start(b: int, slot: int) -> list:
        plan.pack(b, tensors, flats[slot])
        return [group.broadcast(flats[slot][:plan.buckets[b].nbytes], src)]
    _double_buffered(len(plan.buckets), start)
    return not group.any(torch.zeros((), dtype=torch.int32, device=device))


def _double_buffered(n: int, start: Callable[[int, int], list]) -> None:
    """Bucket b = 0 .. n - 1: `start(b, slot)` packs it into buffer `slot` (b % 2) and starts its
    transfers, returning their works; they are waited for after bucket b + 1 is packed and started,
    before slot b % 2 is packed again, so the pack of one bucket overlaps the transfer of the one
    before (twice one bucket's buffer memory a destination)."""
    pending: list = []
    for b in range(n):
        works = start(b, b % 2)
        for w in pending:
            w.wait()
        pending = works
    for w in pending:
        w.wait()


def receive_update(plan: TransferPlan, targets: Mapping[str, commit.Target], group: WeightGroup, *, config,
                   src: int = 0, device: torch.device | str = "cpu") -> list[str]:
    """Sampler rank: receive every bucket, validate, agree with the other ranks, then write (all
    ranks or none). Returns the names written; raises ValueError (on every rank) if any bucket or
    any rank's check failed, with nothing written anywhere."""
    return _receive(plan, targets, lambda buf: group.broadcast(buf, src).wait(), group, config=config, device=device)


class RankPlan(NamedTuple):
    """One sampler rank's plan and what it was cut by (`commit.held_regions`)."""

    plan: TransferPlan
    held: dict[str, commit.Region | None]


def share_rank_plans(plan: TransferPlan | None, targets: Mapping[str, commit.Target] | None, group: WeightGroup, *,
                     src: int = 0) -> dict[int, RankPlan] | RankPlan:
    """Once per run, on every rank of `group`: the source passes its full plan, each sampler rank its
    engine's `targets`. Returns on the source {sampler rank: RankPlan}, on a sampler its own
    RankPlan. Raises ValueError on every rank, before any update, when a manifest tensor is held by no
    sampler rank, a rank holds part of a tensor sent dense (`plan.rank_manifest`), or two ends built
    different plans (different package versions)."""
    plan = share_plan(plan, group, src=src)
    me = group.rank
    held = group.all_gather_object(None if me == src else commit.held_regions(targets))
    holdings = {r: h for r, h in enumerate(held) if r != src}
    unheld = next((e.name for e in plan.manifest if not any(e.name in h for h in holdings.values())), None)
    if unheld is not None:
        raise ValueError(f"{unheld}: no sampler rank holds this tensor (not in any engine's model)")
    mine = {r: RankPlan(plan.for_rank(h), h) for r, h in holdings.items() if me in (src, r)}
    ids = group.all_gather_object({r: p.plan.plan_id for r, p in mine.items()})
    if any(ids[src][r] != i[r] for r, i in enumerate(ids) if r != src):
        raise ValueError("the trainer and a sampler rank built different per-rank plans from one manifest "
                         "(different nvfp4_sampler versions?)")
    return mine if me == src else mine[me]


def send_rank_updates(plans: Mapping[int, RankPlan], tensors: Mapping[str, torch.Tensor], group: WeightGroup, *,
                      device: torch.device | str = "cpu") -> bool:
    """Source rank: send each sampler rank the buckets of its plan (`share_rank_plans`), its slices of
    the checkpoint-named `tensors` packed into two reused buffers per rank (`_double_buffered`), point
    to point, bucket b to every rank before bucket b + 1; then take part in the verdict. Returns
    whether the update was applied everywhere."""
    bufs = {r: [p.plan.new_buffer(device=device) for _ in range(2)] for r, p in plans.items()}
    cut = {r: RankTensors(tensors, p.held) for r, p in plans.items()}

    def start(b: int, slot: int) -> list:
        sends = []
        for r, p in plans.items():
            if b < len(p.plan.buckets):
                p.plan.pack(b, cut[r], bufs[r][slot])
                sends.append(group.send(bufs[r][slot][:p.plan.buckets[b].nbytes], r))
        return sends
    _double_buffered(max((len(p.plan.buckets) for p in plans.values()), default=0), start)
    return not group.any(torch.zeros((), dtype=torch.int32, device=device))


def receive_rank_update(plan: RankPlan, targets: Mapping[str, commit.Target], group: WeightGroup, *, config,
                        src: int = 0, device: torch.device | str = "cpu") -> list[str]:
    """Sampler rank: `receive_update` for a per-rank plan: only this rank's slices arrive, written into
    `targets` (the engine's, as given to `share_rank_plans`) as whole storage of this rank."""
    return _receive(plan.plan, commit.local_targets(targets), lambda buf: group.recv(buf, src), group, config=config,
                    device=device)


def _receive(plan: TransferPlan, targets: Mapping[str, commit.Target], fetch: Callable[[torch.Tensor], object],
             group: WeightGroup, *, config, device) -> list[str]:
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
    if group.any(torch.tensor(int(problem is not None), dtype=torch.int32, device=device)):
        raise ValueError(problem or "another rank refused the update; nothing written")
    return commit.apply_fused(targets, entries, config=config)


class BroadcastWorkerExtension(NVFP4SamplerWorkerExtension):
    """vLLM's worker extension (`worker_extension_cls="nvfp4_sampler.server.broadcast.BroadcastWorkerExtension"`):
    `NVFP4SamplerWorkerExtension`'s methods plus per-rank updates from a trainer on other GPUs or in another
    process, through a `WeightGroup` whose rank 0 is the trainer:

      llm.collective_rpc("nvfp4_join_weight_group", args=(host, port, 1, 1 + workers, "nccl"))   # worker i: rank 1 + i
      llm.collective_rpc("nvfp4_share_rank_plans")                   # once per run
      llm.collective_rpc("nvfp4_receive_rank_update", args=(version,))   # each update

    with the trainer's `WeightGroup(host, port, 0, 1 + workers)`, `share_rank_plans(plan, None, group)` and
    `send_rank_updates(plans, tensors, group)` beside each call (they meet: run one side in a thread or
    process of its own). A refused update raises on every worker and leaves every rank's old weights."""

    def nvfp4_join_weight_group(self, host: str, port: int, rank_offset: int, size: int, backend: str = "nccl",
                                timeout_s: float = 600.0) -> int:
        """Join the trainer's weight group as rank rank_offset + this worker's rank; returns that rank."""
        self._nvfp4_group = WeightGroup(host, port, rank_offset + self.rank, size, backend=backend,
                                        timeout_s=timeout_s)
        return self._nvfp4_group.rank

    def nvfp4_share_rank_plans(self) -> dict:
        """This worker's side of `share_rank_plans`: {"rank", "entries", "buckets", "bytes"} of its plan."""
        self._nvfp4_rank_plan = share_rank_plans(None, self._nvfp4_targets(), self._group())
        plan = self._nvfp4_rank_plan.plan
        return {"rank": self._nvfp4_group.rank, "entries": len(plan.entries), "buckets": len(plan.buckets),
                "bytes": plan.nbytes}

    def nvfp4_receive_rank_update(self, version: int | str) -> dict:
        """Receive this worker's shard of an update (`receive_rank_update`: on the worker's device over NCCL, in
        host memory over gloo) and set the weight version; the report of `nvfp4_apply_update` with "bytes" this
        worker received."""
        group, plan = self._group(), getattr(self, "_nvfp4_rank_plan", None)
        if plan is None:
            raise ValueError("nvfp4_sampler: nvfp4_receive_rank_update before nvfp4_share_rank_plans")
        device = "cpu" if group.backend == "gloo" else self.device
        report = self._nvfp4_write(lambda targets, config: receive_rank_update(
            plan, targets, group, config=config, device=device), version, time.perf_counter())
        return {**report, "bytes": plan.plan.nbytes}

    def _group(self) -> WeightGroup:
        group = getattr(self, "_nvfp4_group", None)
        if group is None:
            raise ValueError("nvfp4_sampler: no weight group: call nvfp4_join_weight_group first")
        return group
