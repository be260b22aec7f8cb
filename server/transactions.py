"""Versioned weight-update transactions: begin -> bodies or IPC buckets (resumable) -> commit | abort.

At begin the update gets one staging buffer (CPU, uint8) with a 64-byte-aligned slot per manifest
entry; frames are written straight into their slots (by the data-plane socket or from the HTTP
body's chunks), checked, and staged one by one, so a failing frame never costs the frames before
it. The buffer is kept for the next update when large enough (steady-state pushes write into pages
already mapped). `commit` hands the staged tensors to the engine while the app's write lock keeps
every request on exactly one version. Nothing reaches the engine before commit, so a dropped
client, a bad frame or a sidecar restart leaves the last committed version serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import torch

from . import ipc
from .plan import TransferPlan
from .engines.base import Engine, TensorSpec
from .protocol import BeginRequest, CommitResult, IpcBucket, IpcHandle, TensorEntry, UpdateStatus
from .wire import FrameParser, WireError, decode_payload, invalid_tensor, payload_nbytes


_PLANNED: dict[str, torch.Tensor] = {}                 # a planned member's staged marker (its bytes: Update.buckets)


class UpdateError(Exception):
    """A refused update operation; `status` is the HTTP status to answer (4xx)."""

    def __init__(self, message: str, *, status: int):
        super().__init__(message)
        self.status = status


class RWLock:
    """asyncio readers-writer lock, writer-preferring: a waiting writer blocks new readers."""

    def __init__(self):
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            await self._cond.wait_for(lambda: not self._writer and not self._readers)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclasses.dataclass
class Update:
    id: str
    target_version: int
    manifest: dict[str, TensorEntry]
    slots: dict[str, torch.Tensor]                   # name -> uint8 [payload bytes], views of `buffer`
    buffer: torch.Tensor | None
    staged: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    bytes_received: int = 0
    state: str = "open"
    last_activity: float = dataclasses.field(default_factory=time.monotonic)
    streaming: bool = False
    plan: TransferPlan | None = None                 # a planned update: IPC buckets by index only
    bucket_offsets: list[int] = dataclasses.field(default_factory=list)   # bucket b's place in `buffer`, then its size
    buckets: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # planned: staged bucket bytes
    opened: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)  # shared buffers held open

    def open_buffer(self, h: IpcHandle) -> torch.Tensor:
        """The buffer a handle names, opened once per planned update and held until it ends: a sender
        that reuses its send buffers pays the open (CUDA: cudaIpcOpenMemHandle) once, not per bucket.
        A held CUDA buffer is not waited on again (torch reuses the open storage without the sender's
        event): `SamplerClient.send_bucket` synchronises the sender's stream before it sends."""
        key = (h.kind, h.handle, h.storage_offset_bytes, h.offset, h.nbytes)
        flat = self.opened.get(key)
        if flat is None:
            flat = self.opened[key] = ipc.open_buffer(h)
        return flat

    def status(self, *, data_port: int | None = None, listed: bool = True) -> UpdateStatus:
        """listed False: the missing names are counted, not listed (a planned update's begin and bucket
        answers: O(1) per bucket instead of every name of the model)."""
        return UpdateStatus(update_id=self.id, target_version=self.target_version, state=self.state,
                            missing=[n for n in self.manifest if n not in self.staged] if listed else None,
                            missing_count=len(self.manifest) - len(self.staged), received=len(self.staged),
                            bytes_received=self.bytes_received, data_port=data_port,
                            plan_id=self.plan.plan_id if self.plan is not None else None)

    def slot(self, entry: TensorEntry, nbytes: int) -> torch.Tensor:
        """The staging slot of a frame about to be written (FrameParser's `slot`); the entry's
        previous copy, if any, is unstaged first (its bytes are about to be overwritten)."""
        if self.plan is not None:
            raise WireError(f"update {self.id} is planned: it takes planned IPC buckets, not frames", status=409)
        expected = self.manifest.get(entry.name)
        if expected is None:
            raise WireError(f"{entry.name}: not in the update's manifest", status=422)
        if expected != entry:
            raise WireError(f"{entry.name}: frame is {entry.layout} {entry.dtype} {entry.shape}, manifest says "
                            f"{expected.layout} {expected.dtype} {expected.shape}", status=422)
        if self.state != "open":
            raise WireError(f"update {self.id} is {self.state}", status=409)
        self.staged.pop(entry.name, None)
        self.last_activity = time.monotonic()
        return self.slots[entry.name]

    def stage(self, entry: TensorEntry, tensors: dict[str, torch.Tensor], nbytes: int) -> None:
        self.staged[entry.name] = tensors
        self.bytes_received += nbytes


