"""The trainer side of a planned update: every bucket quantized straight into a reusable send buffer.

    sender = PlannedSender.of(state, config=cfg)     # once per run: plan (sender.plan) and jobs
    st = sender.push(client, update_id, buffers)     # fill + send every bucket, double-buffered

`PlannedSender` maps each entry of a `TransferPlan` to the trainer's source tensors once (through
`converters.name_map`): a fused expert tensor [E, P*R, K] that fills a stacked entry row for row is
quantized in one call into the entry's parts ([E*P, R, K] matrices, one decode scale each, as the
converter quantizes it); per-expert source tensors (a checkpoint's `experts.{e}.gate_proj`, ...) that
together fill a stacked entry are stacked on the device in chunks of at most STACK_BYTES and each chunk
quantized the same way (a few launches per entry instead of several per expert); any other member
(q / k / v of a fused qkv) in one launch into its rows; a dense tensor is one copy. Everything lands
at the plan's offsets of the send buffer (`TransferPlan.fused_views`): there is no pack step. Each call
computes its amax itself (`dispatch.quantize_weight_into` without an amax: max|w| per expert, or per
expert's parts with one shared scale, by a reduction before the quantizer); NaN/Inf in a
quantized source show in that amax, checked on the device per bucket (a flag copied to pinned host memory,
no host sync per entry); the sidecar's validation of the bucket checks what is sent.

`push` keeps two (or more) send buffers: bucket b is converted on the current stream while bucket
b-1 is sent from a thread, which waits only for b-1's event (one host sync per bucket) and posts the
handle; a buffer is reused once the sidecar answered (its copy is done). A flagged bucket is never
sent: the update is aborted and the serving version stays as it was.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping

import torch

from nvfp4_sampler.converters import name_map
from nvfp4_sampler.kernels import dispatch, reference
from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_format import fused_group

from nvfp4_sampler.converters.convert import ConvertOptions

from . import push as push_pipeline
from .client import SidecarError
from .plan import TransferPlan
from .protocol import UpdateStatus


STACK_BYTES = 256 << 20    # per-expert sources stacked per launch (a transient copy of this size)


class InvalidSource(ValueError):
    """A source tensor holds NaN or Inf: nothing of the update was committed."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One write into a bucket: source tensor `source` (value[index] when index is set, reshaped to
    [-1, split, K] matrices when split is set) into entry `entry`'s parts at `rows` (codes, block
    scales or the dense tensor) and `scale` (decode scales); () selects the whole part.
    shared_group_scale: `share` parts per expert of a split tensor share one amax; `group` names the
    checkpoint tensors of a member's fused group, whose amax it shares. stack: per-expert source names
    in (expert, part) order, stacked into the [experts * parts, R, K] value (then `source` is the first)."""

    source: str
    index: tuple | None
    entry: int
    rows: tuple
    scale: tuple
    split: int | None = None
    share: int = 1
    group: tuple[str, ...] | None = None
    stack: tuple[str, ...] | None = None


@dataclasses.dataclass
class Ready:
    """A filled bucket: its event (CUDA; None on the CPU) and flag slot in pinned host memory."""

    event: torch.cuda.Event | None
    flag: torch.Tensor

    def wait(self) -> bool:
        """Wait for the bucket's kernels (one host sync on CUDA); True if a source was not finite."""
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)


