"""Client of the sidecar: weight pushes (resumable), log-probs, version. httpx + server.protocol/wire.

    c = SamplerClient("http://127.0.0.1:8000", token=...)
    c.push("ckpt/", layout="nvfp4")                 # a HF folder, converted on this side
    c.push(model.state_dict(), layout="bf16", config=hf_config_dict)
    c.logprobs([[1, 2, 3, 4]], [2]).results[0].logprobs
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import httpx
import torch

from nvfp4_sampler.sampler_format import Recipe

from . import push as push_pipeline
from .protocol import (BINARY_LOGPROBS_CONTENT_TYPE, FRAMES_CONTENT_TYPE, BeginRequest, CommitResult,
                       LogprobsRequest, LogprobsResponse, TensorEntry, UpdateStatus, VersionInfo,
                       decode_logprobs_binary)
from .settings import client_token
from .wire import payload_nbytes

Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PushResult:
    """A committed push: the server's CommitResult plus this side's timings (seconds).
    prepare: reading + converting + staging to host (busy time of the producer thread; it overlaps
    send); send: streaming the bodies, incl. resumes (wall); commit: the commit call (stage + apply
    on the server); total: wall time of the whole push (manifest, begin, send, commit)."""

    commit: CommitResult
    payload_bytes: int
    prepare_seconds: float
    send_seconds: float
    commit_seconds: float
    total_seconds: float

    @property
    def weight_version(self) -> int:
        return self.commit.weight_version

    def to_dict(self) -> dict:
        """JSON-ready: the commit's fields (weight_version, tensors, bytes, ...) plus this side's."""
        return {**self.commit.model_dump(), "payload_bytes": self.payload_bytes,
                **{f"{k}_seconds": round(getattr(self, f"{k}_seconds"), 4) for k in ("prepare", "send", "commit", "total")}}


class SidecarError(RuntimeError):
    """A 4xx/5xx answer of the sidecar; `status` and the server's `detail` message."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class SamplerClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 600.0, retries: int = 3):
        token = client_token(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries = retries
        self._data_ports: dict[str, int | None] = {}      # update id -> the sidecar's data-plane port

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except json.JSONDecodeError:
                detail = r.text
            raise SidecarError(r.status_code, str(detail))
        return r

    # ------------------------------------------------------------------ read-only routes
    def health(self) -> dict:
        return self._call("GET", "/health").json()

    def version(self) -> VersionInfo:
        return VersionInfo.model_validate(self._call("GET", "/v1/weights/version").json())

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int], *, top_k: int = 0,
                 format: str = "json") -> LogprobsResponse:
        """Per-token log-probs of sequences[i][prompt_lens[i]:] under the serving weights."""
        req = LogprobsRequest(sequences=sequences, prompt_lens=prompt_lens, top_k=top_k, format=format)
        r = self._call("POST", "/v1/logprobs", json=req.model_dump())
        if r.headers.get("content-type", "").startswith(BINARY_LOGPROBS_CONTENT_TYPE):
            return decode_logprobs_binary(r.content, model="")
        return LogprobsResponse.model_validate(r.json())

    # ------------------------------------------------------------------ update transaction, step by step
    def begin(self, target_version: int, manifest: list[TensorEntry] | None = None, *,
              bucket_bytes: int | None = None, plan_id: str | None = None) -> UpdateStatus:
        """Open an update. bucket_bytes: a planned update (`server.plan.TransferPlan.build(manifest,
        bucket_bytes=...)` on both ends; the status names its plan_id); plan_id instead of a manifest:
        reuse a plan the sidecar built earlier in this run (nothing but the id travels)."""
        req = BeginRequest(target_version=target_version, manifest=manifest or [], bucket_bytes=bucket_bytes,
                           plan_id=plan_id)
        st = UpdateStatus.model_validate(self._call("POST", "/v1/weights/updates", json=req.model_dump()).json())
        self._data_ports[st.update_id] = st.data_port
        return st

    def status(self, update_id: str) -> UpdateStatus:
        return UpdateStatus.model_validate(self._call("GET", f"/v1/weights/updates/{update_id}").json())

    def send(self, update_id: str, body: Iterable[bytes | memoryview]) -> UpdateStatus:
        """Stream one body of frames (chunked transfer), to the sidecar's data-plane port when it
        announced one (payloads land in the staging area without copies there), else the main port."""
        path, port = f"/v1/weights/updates/{update_id}/body", self._data_ports.get(update_id)
        url = self.http.base_url.copy_with(port=port, raw_path=path.encode()) if port else path
        r = self._call("PUT", url, content=_bytes(body), headers={"Content-Type": FRAMES_CONTENT_TYPE})
        return UpdateStatus.model_validate(r.json())

    def send_ipc(self, update_id: str, tensors: Tensors, names: list[str] | None = None) -> UpdateStatus:
        """Stage one bucket through shared memory (same host): the entries `names` of checkpoint-named
        `tensors` (default: all; NVFP4 triplets grouped), packed into one buffer on their device (CUDA:
        CUDA IPC, no host copy; CPU: a shared-memory file) whose handle the sidecar opens and copies."""
        from . import ipc

        flat, req = ipc.bucket(tensors, names)
        r = self._call("POST", f"/v1/weights/updates/{update_id}/ipc", json=req.model_dump())
        del flat                                          # the sidecar's copies are complete
        return UpdateStatus.model_validate(r.json())

    def send_bucket(self, update_id: str, bucket: int, flat: torch.Tensor, *,
                    ready: torch.cuda.Event | None = None) -> UpdateStatus:
        """Planned update: stage bucket `bucket` from `flat`, a flat uint8 buffer laid out by the plan
        (`TransferPlan.pack`, or written in place through `fused_views`) on a GPU (CUDA IPC) or in
        shared memory (`ipc.shared_cpu_buffer`). Only the handle and the index travel; the sidecar
        copies the bucket once, validates it in one pass and answers; `flat` may be reused then.
        The sidecar holds each distinct buffer open until the update ends (opened once): reuse a few
        send buffers rather than a new one per bucket. Waits for `ready` (the event recorded after the
        bucket was written, so work queued since does not delay it) or else for `flat`'s current
        stream: one host sync on CUDA."""
        from . import ipc
        from .protocol import IpcBucket

        if ready is not None:
            ready.synchronize()
        elif flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()

        req = IpcBucket(buffer=ipc.share(flat), bucket=bucket)
        r = self._call("POST", f"/v1/weights/updates/{update_id}/ipc", json=req.model_dump())
        return UpdateStatus.model_validate(r.json())

    def metrics(self) -> str:
        """The sidecar's Prometheus metrics (text exposition format)."""
        return self._call("GET", "/metrics").text

    def commit(self, update_id: str) -> CommitResult:
        return CommitResult.model_validate(self._call("POST", f"/v1/weights/updates/{update_id}/commit").json())

    def abort(self, update_id: str) -> UpdateStatus:
        return UpdateStatus.model_validate(self._call("DELETE", f"/v1/weights/updates/{update_id}").json())

    # ------------------------------------------------------------------ push
    def push(self, source: str | Path | Tensors | Iterable[tuple[str, torch.Tensor]], *, layout: str = "nvfp4",
             version: int | None = None, config: dict | None = None, recipe: Recipe = Recipe(),
             shared_group_scale: bool = False, device: str | None = None,
             bucket_bytes: int = push_pipeline.DEFAULT_BUCKET_BYTES, progress: bool = True) -> PushResult:
        """Push weights as one transaction and commit it, streaming bucket by bucket.

        source: a HF folder (safetensors), a checkpoint-named state dict, or (name, tensor) pairs
          (tensors on a GPU are converted there; host memory holds about two buckets, server/push.py).
        layout "nvfp4": quantized linears are converted here (`converters.iter_buckets`; needs the HF
          `config` dict for in-memory sources, a folder has its config.json) and sent as NVFP4 triplets.
        layout "bf16": float tensors are sent as BF16 and the sampler quantizes them on arrival.
        recipe: the learner's `sampler_format.Recipe` (weight recipe, op order) the conversion quantizes
        with; shared_group_scale: one second-level scale per fused group (`converters.ConvertOptions`).
        device: where tensors are converted (default: where each lives). version: the target version
        (default: current + 1). Dropped bodies are resumed: after an error the client asks for the
        missing tensors and converts and re-sends only those (`retries` times).
        """
        t0 = time.perf_counter()
        plan = push_pipeline.plan(source, layout=layout, config=config, recipe=recipe,
                                  shared_group_scale=shared_group_scale, device=device, bucket_bytes=bucket_bytes)
        target = version if version is not None else self.version().weight_version + 1
        st = self.begin(target, list(plan.entries.values()))
        total = sum(payload_nbytes(e) for e in plan.entries.values())
        bar = _progress(total, progress)
        prepare = 0.0
        try:
            t1 = time.perf_counter()
            for attempt in range(self.retries + 1):
                if not st.missing_count:
                    break
                pipeline = push_pipeline.Pipeline(plan, only=set(st.missing))
                try:
                    with pipeline as buckets:
                        st = self.send(st.update_id, _bucket_frames(buckets, plan.entries, bar))
                except (httpx.TransportError, SidecarError) as e:
                    if isinstance(e, SidecarError) and e.status < 500 and e.status not in (408, 409):
                        raise
                    if attempt == self.retries:
                        raise
                    time.sleep(min(2 ** attempt * 0.2, 5))
                    st = self.status(st.update_id)
                    bar.n = st.bytes_received
                finally:
                    prepare += pipeline.prepare_seconds
            if st.missing_count:
                raise SidecarError(409, f"{st.missing_count} tensor(s) still missing after {self.retries} retries")
            t2 = time.perf_counter()
            commit = self.commit(st.update_id)
            t3 = time.perf_counter()
            return PushResult(commit, total, prepare, t2 - t1, t3 - t2, t3 - t0)
        except BaseException:
            if self.status(st.update_id).state == "open":
                self.abort(st.update_id)
            raise
        finally:
            bar.close()