class BodyReceiver:
    """One body of frames for an open update, in the shape of asyncio.BufferedProtocol
    (`get_buffer` / `advance`, for the data-plane socket) or fed chunk by chunk (`feed`).
    Each complete, valid frame is staged before the next byte is parsed. Raises UpdateError."""

    def __init__(self, update: Update, *, max_frame_bytes: int):
        if update.streaming:
            raise UpdateError(f"update {update.id} is already receiving a body", status=409)
        self.update = update
        self.parser = FrameParser(max_frame_bytes=max_frame_bytes, slot=update.slot)
        update.streaming = True

    def get_buffer(self) -> memoryview:
        return self.parser.get_buffer()

    def advance(self, n: int) -> None:
        with _as_update_error():
            for frame in self.parser.advance(n):
                self.update.stage(frame.entry, frame.tensors, frame.nbytes)

    def feed(self, chunk: bytes) -> None:
        self.update.last_activity = time.monotonic()
        with _as_update_error():
            for frame in self.parser.feed(chunk):
                self.update.stage(frame.entry, frame.tensors, frame.nbytes)

    def finish(self) -> None:
        with _as_update_error():
            self.parser.finish()

    def close(self) -> None:
        """The body ended (complete, failed or cut): the update may take another."""
        self.update.streaming = False
        self.update.last_activity = time.monotonic()


@contextlib.contextmanager
def _as_update_error():
    try:
        yield
    except WireError as e:
        raise UpdateError(str(e), status=e.status) from e


