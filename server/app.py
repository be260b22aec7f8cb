"""The sidecar FastAPI app: weight-update transactions, log-prob recomputation, OpenAI routes, metrics.

Every serving request holds the read lock for its whole duration and answers with the weight
version it ran on (`X-Weight-Version` header, and `weight_version` in log-prob bodies); a commit
holds the write lock while the engine applies the update. Routes: docs/PROTOCOL.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import os
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nvfp4_sampler.diagnostics.report import Params, mismatch_report

from .dataplane import DataPlane
from .engines import make_engine
from .engines.base import Engine, EngineError
from .protocol import (BINARY_LOGPROBS_CONTENT_TYPE, WEIGHT_VERSION_HEADER, BeginRequest, CommitResult,
                       DiagnosticsRequest, DiagnosticsResponse, IpcBucket, LogprobsRequest, LogprobsResponse,
                       UpdateStatus, VersionInfo, encode_logprobs_binary)
from .settings import Settings, is_loopback
from .transactions import RWLock, UpdateError, UpdateManager


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.version = Gauge("nvfp4_sampler_weight_version", "weight version now serving", registry=r)
        self.update_bytes = Gauge("nvfp4_sampler_last_update_bytes", "payload bytes of the last update", registry=r)
        self.update_seconds = Histogram("nvfp4_sampler_update_apply_seconds", "stage + apply seconds per commit",
                                        registry=r, buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.bytes_total = Counter("nvfp4_sampler_update_bytes", "payload bytes received in committed updates",
                                   registry=r)
        self.commits = Counter("nvfp4_sampler_commits", "committed updates", registry=r)
        self.logprob_seconds = Histogram("nvfp4_sampler_logprob_seconds", "log-prob recompute latency", registry=r)
        self.ipc_bucket_seconds = Histogram("nvfp4_sampler_ipc_bucket_seconds",
                                            "seconds the sidecar spends on one IPC bucket (open, copy, validate, status)",
                                            registry=r, buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2))
        self.ipc_bucket_step_seconds = Histogram(
            "nvfp4_sampler_ipc_bucket_step_seconds", "seconds of one IPC bucket by step: queue (waiting for a "
            "worker thread), open (the shared buffer), copy (copy + validation, to the host sync), status",
            ["step"], registry=r, buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2))
        self.queue_depth = Gauge("nvfp4_sampler_queue_depth", "requests waiting for the engine", registry=r)
        self.gc_pause_seconds = Histogram("nvfp4_sampler_gc_pause_seconds", "garbage-collector pauses by generation",
                                          ["generation"], registry=r,
                                          buckets=(0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5))


class GcPauses(contextlib.AbstractContextManager):
    """While entered, every garbage collection of this process is timed: observe(generation, seconds)
    (a `gc.callbacks` hook)."""

    def __init__(self, observe: Callable[[int, float], None]):
        self.observe, self._start = observe, 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.observe(info["generation"], time.perf_counter() - self._start)


def freeze_long_lived() -> None:
    """Collect, then move every object alive now out of the collector's reach (`gc.freeze`, as vLLM's
    engine core does after start-up): the engine and the held transfer plans are hundreds of thousands
    of objects that a full collection, triggered by an update's allocations, walks for ~0.1 s each time.
    Undone when the app stops."""
    gc.collect()
    gc.freeze()


def create_app(settings: Settings, *, engine: Engine | None = None) -> FastAPI:
    """The sidecar app; the engine (built from `settings` unless given) starts in the lifespan."""
    engine = engine if engine is not None else make_engine(settings)
    lock = RWLock()
    metrics = Metrics()
    state = {"waiting": 0}

    def on_commit(result: CommitResult) -> None:
        metrics.version.set(result.weight_version)
        metrics.update_bytes.set(result.bytes)
        metrics.bytes_total.inc(result.bytes)
        metrics.commits.inc()
        metrics.update_seconds.observe(result.stage_seconds + result.apply_seconds)

    updates = UpdateManager(engine, max_frame_bytes=settings.max_frame_bytes,
                            idle_timeout_s=settings.update_idle_timeout_s, lock=lock, on_commit=on_commit)
    plane = DataPlane(updates, token=settings.token)
    metrics.queue_depth.set_function(lambda: state["waiting"] + engine.queue_depth())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        updates.version = await engine.weight_version()
        metrics.version.set(updates.version)
        if settings.data_port is not None:
            updates.data_port = await plane.start(settings.host, settings.data_port)
        freeze_long_lived()
        with GcPauses(lambda generation, seconds: metrics.gc_pause_seconds.labels(str(generation)).observe(seconds)):
            try:
                yield
            finally:
                gc.unfreeze()                       # what was frozen may be collected again (an app in a process)
                await plane.close()
                await engine.close()

    app = FastAPI(title="nvfp4-sampler sidecar", lifespan=lifespan)
    app.state.engine, app.state.updates, app.state.settings = engine, updates, settings

    @app.exception_handler(UpdateError)
    @app.exception_handler(EngineError)
    async def _refused(request: Request, exc: UpdateError | EngineError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status,
                            headers={WEIGHT_VERSION_HEADER: str(updates.version)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        return JSONResponse({"detail": f"{where}: {first.get('msg')}"}, status_code=422)

    def authorized(request: Request) -> None:
        if settings.token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {settings.token}".encode()):
            raise UpdateError("missing or wrong bearer token", status=401)

    @contextlib.asynccontextmanager
    async def serving():
        """Hold the read lock; yields the version the request runs on."""
        state["waiting"] += 1
        acquired = False
        try:
            async with lock.read():
                state["waiting"] -= 1
                acquired = True
                yield updates.version
        finally:
            if not acquired:
                state["waiting"] -= 1

    # ------------------------------------------------------------------ health, metrics, version
    @app.get("/health")
    async def health():
        return {"status": "ok", "engine": engine.kind, "model": engine.model_id, "weight_version": updates.version,
                "data_port": updates.data_port, "pid": os.getpid()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/weights/version", response_model=VersionInfo)
    async def version():
        cur = updates.current
        return VersionInfo(weight_version=updates.version, model=engine.model_id, engine=engine.kind,
                           update=updates.status(cur) if cur is not None and cur.state == "open" else None)

    # ------------------------------------------------------------------ update transactions
    @app.post("/v1/weights/updates", response_model=UpdateStatus, status_code=201, dependencies=[Depends(authorized)])
    async def begin(req: BeginRequest):
        status = updates.begin(req)
        if req.bucket_bytes is not None:
            freeze_long_lived()                     # a new transfer plan, held for the run
        return status

    @app.get("/v1/weights/updates/{update_id}", response_model=UpdateStatus)
    async def update_status(update_id: str):
        return updates.status(updates.get(update_id))

    @app.put("/v1/weights/updates/{update_id}/body", response_model=UpdateStatus, dependencies=[Depends(authorized)])
    async def body(update_id: str, request: Request):
        return await updates.ingest(update_id, request.stream())

    @app.post("/v1/weights/updates/{update_id}/ipc", response_model=UpdateStatus, dependencies=[Depends(authorized)])
    async def ipc_bucket(update_id: str, bucket: IpcBucket, request: Request):
        if request.client is None or not is_loopback(request.client.host):
            raise UpdateError("IPC buckets are accepted from this host only (loopback)", status=403)
        rx = updates.receiver(update_id)
        steps: dict[str, float] = {}
        t0 = time.perf_counter()

        def stage() -> UpdateStatus:
            steps["queue"] = time.perf_counter() - t0
            return updates.stage_ipc(rx, bucket, steps=steps)
        try:
            return await asyncio.to_thread(stage)
        finally:
            metrics.ipc_bucket_seconds.observe(time.perf_counter() - t0)
            for step, seconds in steps.items():
                metrics.ipc_bucket_step_seconds.labels(step).observe(seconds)
            updates.body_done(rx)

    @app.post("/v1/weights/updates/{update_id}/commit", response_model=CommitResult,
              dependencies=[Depends(authorized)])
    async def commit(update_id: str):
        return await updates.commit(update_id)

    @app.delete("/v1/weights/updates/{update_id}", response_model=UpdateStatus, dependencies=[Depends(authorized)])
    async def abort(update_id: str):
        return updates.abort(update_id)

    # ------------------------------------------------------------------ log-prob recomputation
    @app.post("/v1/logprobs")
    async def logprobs(req: LogprobsRequest):
        t0 = time.perf_counter()
        async with serving() as v:
            results = await engine.logprobs(req)
        metrics.logprob_seconds.observe(time.perf_counter() - t0)
        resp = LogprobsResponse(model=engine.model_id, weight_version=v, results=results)
        headers = {WEIGHT_VERSION_HEADER: str(v)}
        if req.format == "binary":
            return Response(encode_logprobs_binary(resp, top_k=req.top_k), media_type=BINARY_LOGPROBS_CONTENT_TYPE,
                            headers=headers)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    # ------------------------------------------------------------------ mismatch diagnostics
    @app.post("/v1/diagnostics", response_model=DiagnosticsResponse, response_model_exclude_none=True)
    async def diagnostics(req: DiagnosticsRequest):
        """Learner-vs-sampler metrics and TIS / IcePop / OPSM / TRIAGE weights (no engine involved)."""
        try:
            return await asyncio.to_thread(mismatch_report, req.logp_sampler, req.logp_learner,
                                           advantages=req.advantages, masks=req.masks,
                                           params=Params(**req.params.model_dump()))
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=422)

    # ------------------------------------------------------------------ OpenAI-compatible
    async def openai(route: str, body: dict) -> Response:
        if body.get("stream"):
            return await openai_stream(route, body)
        async with serving() as v:
            status, out = await engine.openai(route, body)
        return JSONResponse(out, status_code=status, headers={WEIGHT_VERSION_HEADER: str(v)})

    async def openai_stream(route: str, body: dict) -> Response:
        """Server-sent events; the stream holds the read lock until its last chunk, so all of it
        runs on one weight version (a commit waits for running streams)."""
        hold = serving()
        v = await hold.__aenter__()
        held = [True]

        async def release():
            if held[0]:
                held[0] = False
                await hold.__aexit__(None, None, None)

        try:
            status, stream = await engine.openai_stream(route, body)
        except BaseException:
            await release()
            raise
        if status != 200:
            await release()
            return JSONResponse(stream, status_code=status, headers={WEIGHT_VERSION_HEADER: str(v)})

        async def events():
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={WEIGHT_VERSION_HEADER: str(v)},
                                 background=BackgroundTask(release))      # also when never iterated

    @app.get("/v1/models")
    async def models():
        return await openai("models", {})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai("completions", await request.json())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await openai("chat/completions", await request.json())

    return app