class PlannedSender:
    """Writes the plan's buckets from a trainer's state dict (`tensors`: float tensors by their
    learner names, on their device) into send buffers, converted under `options` (recipe, shared
    group scale, backend: those of `push.plan`); config: the model's HF config dict."""

    def __init__(self, plan: TransferPlan, tensors: Mapping[str, torch.Tensor], options: ConvertOptions, *,
                 config: dict):
        self.plan, self.tensors, self.options = plan, tensors, options
        tied = bool(config.get("tie_word_embeddings"))
        where = {}                                       # checkpoint name -> (entry index, member)
        for i, e in enumerate(plan.entries):
            for m in e.members:
                where[m.entry.name] = (i, m)
        self.jobs: list[list[Job]] = [[] for _ in plan.buckets]
        done = set()
        for name, value in self.tensors.items():
            maps = name_map.expand(name, tuple(value.shape), tied_embeddings=tied)
            for job in self._jobs(name, value, maps, where):
                self.jobs[plan.entries[job.entry].bucket].append(job)
            done.update(m.name for m in maps)
        missing = where.keys() - done
        if missing:
            raise ValueError(f"{len(missing)} planned tensors have no source tensor, e.g. {sorted(missing)[:3]}")
        self.jobs = [self._stacked(jobs) for jobs in self.jobs]
        self.quantizer = {}                              # device -> backend class (chosen once)
        self.flags = torch.zeros(len(plan.buckets), dtype=torch.bool,
                                 pin_memory=torch.cuda.is_available())
        self.host_syncs = 0

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], *, config: dict,
           bucket_bytes: int = push_pipeline.DEFAULT_BUCKET_BYTES, **options) -> PlannedSender:
        """The sender of `tensors` under a plan built from them: `push.plan`'s NVFP4 manifest (options:
        its recipe, shared_group_scale, device) in buckets of at most `bucket_bytes`. `sender.plan.manifest`
        is what `SamplerClient.begin(..., bucket_bytes=)` takes."""
        pp = push_pipeline.plan(tensors, layout="nvfp4", config=config, **options)
        plan = TransferPlan.build(list(pp.entries.values()), bucket_bytes=bucket_bytes)
        return cls(plan, tensors, pp.options, config=config)

    def _jobs(self, name: str, value: torch.Tensor, maps: list[name_map.Mapped], where) -> list[Job]:
        """The jobs of one source tensor: one when it fills its entry row for row, else one per member."""
        found = [where.get(m.name) for m in maps]
        if not maps or any(f is None for f in found):
            missing = [m.name for m, f in zip(maps, found) if f is None]
            if missing:
                raise ValueError(f"{missing[0]}: in the source but not in the plan")
            return []
        shared = self.options.shared_group_scale
        entries = {i for i, _ in found}
        if len(entries) == 1 and maps[0].index is not None:       # a fused expert tensor [E, P*R, K]
            e = self.plan.entries[found[0][0]]
            rows = maps[0].index[1].stop - maps[0].index[1].start
            parts = value.shape[1] // rows
            whole = all(m.expert == mp.index[0] and (m.row0, m.row1) == (mp.index[1].start, mp.index[1].stop)
                        and m.slot == mp.index[1].start // rows for (_, m), mp in zip(found, maps))
            if whole and len(maps) == len(e.members) and e.parts[-1].shape[:-1] == tuple(value.shape[:-1]):
                nvfp4 = e.layout == "nvfp4"
                return [Job(name, None, found[0][0], (), (), split=rows if nvfp4 else None,
                            share=parts if shared and nvfp4 else 1)]
        jobs = []
        for mp, (i, m) in zip(maps, found):
            e = self.plan.entries[i]
            lead = () if m.expert is None else (m.expert,)
            codes = e.parts[-1].shape                           # codes or the dense tensor
            whole = not codes or (m.expert is None and (m.row0, m.row1) == (0, codes[0]))
            rows = () if whole else lead + (slice(m.row0, m.row1),)
            scale = lead + (m.slot,) if e.layout == "nvfp4" and e.parts[0].shape else ()
            group = fused_group(m.entry.name) if shared and e.layout == "nvfp4" else None
            if group is not None and not set(group) <= {x.entry.name for x in e.members}:
                raise ValueError(f"{m.entry.name}: shared_group_scale needs its whole group {list(group)} in "
                                 f"one planned entry")
            jobs.append(Job(name, mp.index, i, rows, scale, group=group))
        return jobs

    def _stacked(self, jobs: list[Job]) -> list[Job]:
        """`jobs` with each stacked entry's per-expert member jobs replaced by chunks of stacked jobs
        (`_stack_chunks`); the rest unchanged."""
        by_entry: dict[int, list[Job]] = {}
        for job in jobs:
            by_entry.setdefault(job.entry, []).append(job)
        out = []
        for i, group in by_entry.items():
            out += self._stack_chunks(i, group) or group
        return out

    def _stack_chunks(self, i: int, group: list[Job]) -> list[Job] | None:
        """Stacked jobs for entry `i` when its member jobs `group` take whole [R, K] sources of one shape
        that fill its codes [E, P * R, K / 2] row for row (expert x, part p at rows [p * R, (p + 1) * R),
        decode-scale slot p), in chunks of at most STACK_BYTES of source; None otherwise."""
        e = self.plan.entries[i]
        codes = e.parts[-1].shape
        shapes = {tuple(self.tensors[j.source].shape) for j in group}
        shape = shapes.pop() if len(shapes) == 1 else ()
        if e.layout != "nvfp4" or len(codes) != 3 or len(shape) != 2 or codes[1] % shape[0] \
                or any(j.index is not None or j.split is not None or len(j.rows) != 2 for j in group):
            return None
        rows, experts = shape[0], codes[0]
        parts = codes[1] // rows
        order = {(j.rows[0], j.rows[1].start, j.rows[1].stop, j.scale): j for j in group}
        keys = [(x, p * rows, (p + 1) * rows, (x, p)) for x in range(experts) for p in range(parts)]
        if len(group) != len(keys) or any(key not in order for key in keys):
            return None
        share = parts if group[0].group is not None else 1
        chunk = max(1, STACK_BYTES // (parts * rows * shape[1] * self.tensors[group[0].source].element_size()))
        out = []
        for x0 in range(0, experts, chunk):
            x1 = min(experts, x0 + chunk)
            names = tuple(order[key].source for key in keys[x0 * parts:x1 * parts])
            out.append(Job(names[0], None, i, (slice(x0, x1),), (slice(x0, x1),), split=rows, share=share, stack=names))
        return out

    # ---- filling -------------------------------------------------------------------------------
    def fill(self, b: int, flat: torch.Tensor) -> Ready:
        """Write bucket `b` into `flat` (uint8 [>= the bucket's bytes], on the sources' device):
        quantize / copy every job at its offsets, then set the bucket's NaN/Inf flag on the device.
        Enqueues work only (no host sync); `Ready.wait` says when it is done and whether it is valid."""
        views = self.plan.fused_views(b, flat)
        amaxes, groups = [], {}
        for job in self.jobs[b]:
            e = self.plan.entries[job.entry]
            parts = views[e.name]
            w = self._value(job)
            if e.layout != "nvfp4":
                dst = parts["dense"][job.rows]
                dst.copy_(w.reshape(dst.shape))
                continue
            if job.share == 1 and job.group is not None:                   # one amax over the group's members
                groups.setdefault(job.group, []).append((job, w, reference.weight_amax(w)))
                continue
            amaxes.append(self._quantize(w, None, parts, job))              # max|w| per expert, computed by the call
        for members in groups.values():
            amax = torch.stack([a for _, _, a in members]).amax(0)
            amaxes.append(amax)
            for job, w, _ in members:
                self._quantize(w, amax, views[self.plan.entries[job.entry].name], job)
        if amaxes:
            bad = ~torch.isfinite(torch.cat([a.reshape(-1) for a in amaxes])).all()
            self.flags[b].copy_(bad, non_blocking=True)
        else:
            self.flags[b] = False
        event = None
        if flat.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return Ready(event, self.flags[b])

    def _quantize(self, w: torch.Tensor, amax: torch.Tensor | None, parts: dict[str, torch.Tensor],
                  job: Job) -> torch.Tensor:
        """w into the job's views of the send buffer with the given amax, or max|w| over each expert's
        `job.share` parts computed by the call; returns the amax used (NaN/Inf in w make it non-finite)."""
        if w.device not in self.quantizer:
            self.quantizer[w.device] = dispatch.quantizer(w.device, self.options.backend)
        codes, scales, s2 = parts["weight"][job.rows], parts["weight_scale"][job.rows], parts["weight_scale_2"][job.scale]
        if job.split is not None:                              # [E, P*R, .] parts as [E*P, R, .] matrices
            codes, scales = (t.view(-1, job.split, t.shape[-1]) for t in (codes, scales))
            s2 = s2.view(-1)
        out = NVFP4Tensor(codes, scales, s2)
        opts = self.options.recipe
        return self.quantizer[w.device].quantize_weight_into(w, out, amax=amax, share=job.share if amax is None else 1,
                                                             recipe=opts.weight, op_order=opts.op_order)

    def find_invalid(self, b: int) -> str:
        """The slow path after bucket `b` was flagged: the first source tensor holding NaN or Inf."""
        for job in self.jobs[b]:
            if self.plan.entries[job.entry].layout == "nvfp4":
                for name in job.stack or (job.source,):
                    value = self.tensors[name] if job.stack else self._value(job)
                    if not bool(torch.isfinite(reference.weight_amax(value)).all()):
                        return f"{name}: contains NaN or Inf"
        return f"bucket {b}: a source tensor contains NaN or Inf"

    def _value(self, job: Job) -> torch.Tensor:
        """The job's source value: value[index], stacked per-expert sources, [-1, split, K] when split."""
        if job.stack:
            w = torch.stack([self.tensors[n] for n in job.stack])
        else:
            value = self.tensors[job.source]
            w = value if job.index is None else value[job.index]
        return w if job.split is None else w.reshape(-1, job.split, w.shape[-1])

    # ---- sending -------------------------------------------------------------------------------
    def new_buffers(self, device: torch.device | str, count: int = 2) -> list[torch.Tensor]:
        """`count` send buffers of the largest bucket's size (CPU: shared memory, as CUDA IPC on a GPU)."""
        from .ipc import shared_cpu_buffer

        n = self.plan.new_buffer(device="meta").numel()
        device = torch.device(device)
        return [shared_cpu_buffer(n) if device.type == "cpu" else torch.empty(n, dtype=torch.uint8, device=device)
                for _ in range(count)]

    def push(self, client, update_id: str, buffers: list[torch.Tensor], *, times: dict | None = None) -> UpdateStatus:
        """Fill and send every bucket of an open planned update (`client.begin(..., bucket_bytes=...)`),
        double-buffered over `buffers`; the caller commits. On any failure (a flagged source, a refused
        bucket) the update is aborted and the error raised. times: filled with seconds per sub-step
        (convert: host time enqueueing the fills; wait: the send thread waiting for a bucket's kernels;
        send: the sidecar's copy + validation + answer; buffer_wait: waiting for a free buffer)."""
        times = times if times is not None else {}
        for k in ("convert", "wait", "send", "buffer_wait"):
            times.setdefault(k, 0.0)
        st = None
        pending: list[concurrent.futures.Future | None] = [None] * len(buffers)

        def send(b: int, flat: torch.Tensor, ready: Ready) -> UpdateStatus:
            t0 = time.perf_counter()
            bad = ready.wait()
            self.host_syncs += ready.event is not None
            t1 = time.perf_counter()
            if bad:
                raise InvalidSource(self.find_invalid(b))
            r = client.send_bucket(update_id, b, flat, ready=ready.event)
            times["wait"] += t1 - t0
            times["send"] += time.perf_counter() - t1
            return r

        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                for b in range(len(self.plan.buckets)):
                    slot = b % len(buffers)
                    if pending[slot] is not None:
                        t0 = time.perf_counter()
                        st = pending[slot].result()
                        times["buffer_wait"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    ready = self.fill(b, buffers[slot])
                    times["convert"] += time.perf_counter() - t0
                    pending[slot] = pool.submit(send, b, buffers[slot], ready)
                for f in pending:
                    if f is not None:
                        f.result()
                if self.plan.buckets:
                    st = pending[(len(self.plan.buckets) - 1) % len(buffers)].result()
        except BaseException:
            try:
                client.abort(update_id)
            except SidecarError:                               # the update has already ended
                pass
            raise
        return st
