"""Embedded engine: a transformers model made NVFP4 by `sampler_plugin.torch_modules`, in the sidecar.

For machines without vLLM. Every model access runs on one worker thread, so generation, log-prob
batches and weight updates never overlap. Log-prob requests queued while the worker is busy are
merged into one forward pass (up to `max_batch_tokens`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from nvfp4_sampler.kernels import NVFP4Tensor
from nvfp4_sampler.sampler_plugin import commit, layers
from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

from ..protocol import LogprobsRequest, SequenceLogprobs
from .base import Engine, EngineError, checkpoint_specs, sampler_config


def _reload_targets(model: torch.nn.Module, replaced: dict[str, str]) -> dict[str, commit.Target]:
    """Checkpoint name -> commit.Target of a `quantize_model`-ed transformers model: NVFP4 linears and
    each expert projection by module prefix, their biases and every other parameter by its full name."""
    targets: dict[str, commit.Target] = {}
    for name, kind in replaced.items():
        mod = model.get_submodule(name)
        if kind == "linear":
            n, k = mod.codes.shape[0], mod.codes.shape[1] * 2
            targets[name] = commit.Target(weight=mod.weight(), shard=layers.Shard(name, (n, k), slice(0, n)))
            if mod.bias is not None:                  # a plain tensor beside the NVFP4 weight
                targets[f"{name}.bias"] = commit.Target(param=mod.bias.data)
            continue
        w13, w2 = (NVFP4Tensor(*p) for p in (mod.w13, mod.w2))
        experts, hidden, inter = w2.codes.shape[0], w2.codes.shape[1], w2.codes.shape[2] * 2
        for e in range(experts):
            for sid, shard in layers.expert_shards(name, e, hidden=hidden, inter=inter).items():
                targets[shard.name] = commit.Target(weight=w2 if sid == "w2" else w13, shard=shard)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.rpartition(".")[0] not in replaced and not name.startswith(tuple(f"{r}." for r in replaced)):
            targets[name] = commit.Target(param=p.data)
    return targets


class _Streamer:
    """transformers streamer: each new token's ids go to an asyncio queue (None at the end); the
    first `put` is the prompt and is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())
        self.prompt_seen = True

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class _Stop:
    """transformers stopping criterion: True for every row once `event` is set."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class EmbeddedEngine(Engine):
    kind = "embedded"

    def __init__(self, model_dir: str | Path, *, max_batch_tokens: int = 16384, device: str = "cpu",
                 profile_commits: Path | None = None):
        """device: where the model runs ("cuda" uses the Triton kernels; IPC buckets stay on it).
        profile_commits: a folder for each commit's torch-profiler table (`Settings.profile_commits`)."""
        self.device = torch.device(device)
        self.profile_commits = profile_commits
        self.model_dir = Path(model_dir)
        self.model_id = str(self.model_dir)
        self.max_batch_tokens = max_batch_tokens
        self.specs = checkpoint_specs(self.model_dir)
        self.config = sampler_config(self.model_dir)
        self._version = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-engine")
        self._queue: list[tuple[LogprobsRequest, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self._run(self._load)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _load(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.initialization import no_init_weights

        hf_config = AutoConfig.from_pretrained(self.model_dir)
        if hasattr(hf_config, "quantization_config"):
            del hf_config.quantization_config
        # built without random initialization (its BF16 pages never touched), its linears and experts
        # replaced by NVFP4 storage on the device, the rest moved there: the checkpoint writes every weight
        # next (a 48-layer 30B-A3B spent minutes in BF16 init, copy and quantization of values it then overwrote)
        with no_init_weights():
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
        replaced = quantize_model(self.model, self.config, weights=False, device=self.device)
        self.model.to(self.device).tie_weights()      # (no_init_weights skips init_weights, which ties them)
        self.targets = _reload_targets(self.model, replaced)
        self._fused_plans: dict = {}                  # commit.apply_fused's write plans (targets never change)
        state = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            state |= load_file(f, device=str(self.device))
        tracker = layers.LoadTracker(t.shard for t in self.targets.values() if t.shard is not None)
        for name, tensor in state.items():
            prefix, kind = commit.split_name(name)
            if (target := self.targets.get(prefix)) is not None and target.shard is not None:
                tracker.record(target.shard, kind, tensor)
        try:
            tracker.check()
        except ValueError as e:
            raise EngineError(f"{self.model_dir}: the checkpoint leaves quantized modules unwritten: {e}",
                              status=422) from e
        self._write(state)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    # ------------------------------------------------------------------ updates
    async def weight_version(self) -> int:
        return self._version

    async def apply_update(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        return await self._run(self._apply, tensors, version)

    def _apply(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        t0 = time.perf_counter()
        with self._profiled(version):
            n = self._write(tensors)
        self._version = version
        return {"tensors": n, "seconds": time.perf_counter() - t0}

    async def apply_fused(self, entries: list[commit.FusedEntry], version: int) -> dict:
        return await self._run(self._apply_fused, entries, version)

    def _apply_fused(self, entries: list[commit.FusedEntry], version: int) -> dict:
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), self._profiled(version):
                n = len(commit.apply_fused(self.targets, entries, config=self.config, cache=self._fused_plans))
        except ValueError as e:
            raise EngineError(str(e), status=422) from e
        self._version = version
        return {"tensors": n, "entries": len(entries), "seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def _profiled(self, version: int):
        """A commit under the torch profiler where `profile_commits` is set (its GPU work waited for, so the
        table holds all of it): the operators and kernels by time to `commit-<version>.txt` there."""
        if self.profile_commits is None:
            yield
            return
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            yield
            if cuda:
                torch.cuda.synchronize(self.device)
        table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=40)
        self.profile_commits.mkdir(parents=True, exist_ok=True)
        (self.profile_commits / f"commit-{version}.txt").write_text(table)

    def _write(self, tensors: dict[str, torch.Tensor]) -> int:
        """Validate every checkpoint-named tensor, then write them all (commit.apply_update)."""
        try:
            with torch.no_grad():
                return len(commit.apply_update(self.targets, tensors, config=self.config))
        except ValueError as e:
            raise EngineError(str(e), status=422) from e

    # ------------------------------------------------------------------ log-probs (batched)
    def queue_depth(self) -> int:
        return len(self._queue)

    async def logprobs(self, req: LogprobsRequest) -> list[SequenceLogprobs]:
        vocab = self.model.get_output_embeddings().weight.shape[0]
        bad = [i for i, s in enumerate(req.sequences) if max(s) >= vocab]
        if bad:
            raise EngineError(f"sequence {bad[0]}: token id >= vocab size {vocab}", status=422)
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((req, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._queue:
            batch, tokens = [], 0
            while self._queue and (not batch or tokens + sum(map(len, self._queue[0][0].sequences))
                                   <= self.max_batch_tokens):
                batch.append(self._queue.pop(0))
                tokens += sum(map(len, batch[-1][0].sequences))
            seqs = [(s, p, r.top_k) for r, _ in batch for s, p in zip(r.sequences, r.prompt_lens)]
            try:
                out = await self._run(self._score, seqs)
            except Exception as e:  # noqa: BLE001 - the error belongs to the waiting requests
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            i = 0
            for r, fut in batch:
                fut.set_result(out[i:i + len(r.sequences)])
                i += len(r.sequences)

    @torch.no_grad()
    def _score(self, seqs: list[tuple[list[int], int, int]]) -> list[SequenceLogprobs]:
        """One padded forward pass; log-probs of seq[p:] from positions p-1 .. len-2 (fp32 log-softmax)."""
        length = max(len(s) for s, _, _ in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, (s, _, _) in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        hidden = self.model.get_decoder()(input_ids=ids.to(self.device),
                                          attention_mask=mask.to(self.device)).last_hidden_state
        head = self.model.get_output_embeddings()
        results = []
        for i, (s, p, k) in enumerate(seqs):
            logp = torch.log_softmax(head(hidden[i, p - 1:len(s) - 1]).float(), dim=-1)   # [T, V]
            target = torch.tensor(s[p:], device=self.device)
            res = SequenceLogprobs(logprobs=logp.gather(1, target[:, None])[:, 0].tolist())
            if k:
                top = logp.topk(k, dim=-1)
                res.top_ids, res.top_logprobs = top.indices.tolist(), top.values.tolist()
            results.append(res)
        return results

    # ------------------------------------------------------------------ OpenAI-compatible routes
    async def openai(self, route: str, body: dict) -> tuple[int, dict]:
        if route == "models":
            return 200, {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                      "owned_by": "nvfp4-sampler", "root": self.model_id}]}
        if body.get("model") not in (None, self.model_id):
            return 404, {"error": {"message": f"model {body.get('model')!r} not found; serving {self.model_id!r}",
                                   "type": "invalid_request_error"}}
        if route == "completions":
            return 200, await self._run(self._completion, body)
        if route == "chat/completions":
            return 200, await self._run(self._chat, body)
        return 404, {"error": {"message": f"unknown route {route}", "type": "invalid_request_error"}}

    async def openai_stream(self, route: str, body: dict) -> tuple[int, AsyncIterator[bytes] | dict]:
        """Server-sent events: one chunk per decoded piece of text as the worker thread samples it."""
        if body.get("model") not in (None, self.model_id):
            return 404, {"error": {"message": f"model {body.get('model')!r} not found; serving {self.model_id!r}",
                                   "type": "invalid_request_error"}}
        if route not in ("completions", "chat/completions"):
            return 404, {"error": {"message": f"unknown route {route}", "type": "invalid_request_error"}}
        chat = route == "chat/completions"
        try:
            prompt = self._chat_prompt(body) if chat else self._completion_prompt(body)
        except EngineError as e:
            return e.status, {"error": {"message": str(e), "type": "invalid_request_error"}}
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        job = asyncio.ensure_future(self._run(self._generate, prompt, body, _Streamer(loop, queue), stop))
        return 200, self._events(chat=chat, job=job, queue=queue, stop=stop)

    async def _events(self, *, chat: bool, job: asyncio.Future, queue: asyncio.Queue,
                      stop: threading.Event) -> AsyncIterator[bytes]:
        oid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        def event(piece: str | None, finish: str | None, *, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            chunk = {"id": oid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": self.model_id, "choices": [choice]}
            return f"data: {json.dumps(chunk)}\n\n".encode()

        try:
            if chat:
                yield event(None, None, first=True)
            ids, sent, text = [], "", ""
            while (tokens := await queue.get()) is not None:
                ids += [t for t in tokens if not chat or t != self.tokenizer.eos_token_id]
                text = self.tokenizer.decode(ids, skip_special_tokens=chat)
                if text.endswith("\ufffd") or len(text) <= len(sent):     # wait: an incomplete UTF-8 sequence
                    continue
                yield event(text[len(sent):], None)
                sent = text
            if len(text) > len(sent):
                yield event(text[len(sent):], None)
            _, _, finish = await job
            yield event(None, finish)
            yield b"data: [DONE]\n\n"
        finally:
            stop.set()                                       # a client that left stops the sampling

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt", "")
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def _chat_prompt(self, body: dict) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise EngineError(f"{self.model_id}: the tokenizer has no chat template; use /v1/completions",
                              status=400)
        prompt_ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        return list(prompt_ids)

    @torch.no_grad()
    def _generate(self, prompt: list[int], body: dict, streamer=None,
                  stop: threading.Event | None = None) -> tuple[list[int], list[torch.Tensor], str]:
        """Sample up to max_tokens after `prompt` -> (token ids, fp32 log-softmax rows [V] each, finish reason).
        streamer: a transformers streamer fed the prompt, then each new token; stop: ends sampling when set."""
        from transformers import StoppingCriteriaList

        temperature = float(body.get("temperature", 1.0) or 0.0)
        if body.get("seed") is not None:
            torch.manual_seed(int(body["seed"]))
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        out = self.model.generate(
            torch.tensor([prompt], device=self.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=self.device),
            max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or None,
            top_p=body.get("top_p") or None, top_k=None, output_logits=True, return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id, streamer=streamer,
            stopping_criteria=StoppingCriteriaList([_Stop(stop)]) if stop is not None else None)
        ids = out.sequences[0, len(prompt):].tolist()
        rows = [torch.log_softmax(lg[0].float(), dim=-1) for lg in out.logits]
        finish = "length" if len(ids) >= max_tokens and ids[-1] != self.tokenizer.eos_token_id else "stop"
        return ids, rows, finish

    def _completion(self, body: dict) -> dict:
        prompt_ids = self._completion_prompt(body)
        ids, rows, finish = self._generate(prompt_ids, body)
        choice = {"index": 0, "text": self.tokenizer.decode(ids), "finish_reason": finish, "logprobs": None}
        if body.get("return_token_ids"):          # vLLM's extension: the sampled token ids
            choice["token_ids"] = ids
        if body.get("logprobs") is not None:
            k = int(body["logprobs"])
            toks = [self.tokenizer.decode([t]) for t in ids]
            choice["logprobs"] = {
                "tokens": toks, "token_logprobs": [float(r[t]) for r, t in zip(rows, ids)],
                "top_logprobs": [{self.tokenizer.decode([int(j)]): float(v) for v, j in zip(*r.topk(k))}
                                 for r in rows] if k else None,
                "text_offset": [sum(map(len, toks[:i])) for i in range(len(toks))]}
        return self._envelope("text_completion", choice, len(prompt_ids), len(ids))

    def _chat(self, body: dict) -> dict:
        prompt_ids = self._chat_prompt(body)
        ids, rows, finish = self._generate(prompt_ids, body)
        content_ids = [t for t in ids if t != self.tokenizer.eos_token_id]
        choice = {"index": 0, "finish_reason": finish, "logprobs": None,
                  "message": {"role": "assistant", "content": self.tokenizer.decode(content_ids,
                                                                                    skip_special_tokens=True)}}
        if body.get("logprobs"):
            k = int(body.get("top_logprobs") or 0)

            def item(tok: int, lp: float) -> dict:
                s = self.tokenizer.decode([tok])
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            choice["logprobs"] = {"content": [
                {**item(t, float(r[t])), "top_logprobs": [item(int(j), float(v)) for v, j in zip(*r.topk(k))]}
                for r, t in zip(rows, ids)]}
        return self._envelope("chat.completion", choice, len(prompt_ids), len(ids))

    def _envelope(self, obj: str, choice: dict, n_prompt: int, n_out: int) -> dict:
        return {"id": f"{obj.split('.')[0]}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": self.model_id, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}
