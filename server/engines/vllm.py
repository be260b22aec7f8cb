"""vLLM adapter: the vLLM OpenAI server (a child process, or already running) driven over HTTP.

The server runs with `--quantization nvfp4_sampler`, the worker extension
`sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension` and VLLM_SERVER_DEV_MODE=1, so
the sidecar can call `/collective_rpc` (nvfp4_apply_update, nvfp4_weight_version), `/pause`,
`/resume` and `/reset_prefix_cache`. Commits hand the staged tensors to the workers as shared
buffers (handle + offsets through `/collective_rpc`), never as a file. OpenAI routes are forwarded as they are; log-probs use
`/v1/completions` with token-id prompts, `max_tokens: 1` and `prompt_logprobs: k` (the one sampled
token is discarded). The weight version lives in the engine's workers, so a restarted sidecar
reads it back.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import torch

from nvfp4_sampler.sampler_format import METHOD_NAME

from .. import ipc
from ..process import ChildServer, free_port
from ..protocol import LogprobsRequest, SequenceLogprobs
from ..settings import Settings
from .base import Engine, EngineError, checkpoint_specs

EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"


def vllm_server(model: str | Path, *, port: int, log: str | Path, extra: tuple[str, ...] | list[str] = (),
                timeout_s: float = 600.0, strict: bool = False, device: str = "cpu") -> ChildServer:
    """The vLLM OpenAI server for `model` on 127.0.0.1:`port` with the nvfp4_sampler method, the
    reload worker extension and the dev-mode routes (a ChildServer, not started). The CPU KV cache is
    VLLM_CPU_KVCACHE_SPACE GiB (1 unless set). strict: `quantization_config.strict` through
    `--hf-overrides` (`strict_overrides`), and on `device` "cuda" vLLM's VLLM_BATCH_INVARIANT=1."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--quantization", "nvfp4_sampler",
           "--worker-extension-cls", EXTENSION, *extra]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if strict:
        cmd += ["--hf-overrides", json.dumps(strict_overrides(model))]
        if device == "cuda":
            env["VLLM_BATCH_INVARIANT"] = "1"
    return ChildServer(cmd, url=f"http://127.0.0.1:{port}", log=log, env=env,
                       env_defaults={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=timeout_s)


def strict_overrides(model: str | Path) -> dict:
    """vLLM `hf_overrides` that turn strict mode on for `model`: its config.json's nvfp4_sampler
    `quantization_config` (a converter's output keeps its options) or the defaults, with strict true."""
    qc = json.loads((Path(model) / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != METHOD_NAME:
        qc = {"quant_method": METHOD_NAME}
    return {"quantization_config": {**qc, "strict": True}}


class VLLMEngine(Engine):
    kind = "vllm"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.child: ChildServer | None = None
        if settings.engine == "remote":
            self.url = settings.engine_url.rstrip("/")
        else:
            port = free_port()
            self.child = vllm_server(settings.model, port=port, extra=settings.vllm_args,
                                     log=Path(settings.staging_dir) / f"vllm-{port}.log",
                                     timeout_s=settings.engine_start_timeout_s, strict=settings.strict,
                                     device=settings.device)
            self.url = self.child.url
        self.model_id = str(settings.model) if settings.model else ""
        self.specs = checkpoint_specs(settings.model) if settings.model else {}
        self.http: httpx.AsyncClient | None = None
        self._scratch: torch.Tensor | None = None            # shared buffer for tensors not staged in one
        self.last_copied_bytes = 0                           # bytes the last commit copied to share them
        self._own: set[int] = set()                          # storages of the shared staging buffers given out

    async def start(self) -> None:
        if self.child is not None:
            self.child.spawn()                               # on the event-loop thread (see ChildServer.spawn)
            await asyncio.to_thread(self.child.wait_ready)
        self.http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0))
        models = (await self._post("GET", "/v1/models")).json()["data"][0]
        self.model_id = models["id"]
        if not self.specs:
            root = Path(models.get("root") or models["id"])
            if not (root / "config.json").is_file():
                raise EngineError(f"cannot find the served model folder ({root}); pass --model", status=500)
            self.specs = checkpoint_specs(root)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.child is not None:
            await asyncio.to_thread(self.child.stop)

    async def _post(self, method: str, path: str, **kw) -> httpx.Response:
        r = await self.http.request(method, path, **kw)
        if r.status_code >= 400:
            raise EngineError(f"vLLM {path}: HTTP {r.status_code}: {r.text[:2000]}",
                              status=422 if r.status_code < 500 or "ValueError" in r.text else 502)
        return r

    async def _rpc(self, method: str, *args: str) -> list:
        r = await self.http.post("/collective_rpc", json={"method": method, "args": list(args)})
        if r.status_code == 404:
            raise EngineError(f"vLLM at {self.url} has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1, "
                              f"--quantization nvfp4_sampler and --worker-extension-cls {EXTENSION}", status=502)
        if r.status_code >= 400:
            raise EngineError(f"vLLM {method}: HTTP {r.status_code}: {r.text[:2000]}",
                              status=422 if "ValueError" in r.text else 502)
        return r.json()["results"]

    async def weight_version(self) -> int:
        versions = {int(v) for v in await self._rpc("nvfp4_weight_version")}
        if len(versions) != 1:
            raise EngineError(f"workers disagree on the weight version: {sorted(versions)}", status=500)
        return versions.pop()

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        """Updates are staged in shared memory, so a commit hands the workers the staged bytes
        themselves (handle + offsets), with no copy and no file."""
        buf = ipc.shared_cpu_buffer(nbytes)
        self._own.add(buf.untyped_storage().data_ptr())
        return buf

    def _shared_spec(self, tensors: dict[str, torch.Tensor], *,
                     cuda_storages: bool = False) -> tuple[dict, list[torch.Tensor]]:
        """The `nvfp4_apply_shared` spec of `tensors`: CPU tensors that are views of a shared-memory
        staging buffer travel as (handle, offset) with no copy; any other tensor is copied once
        into a reusable shared buffer (CPU tensors) or one flat buffer on its GPU shared by CUDA IPC.
        Returns the spec and the buffers to keep alive until the workers answered."""
        buffers: list[torch.Tensor] = []
        index: dict[tuple[str, int], int] = {}              # (device, storage data_ptr) -> buffer index
        table, pending = [], []
        for name, t in tensors.items():
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            shared = t.is_contiguous() and (
                (t.device.type == "cpu" and st.data_ptr() in self._own and st.is_shared())
                or (cuda_storages and t.device.type == "cuda"))       # a staged planned bucket: shared whole
            if not shared:
                pending.append((name, t))
                continue
            if key not in index:
                index[key] = len(buffers)
                buffers.append(torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),)))
            table.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), index[key],
                          t.data_ptr() - st.data_ptr()])
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, t in pending:
            by_device.setdefault(t.device, []).append((name, t))
        for device, items in by_device.items():
            offsets, total = [], 0
            for _, t in items:
                offsets.append(total)
                total += -(-t.numel() * t.element_size() // ipc.ALIGN) * ipc.ALIGN
            if device.type == "cpu":
                if self._scratch is None or self._scratch.numel() < total:
                    self._scratch = None
                    self._scratch = ipc.shared_cpu_buffer(total)
                flat = self._scratch
            else:
                flat = torch.empty(total, dtype=torch.uint8, device=device)
            b = len(buffers)
            buffers.append(flat)
            for (name, t), off in zip(items, offsets):
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                table.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), b, off])
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        handles = [ipc.share(f).model_dump() for f in buffers]
        self.last_copied_bytes = sum(t.numel() * t.element_size() for _, t in pending)
        return {"buffers": handles, "tensors": table}, buffers

    async def apply_update(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        """The tensors go to the workers through `collective_rpc("nvfp4_apply_shared")` as shared
        buffers (the staging area itself, a shared-memory segment: handle + offsets, no copy; GPU
        tensors as one CUDA IPC buffer): no file. The worker extension validates all, then writes
        in place. `stage_seconds`: building the handover (copies of tensors not yet shared)."""
        t0 = time.perf_counter()
        spec, keep = await asyncio.to_thread(self._shared_spec, tensors)
        return await self._hand_over(spec, keep, version, stage_seconds=time.perf_counter() - t0)

    async def _hand_over(self, spec: dict, keep, version: int, *, stage_seconds: float) -> dict:
        """Pause vLLM, let the workers apply `spec` (`nvfp4_apply_shared`), drop the prefix cache,
        resume; `keep` holds the shared buffers alive until the workers are done."""
        await self._post("POST", "/pause", params={"mode": "wait"})
        try:
            reports = await self._rpc("nvfp4_apply_shared", json.dumps(spec), str(version))
            await self._post("POST", "/reset_prefix_cache")
        finally:
            await self._post("POST", "/resume")
        del keep
        report = reports[0] if isinstance(reports[0], dict) else {"report": reports[0]}
        return {**report, "stage_seconds": stage_seconds, "copied_bytes": self.last_copied_bytes}

    async def apply_fused(self, entries: list, version: int) -> dict:
        """A planned update: the fused table (one row per fused entry, hundreds per model, not one
        per checkpoint tensor) and its part tensors, views of the staged buckets, shared as in
        `apply_update`; the workers write each fused entry with one copy per tensor kind
        (`nvfp4_apply_shared` with "fused")."""
        t0 = time.perf_counter()

        def spec_of():
            named = {f"{e.name}#{k}": t for e in entries for k, t in e.tensors.items()}
            spec, keep = self._shared_spec(named, cuda_storages=True)
            spec["fused"] = [[e.name, e.layout, [s.to_list() for s in e.slots]] for e in entries]
            return spec, keep

        spec, keep = await asyncio.to_thread(spec_of)
        report = await self._hand_over(spec, keep, version, stage_seconds=time.perf_counter() - t0)
        return {**report, "fused_rows": len(spec["fused"])}

    async def logprobs(self, req: LogprobsRequest) -> list[SequenceLogprobs]:
        body = {"model": self.model_id, "prompt": req.sequences, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": req.top_k, "return_tokens_as_token_ids": True}
        choices = sorted((await self._post("POST", "/v1/completions", json=body)).json()["choices"],
                         key=lambda c: c["index"])
        return [_sequence_logprobs(seq, p, c["prompt_logprobs"], req.top_k)
                for seq, p, c in zip(req.sequences, req.prompt_lens, choices)]

    async def openai(self, route: str, body: dict) -> tuple[int, dict]:
        if route == "models":
            r = await self.http.get("/v1/models")
        else:
            r = await self.http.post(f"/v1/{route}", json=body)
        try:
            return r.status_code, r.json()
        except json.JSONDecodeError:
            return 502, {"error": {"message": f"vLLM answered {r.status_code}: {r.text[:500]}"}}


    async def openai_stream(self, route: str, body: dict) -> tuple[int, AsyncIterator[bytes] | dict]:
        """vLLM's own server-sent events, passed through as they arrive."""
        r = await self.http.send(self.http.build_request("POST", f"/v1/{route}", json=body), stream=True)
        if r.status_code != 200:
            text = await r.aread()
            await r.aclose()
            try:
                return r.status_code, json.loads(text)
            except json.JSONDecodeError:
                return 502, {"error": {"message": f"vLLM answered {r.status_code}: {text[:500]!r}"}}

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return 200, events()


def _sequence_logprobs(seq: list[int], prompt_len: int, prompt_logprobs: list, k: int) -> SequenceLogprobs:
    """vLLM's prompt_logprobs (position t: {token id: {logprob, rank}}; first None) -> response tokens."""
    out = SequenceLogprobs(logprobs=[prompt_logprobs[t][str(seq[t])]["logprob"] for t in range(prompt_len, len(seq))])
    if k:
        tops = [sorted(((v["rank"], int(tok), v["logprob"]) for tok, v in prompt_logprobs[t].items()
                        if v["rank"] <= k))[:k] for t in range(prompt_len, len(seq))]
        out.top_ids = [[tok for _, tok, _ in row] for row in tops]
        out.top_logprobs = [[lp for _, _, lp in row] for row in tops]
    return out
