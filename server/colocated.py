"""Colocated refit: the trainer and a vLLM engine in one process on the same GPU (TRL's and verl's
colocate modes), with no sidecar, no handles and no files.

    refit = ColocatedRefit(llm, trainer_state, config=hf_config)   # once per run: plan, sender, buffers
    report = refit.update(version)                                  # every RL step: all or nothing

The planned protocol (`server.plan`, `server.planned`) without transport: each bucket of the plan is
quantized straight into its own buffer on the trainer's device (one call per fused expert tensor;
the buffers stay allocated across updates: the model's NVFP4 size), NaN/Inf are checked on the device
(one host sync per update: nothing is written when a source is not finite), then the engine's worker
writes the fused entries into its parameters (`nvfp4_apply_fused`: one copy per tensor kind of an
entry) and the prefix cache is dropped. `trainer_state` maps checkpoint names to the trainer's live
tensors (read at every update). Needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
as colocated RL frameworks start vLLM) and the worker extension (`worker_extension_cls`).
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from nvfp4_sampler.sampler_format import Recipe

from . import push
from .planned import InvalidSource, PlannedSender


class ColocatedRefit:
    """Planned updates of an in-process vLLM engine (`llm`, started with quantization="nvfp4_sampler"
    and the worker extension) from `tensors` (checkpoint-named float tensors, on their devices);
    config: the model's HF config dict; recipe: the engine's (`SamplerConfig.recipe`)."""

    def __init__(self, llm, tensors: Mapping[str, torch.Tensor], *, config: dict, recipe: Recipe = Recipe(),
                 bucket_bytes: int = push.DEFAULT_BUCKET_BYTES):
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if client is None or type(client).__name__ != "InprocClient":
            raise ValueError("ColocatedRefit needs vLLM's engine core in this process: start the LLM with "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 (as colocated RL runs it), or push through the sidecar")
        self.llm = llm
        self.sender = PlannedSender.of(tensors, config=config, recipe=recipe, bucket_bytes=bucket_bytes)
        self.plan = self.sender.plan
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"trainer tensors on several devices {sorted(map(str, devices))}: one device expected")
        device = devices.pop()
        self.buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in self.plan.buckets]

    def update(self, version: int) -> dict:
        """Quantize every bucket, check, write, drop the prefix cache. Returns the worker's report plus
        "convert_seconds" (enqueueing the conversion), "check_seconds" (waiting for it), "worker_seconds"
        (the worker's write, host time; its "steps" split it) and "seconds" (all).
        Raises InvalidSource (nothing written) when a source tensor holds NaN or Inf."""
        t0 = time.perf_counter()
        ready = [self.sender.fill(b, buf) for b, buf in enumerate(self.buffers)]
        t1 = time.perf_counter()
        if ready and ready[-1].event is not None:
            ready[-1].event.synchronize()                      # the one host sync: every bucket is filled
        bad = next((b for b, r in enumerate(ready) if bool(r.flag)), None)
        t2 = time.perf_counter()
        if bad is not None:
            raise InvalidSource(self.sender.find_invalid(bad))
        entries = [e for b, buf in enumerate(self.buffers) for e in self.plan.fused_entries(b, buf)]
        report = self.llm.collective_rpc("nvfp4_apply_fused", args=(entries, version))[0]
        self.llm.reset_prefix_cache()
        return {**report, "convert_seconds": t1 - t0, "check_seconds": t2 - t1, "worker_seconds": report["seconds"],
                "seconds": time.perf_counter() - t0}
