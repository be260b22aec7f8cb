"""In-place weight reload for a running vLLM engine (`--worker-extension-cls`).

  LLM(model, quantization="nvfp4_sampler",
      worker_extension_cls="nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension")
  llm.collective_rpc("nvfp4_apply_update", args=(staged_path, version))
  llm.reset_prefix_cache()        # cached KV blocks were computed with the old weights

or over HTTP with `VLLM_SERVER_DEV_MODE=1`: POST /collective_rpc
{"method": "nvfp4_apply_update", "args": [staged_path, "7"]}, then POST /reset_prefix_cache.
Without a file: `nvfp4_apply_shared(spec, version)` takes the tensors as views of buffers the caller
shares by handle (shared memory or CUDA IPC; `sampler_plugin.shared_buffers`), as the sidecar does;
an in-process engine core takes planned entries as they are (`nvfp4_apply_fused`, `server.colocated`).

The staged file is a safetensors file of checkpoint-named tensors (docs/ARCHITECTURE.md, "Weight
updates"): BF16 `P.weight` (quantized on arrival) or NVFP4 triplets, any subset, including a single
shard of a fused layer or one expert's projection; plus BF16 tensors that vLLM keeps under their
checkpoint names (norms, embeddings, lm_head, MoE routers). Everything is validated before anything
is written, and written into the existing parameters (shapes and addresses never change).
"""
from __future__ import annotations

import json
import time

import torch
from safetensors.torch import load_file, save_file

from .. import commit, layers, shared_buffers
from ..core import ExpertsCore, is_nvfp4, reload_targets


def _refresh_plain_modules(model: torch.nn.Module, written: set[int]) -> None:
    """Re-run process_weights_after_loading of the non-NVFP4 modules whose tensors were rewritten: on
    CPU vLLM computes lm_head (and tied embeddings) from a packed copy made there."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or is_nvfp4(module):
            continue
        if any(p.data_ptr() in written for p in module.parameters(recurse=False)):
            method.process_weights_after_loading(module)


def _fused_entries(rows: list, views: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list]:
    """The "fused" table of `nvfp4_apply_shared` over the opened views: (checkpoint-named tensors
    that are not parts of a fused entry, [commit.FusedEntry])."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for name, t in views.items():
        entry, sep, kind = name.rpartition("#")
        if sep:
            parts.setdefault(entry, {})[kind] = t
        else:
            rest[name] = t
    entries = []
    for name, layout, slots in rows:
        if name not in parts:
            raise ValueError(f"nvfp4_sampler: {name}: a fused entry without its tensors")
        entries.append(commit.FusedEntry(name, layout, tuple(commit.FusedSlot.from_list(s) for s in slots),
                                         parts.pop(name)))
    if parts:
        raise ValueError(f"nvfp4_sampler: {next(iter(parts))}: tensors of no fused entry")
    return rest, entries


def vocab_rows(module: torch.nn.Module, pname: str) -> tuple[slice, int] | None:
    """(rows, checkpoint rows) of a vocab-parallel embedding's or head's weight on this rank (`reload_targets`'
    plain_rows): its part of the vocabulary, held in its first rows before the padding; None when it holds the
    checkpoint tensor as it is."""
    part = getattr(module, "shard_indices", None)
    if part is None or pname != "weight":
        return None
    rows, full = slice(part.org_vocab_start_index, part.org_vocab_end_index), module.org_vocab_size
    return None if (rows.start, rows.stop) == (0, full) and module.weight.shape[0] == full else (rows, full)


