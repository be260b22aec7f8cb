"""Versioned weight-update transactions: begin -> bodies (resumable) -> commit | abort.

Frames are checked against the manifest as they arrive and kept in memory (the staging area);
`commit` writes them to one safetensors file and applies it through the engine while the app's
write lock keeps every request on exactly one version. Nothing reaches the engine before commit,
so a dropped client, a bad frame or a sidecar restart leaves the last committed version serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from .engines.base import Engine, TensorSpec
from .protocol import BeginRequest, CommitResult, TensorEntry, UpdateStatus
from .wire import FrameParser, WireError


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
    staged: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    bytes_received: int = 0
    state: str = "open"
    last_activity: float = dataclasses.field(default_factory=time.monotonic)
    streaming: bool = False

    def status(self) -> UpdateStatus:
        return UpdateStatus(update_id=self.id, target_version=self.target_version, state=self.state,
                            missing=[n for n in self.manifest if n not in self.staged],
                            received=len(self.staged), bytes_received=self.bytes_received)


class UpdateManager:
    """At most one open update; `lock` is the app's serving lock (commit takes it for writing)."""

    def __init__(self, engine: Engine, *, staging_dir: Path, max_frame_bytes: int, idle_timeout_s: float,
                 lock: RWLock, on_commit=None):
        self.engine = engine
        self.staging_dir = staging_dir
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout_s = idle_timeout_s
        self.lock = lock
        self.on_commit = on_commit
        self.current: Update | None = None
        self.version = 0                                     # the serving version (set by the app at start)
        self._commit_lock = asyncio.Lock()

    def begin(self, req: BeginRequest) -> UpdateStatus:
        cur = self.current
        if cur is not None and cur.state == "open":
            idle = time.monotonic() - cur.last_activity
            if cur.streaming or idle < self.idle_timeout_s:
                raise UpdateError(f"update {cur.id} (to version {cur.target_version}) is in progress; "
                                  f"commit or abort it first", status=409)
            cur.state = "aborted"                            # stale: its client went away
        if req.target_version <= self.version:
            raise UpdateError(f"target_version {req.target_version} must be greater than the current "
                              f"version {self.version}", status=409)
        problems = []
        for e in req.manifest:
            spec: TensorSpec | None = self.engine.specs.get(e.name)
            msg = f"{e.name}: unknown tensor name" if spec is None else spec.check(e)
            if msg:
                problems.append(msg)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise UpdateError("; ".join(problems[:5]) + more, status=422)
        self.current = Update(uuid.uuid4().hex, req.target_version, {e.name: e for e in req.manifest})
        return self.current.status()

    def get(self, update_id: str) -> Update:
        if self.current is None or self.current.id != update_id:
            raise UpdateError(f"no update {update_id!r}", status=404)
        return self.current

    def _open(self, update_id: str) -> Update:
        u = self.get(update_id)
        if u.state != "open":
            raise UpdateError(f"update {update_id} is {u.state}", status=409)
        return u

    async def ingest(self, update_id: str, body: AsyncIterator[bytes]) -> UpdateStatus:
        """Parse one body into the staging area. Complete, valid frames are kept even if the body
        fails later (so the client re-sends only `missing`); the failing frame is dropped."""
        u = self._open(update_id)
        if u.streaming:
            raise UpdateError(f"update {update_id} is already receiving a body", status=409)
        u.streaming = True
        parser = FrameParser(max_frame_bytes=self.max_frame_bytes)
        try:
            async for chunk in body:
                u.last_activity = time.monotonic()
                for frame in parser.feed(chunk):
                    expected = u.manifest.get(frame.entry.name)
                    if expected is None:
                        raise UpdateError(f"{frame.entry.name}: not in the update's manifest", status=422)
                    if expected != frame.entry:
                        raise UpdateError(f"{frame.entry.name}: frame is {frame.entry.layout} {frame.entry.dtype} "
                                          f"{frame.entry.shape}, manifest says {expected.layout} {expected.dtype} "
                                          f"{expected.shape}", status=422)
                    u.staged[frame.entry.name] = frame.tensors
                    u.bytes_received += frame.nbytes
            parser.finish()
        except WireError as e:
            raise UpdateError(str(e), status=e.status) from e
        finally:
            u.streaming = False
            u.last_activity = time.monotonic()
        return u.status()

    def abort(self, update_id: str) -> UpdateStatus:
        u = self._open(update_id)
        u.state, u.staged = "aborted", {}
        return u.status()

    async def commit(self, update_id: str) -> CommitResult:
        async with self._commit_lock:
            u = self._open(update_id)
            if u.streaming:
                raise UpdateError(f"update {update_id} is still receiving a body", status=409)
            missing = [n for n in u.manifest if n not in u.staged]
            if missing:
                raise UpdateError(f"{len(missing)} manifest tensor(s) not received yet, e.g. {missing[:5]}",
                                  status=409)
            t0 = time.perf_counter()
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            path = self.staging_dir / f"update-{u.target_version}-{u.id}.safetensors"
            flat = {name: t for parts in u.staged.values() for name, t in parts.items()}
            await asyncio.to_thread(save_file, flat, str(path))
            t1 = time.perf_counter()
            try:
                async with self.lock.write():
                    report = await self.engine.apply_update(path, u.target_version)
                    self.version = u.target_version         # before any reader can run again
            except BaseException:
                u.state = "aborted"                          # the engine refused it: nothing applied
                raise
            finally:
                path.unlink(missing_ok=True)
                u.staged = {}
            u.state = "committed"
            t2 = time.perf_counter()
            result = CommitResult(weight_version=u.target_version, tensors=len(u.manifest), bytes=u.bytes_received,
                                  stage_seconds=t1 - t0, apply_seconds=t2 - t1, engine=report)
            if self.on_commit is not None:
                self.on_commit(result)
            return result