def _bytes(body: Iterable[bytes | memoryview], *, min_chunk: int = 1 << 20) -> Iterator[bytes | memoryview]:
    """Body buffers for the socket: small ones (headers, scales) joined into chunks of >= min_chunk,
    large payloads passed through without a copy (tiny writes stall TCP: Nagle + delayed ACK)."""
    pending: list[bytes | memoryview] = []
    size = 0
    for b in body:
        b = b if isinstance(b, bytes) else b.cast("B")
        if len(b) >= min_chunk:
            if pending:
                yield b"".join(pending)
                pending, size = [], 0
            yield b
            continue
        pending.append(b)
        size += len(b)
        if size >= min_chunk:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _bucket_frames(buckets: Iterable[Tensors], entries: Mapping[str, TensorEntry], bar) -> Iterator[bytes | memoryview]:
    """The body of a streamed push: each host bucket's frames, coalesced per bucket (`_bytes` copies
    what it joins and passes large payloads through), so nothing refers to a bucket once the next is
    requested: its pinned slot may then be refilled."""
    for bucket in buckets:
        yield from _bytes(_count_payload(push_pipeline.frames(bucket, entries), bar))


def _count_payload(bufs: Iterable[bytes | memoryview], bar) -> Iterator[bytes | memoryview]:
    """Pass frame buffers through; the bar counts payload bytes (memoryviews; headers are bytes)."""
    for buf in bufs:
        yield buf
        if isinstance(buf, memoryview):
            bar.update(buf.nbytes)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="push", disable=not enabled)