class NVFP4SamplerWorkerExtension:
    """Mixed into vLLM's worker class; methods run on every worker via `collective_rpc`."""

    def nvfp4_apply_update(self, staged_path: str, version: int | str) -> dict:
        """Load the safetensors file `staged_path` into the running model and set the weight version.

        Returns {"version", "tensors", "bytes", "seconds"}. Raises ValueError naming the first bad
        tensor (unknown name, wrong dtype or shape, incomplete NVFP4 triplet); nothing is written then.
        """
        start = time.perf_counter()
        return self._nvfp4_apply(load_file(staged_path), version, start)

    def nvfp4_apply_shared(self, spec: str | dict, version: int | str) -> dict:
        """Apply tensors the caller holds in shared buffers (no file): `spec` (a dict or its JSON) is
        {"buffers": [IpcHandle dicts: a shared-memory segment or a CUDA IPC handle],
         "tensors": [[checkpoint name, dtype, shape, buffer index, byte offset], ...]}.
        The tensors are views of the opened buffers (host memory -> this worker -> device, copied
        once into the parameters). Same validation, report and all-or-nothing rule as
        `nvfp4_apply_update`; the buffers are released on return.
        A planned update adds "fused": [[fused name, layout, [FusedSlot rows]], ...] (one row per
        fused entry, `commit.FusedEntry`), whose part tensors are the table's rows named
        "FUSED_NAME#KIND"; each entry that fills one parameter set exactly is written with one copy
        per tensor kind (`commit.apply_fused`)."""
        start = time.perf_counter()
        spec = json.loads(spec) if isinstance(spec, str) else spec
        buffers = [shared_buffers.open_buffer(h) for h in spec["buffers"]]
        try:
            tensors = shared_buffers.views(buffers, spec["tensors"])
            if spec.get("fused") is not None:
                rest, fused = _fused_entries(spec["fused"], tensors)
                return self._nvfp4_apply(rest, version, start, fused=fused)
            return self._nvfp4_apply(tensors, version, start)
        finally:
            if any(b.is_cuda for b in buffers):
                torch.cuda.synchronize()                 # copies out of the sender's memory are done
            del buffers

    def nvfp4_apply_fused(self, entries: list[commit.FusedEntry], version: int | str) -> dict:
        """Apply planned entries whose tensors live in this process (an in-process engine core, as
        colocated RL runs vLLM: `server.colocated`): same validation, report and all-or-nothing rule as
        `nvfp4_apply_shared` with "fused", without handles."""
        return self._nvfp4_apply({}, version, time.perf_counter(), fused=entries)

    def _nvfp4_apply(self, tensors: dict[str, torch.Tensor], version: int | str, start: float, *,
                     fused: list[commit.FusedEntry] = ()) -> dict:
        cache = self.__dict__.setdefault("_nvfp4_fused_plans", {})              # found once per entry (commit)

        def write(targets, config):
            if fused:
                return commit.apply_fused(targets, fused, config=config, tensors=tensors, cache=cache)
            return commit.apply_update(targets, tensors, config=config)

        report = self._nvfp4_write(write, version, start)
        report["bytes"] = (sum(t.numel() * t.element_size() for t in tensors.values())
                           + sum(t.numel() * t.element_size() for e in fused for t in e.tensors.values()))
        if fused:
            report["entries"] = len(fused)
            report["per_tensor_entries"] = commit.per_tensor_entries(cache)
        return report

    def _nvfp4_write(self, write, version: int | str, start: float) -> dict:
        """Run write(targets, config) -> checkpoint names written (all or nothing, `commit`) on this worker's
        model, refresh the plain modules it rewrote and set the weight version: {"version", "tensors",
        "seconds", "steps"} (host seconds by step; the writes' GPU time is not waited for)."""
        model = self.model_runner.model
        quant_config = self.vllm_config.quant_config
        if getattr(quant_config, "get_name", lambda: None)() != "nvfp4_sampler":
            raise ValueError("nvfp4_apply_update needs an engine started with quantization='nvfp4_sampler'")
        t0 = time.perf_counter()
        targets = self._nvfp4_targets()
        t1 = time.perf_counter()
        with torch.no_grad():
            names = write(targets, quant_config.sampler)
            t2 = time.perf_counter()
            _refresh_plain_modules(model, {targets[n].param.data_ptr() for n in names
                                           if n in targets and targets[n].param is not None})
        t3 = time.perf_counter()
        self.nvfp4_version = int(version)
        return {"version": self.nvfp4_version, "tensors": len(names), "seconds": t3 - start,
                "steps": {"targets": t1 - t0, "write": t2 - t1, "refresh": t3 - t2}}

    def _nvfp4_targets(self) -> dict[str, commit.Target]:
        return reload_targets(self.model_runner.model, vocab_rows)

    def nvfp4_save_state(self, path: str) -> int:
        """Write every reloadable tensor under its checkpoint name to the safetensors file `path`
        (NVFP4 triplets in the sampler checkpoint layout; rank-local with tensor parallelism: this rank's
        part of each, a "{rank}" in `path` taking the worker's rank). Returns the number of tensors written."""
        out: dict[str, torch.Tensor] = {}
        for name, target in self._nvfp4_targets().items():
            if target.param is not None:
                out[name] = target.held.clone()
            else:
                out.update({f"{name}.{k}": t for k, t in layers.read(target.weight, target.shard).items()})
        save_file(out, path.replace("{rank}", str(self.rank)))
        return len(out)

    def nvfp4_memory(self) -> dict:
        """{"layers", "bytes", "bf16_bytes", "ratio"} of the quantized layers as loaded."""
        m = self.vllm_config.quant_config.memory
        return {"layers": m.created, "bytes": m.nbytes, "bf16_bytes": m.bf16_nbytes, "ratio": m.ratio}

    def nvfp4_layers(self) -> dict:
        """{checkpoint prefix: {"op": "linear" | "moe", "backend", "strict"}} of every NVFP4 layer: the
        kernels backend chosen at load (`layer.nvfp4_backend`) and whether it runs the batch-invariant
        (strict) paths, e.g. {"model.layers.0.self_attn.qkv_proj": {"op": "linear", "backend":
        "hopper_mma", "strict": true}}."""
        return {m.quant_method.prefix: {"op": "moe" if isinstance(m.quant_method, ExpertsCore) else "linear",
                                        "backend": m.nvfp4_backend, "strict": m.quant_method.config.strict}
                for m in self.model_runner.model.modules() if is_nvfp4(m)}

    def nvfp4_weight_version(self) -> int:
        """Version set by the last successful nvfp4_apply_update (0 = the weights loaded at start)."""
        return getattr(self, "nvfp4_version", 0)