class UpdateManager:
    """At most one open update; `lock` is the app's serving lock (commit takes it for writing)."""

    def __init__(self, engine: Engine, *, max_frame_bytes: int, idle_timeout_s: float, lock: RWLock,
                 on_commit=None):
        self.engine = engine
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout_s = idle_timeout_s
        self.lock = lock
        self.on_commit = on_commit
        self.current: Update | None = None
        self.version = 0                                     # the serving version (set by the app at start)
        self.data_port: int | None = None                    # set by the app when the data plane listens
        self._spare: torch.Tensor | None = None              # a staging buffer to reuse
        self.plans: dict[str, TransferPlan] = {}             # plans built this run, by plan_id (newest last)
        self._commit_lock = asyncio.Lock()

    def status(self, u: Update, *, listed: bool = True) -> UpdateStatus:
        return u.status(data_port=self.data_port, listed=listed)

    def begin(self, req: BeginRequest) -> UpdateStatus:
        cur = self.current
        if cur is not None and cur.state == "open":
            idle = time.monotonic() - cur.last_activity
            if cur.streaming or idle < self.idle_timeout_s:
                raise UpdateError(f"update {cur.id} (to version {cur.target_version}) is in progress; "
                                  f"commit or abort it first", status=409)
            self._end(cur, "aborted")                        # stale: its client went away
        if cur is not None and cur.streaming:
            raise UpdateError(f"update {cur.id} is {cur.state} but its body is still arriving; retry", status=409)
        if req.target_version <= self.version:
            raise UpdateError(f"target_version {req.target_version} must be greater than the current "
                              f"version {self.version}", status=409)
        plan = None
        if req.plan_id is not None:
            plan = self.plans.get(req.plan_id)
            if plan is None:
                raise UpdateError(f"unknown plan_id {req.plan_id!r}: begin with the manifest and bucket_bytes",
                                  status=404)
            manifest = list(plan.manifest)
        else:
            manifest = req.manifest
        problems = []
        for e in manifest if plan is None else ():          # a held plan was checked when it was built
            spec: TensorSpec | None = self.engine.specs.get(e.name)
            msg = f"{e.name}: unknown tensor name" if spec is None else spec.check(e)
            if msg:
                problems.append(msg)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise UpdateError("; ".join(problems[:5]) + more, status=422)
        if plan is None and req.bucket_bytes is not None:
            plan = TransferPlan.build(manifest, bucket_bytes=req.bucket_bytes)
            self.plans.pop(plan.plan_id, None)
            self.plans[plan.plan_id] = plan
            while len(self.plans) > 4:
                self.plans.pop(next(iter(self.plans)))
        offsets, total = {}, 0
        if plan is None:
            for e in manifest:
                offsets[e.name] = total
                total += -(-payload_nbytes(e) // ipc.ALIGN) * ipc.ALIGN
        else:                                                # the plan's buckets back to back
            bucket_offsets = []
            for b in plan.buckets:
                bucket_offsets.append(total)
                total += -(-b.nbytes // ipc.ALIGN) * ipc.ALIGN
        # a planned update takes its host buffer when its first host bucket arrives: buckets that stay on
        # their GPU (CUDA IPC) never need one (in front of vLLM it is a shared-memory file of the model's size)
        buffer = self._staging(total) if plan is None else None
        slots = {e.name: buffer[offsets[e.name]:offsets[e.name] + payload_nbytes(e)] for e in manifest} \
            if plan is None else {}
        self.current = Update(uuid.uuid4().hex, req.target_version, {e.name: e for e in manifest}, slots, buffer,
                              plan=plan, bucket_offsets=bucket_offsets + [total] if plan is not None else [])
        return self.status(self.current, listed=plan is None)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of at least nbytes: the spare one if it is large enough, else the engine's."""
        buffer = self._spare if self._spare is not None and self._spare.numel() >= nbytes else None
        self._spare = None
        return buffer if buffer is not None else self.engine.staging_buffer(nbytes)

    def get(self, update_id: str) -> Update:
        if self.current is None or self.current.id != update_id:
            raise UpdateError(f"no update {update_id!r}", status=404)
        return self.current

    def _open(self, update_id: str) -> Update:
        u = self.get(update_id)
        if u.state != "open":
            raise UpdateError(f"update {update_id} is {u.state}", status=409)
        return u

    def _end(self, u: Update, state: str) -> None:
        """Close `u`; its staging buffer becomes the spare once no body writes into it."""
        u.state, u.staged, u.buckets, u.opened = state, {}, {}, {}
        if not u.streaming and u.buffer is not None:
            self._spare, u.buffer, u.slots = u.buffer, None, {}

    def receiver(self, update_id: str) -> BodyReceiver:
        return BodyReceiver(self._open(update_id), max_frame_bytes=self.max_frame_bytes)

    def body_done(self, receiver: BodyReceiver) -> None:
        receiver.close()
        if receiver.update.state != "open":                  # aborted while its body arrived
            self._end(receiver.update, receiver.update.state)

    async def ingest(self, update_id: str, body: AsyncIterator[bytes]) -> UpdateStatus:
        """Parse one body given as chunks into the staging area. Complete, valid frames are kept
        even if the body fails later (the client re-sends only `missing`); the failing frame is not."""
        rx = self.receiver(update_id)
        try:
            async for chunk in body:
                rx.feed(chunk)
            rx.finish()
        finally:
            self.body_done(rx)
        return self.status(rx.update)

    def stage_ipc(self, rx: BodyReceiver, bucket: IpcBucket, *, steps: dict[str, float] | None = None) -> UpdateStatus:
        """Stage a bucket from a shared buffer (`server.ipc`) for the update `rx` holds (any thread):
        every entry is checked (manifest, bounds, NaN/Inf, global scales) before any is staged (a
        refused bucket leaves its entries missing); CPU buffers are copied into the staging slots,
        CUDA buffers into new tensors on their device; the copies are complete on return.
        steps: filled with seconds per step of a planned bucket (open, copy, status)."""
        u = rx.update
        steps = steps if steps is not None else {}
        if (bucket.bucket is not None) != (u.plan is not None):
            how = "planned: send buckets by index" if u.plan else "not planned: list the tensors of the bucket"
            raise UpdateError(f"update {u.id} is {how}", status=409)
        t0 = time.perf_counter()
        try:
            flat = u.open_buffer(bucket.buffer) if u.plan is not None else ipc.open_buffer(bucket.buffer)
        except (RuntimeError, ValueError) as e:
            raise UpdateError(f"cannot open the shared buffer: {e}", status=422) from e
        steps["open"] = time.perf_counter() - t0
        if u.plan is not None:
            t0 = time.perf_counter()
            self._stage_planned(u, bucket.bucket, flat)
            steps["copy"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            status = self.status(u, listed=False)
            steps["status"] = time.perf_counter() - t0
            return status
        staged = []
        with _as_update_error():
            for item in bucket.tensors:
                n = payload_nbytes(item.entry)
                if item.offset % 16 or item.offset + n > flat.numel():
                    raise WireError(f"{item.entry.name}: [{item.offset}, {item.offset + n}) is not a 16-byte "
                                    f"aligned range of the {flat.numel()}-byte buffer", status=422)
                src = flat[item.offset:item.offset + n]
                dst = u.slot(item.entry, n)                  # checks the manifest, unstages an earlier copy
                if flat.device.type != "cpu":
                    dst = torch.empty_like(src)
                dst.copy_(src)
                staged.append((item.entry, decode_payload(item.entry, dst, check=False), n))
            bad = invalid_tensor({k: t for _, parts, _ in staged for k, t in parts.items()})
            if bad:
                raise WireError(bad, status=422)
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()    # copies done: the sender may reuse it
        del flat
        for entry, parts, n in staged:
            u.stage(entry, parts, n)
        return self.status(u)

    def _stage_planned(self, u: Update, b: int, flat: torch.Tensor) -> None:
        """Planned bucket `b`: one copy of the whole bucket (into its place in the staging buffer, or
        one new tensor on its GPU), one validation pass per value class into a device flag, one host
        synchronisation; then every member is staged as a view. A bad bucket stages nothing."""
        plan = u.plan
        if u.state != "open":
            raise UpdateError(f"update {u.id} is {u.state}", status=409)
        try:
            n = plan.buckets[b].nbytes
            plan._check(b, flat)
        except (IndexError, ValueError) as e:
            raise UpdateError(f"bucket {b}: {e}", status=422) from e
        members = [m.entry.name for i in plan.buckets[b].entries for m in plan.entries[i].members]
        if u.buckets.pop(b, None) is not None:
            for name in members:
                u.staged.pop(name, None)                     # their bytes are about to be overwritten
        if flat.device.type == "cpu":
            if u.buffer is None:
                u.buffer = self._staging(u.bucket_offsets[-1])
            dst = u.buffer[u.bucket_offsets[b]:u.bucket_offsets[b] + n]
        else:
            dst = torch.empty(n, dtype=torch.uint8, device=flat.device)
        dst.copy_(flat[:n])
        flag = plan.validate(b, dst)
        if bool(flag):                                       # the one host sync of the bucket
            raise UpdateError(plan.find_invalid(b, dst) or f"bucket {b}: invalid values", status=422)
        del flat
        u.last_activity = time.monotonic()
        u.buckets[b] = dst                                   # the commit takes the fused entries from here
        staged = dict.fromkeys(members, _PLANNED)            # no per-tensor views: names only
        u.staged.update(staged)
        u.bytes_received += n

    def abort(self, update_id: str) -> UpdateStatus:
        u = self._open(update_id)
        self._end(u, "aborted")
        return self.status(u)

    async def commit(self, update_id: str) -> CommitResult:
        async with self._commit_lock:
            u = self._open(update_id)
            if u.streaming:
                raise UpdateError(f"update {update_id} is still receiving a body", status=409)
            missing = [n for n in u.manifest if n not in u.staged]
            if missing:
                raise UpdateError(f"{len(missing)} manifest tensor(s) not received yet, e.g. {missing[:5]}",
                                  status=409)
            if u.plan is not None:                           # planned: the fused entries, one copy per kind
                fused = [e for b, flat in sorted(u.buckets.items()) for e in u.plan.fused_entries(b, flat)]
                tensors = {}
            else:
                tensors = {name: t for parts in u.staged.values() for name, t in parts.items()}
            t0 = time.perf_counter()
            try:
                async with self.lock.write():
                    if u.plan is not None:
                        report = await self.engine.apply_fused(fused, u.target_version)
                    else:
                        report = await self.engine.apply_update(tensors, u.target_version)
                    self.version = u.target_version         # before any reader can run again
            except BaseException:
                self._end(u, "aborted")                      # the engine refused it: nothing applied
                raise
            del tensors
            u.buckets = {}
            self._end(u, "committed")
            stage = report.pop("stage_seconds", 0.0)
            result = CommitResult(weight_version=u.target_version, tensors=len(u.manifest), bytes=u.bytes_received,
                                  stage_seconds=stage, apply_seconds=time.perf_counter() - t0 - stage, engine=report)
            if self.on_commit is not None:
                self.on_commit(result)
            return result
