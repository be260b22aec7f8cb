"""The trainer side of a weight push: a source streamed as sampler buckets with bounded host memory.

    plan = push.plan(model.state_dict(), layout="nvfp4", config=hf_config)   # manifest, no data read
    with push.Pipeline(plan) as host_buckets:                                # background producer
        for bucket in host_buckets: ...                                      # CPU tensors, wire dtypes

A producer thread runs `converters.iter_buckets` on the device each tensor lives on (CUDA: the
Triton quantizer; CPU: `kernels.cpu_quant`), copies each GPU bucket into one of two reusable pinned
host buffers and hands it over; conversion and device-to-host copy of bucket i+1 overlap the send
of bucket i. At most `slots` (2) buckets exist on the host at a time (the one being sent and the
one being prepared), never the whole model. Folder sources stream the same way, shard by shard.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from nvfp4_sampler.converters.convert import ConvertOptions, iter_buckets, output_specs
from nvfp4_sampler.converters.sources import SafetensorsFolder, StateDictSource
from nvfp4_sampler.sampler_format import Recipe

from .protocol import TensorEntry
from .wire import WIRE_DTYPES, encode_frame

DEFAULT_BUCKET_BYTES = 512 << 20
LAYOUTS = ("nvfp4", "bf16")
_ALIGN = 64                           # byte alignment of each tensor in a pinned staging buffer
_DENSE = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a push sends: the converter source and options, the manifest (entry per logical tensor,
    NVFP4 triplets by their P.weight), the dense wire dtype (bf16 layout: every tensor BF16) and the
    CUDA device conversion runs on (None: CPU)."""

    source: SafetensorsFolder | StateDictSource
    options: ConvertOptions
    entries: dict[str, TensorEntry]
    dense_dtype: torch.dtype | None
    cuda_device: torch.device | None


def plan(source: str | Path | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
         layout: str = "nvfp4", config: dict | None = None, recipe: Recipe = Recipe(),
         shared_group_scale: bool = False, device: str | None = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The manifest of pushing `source` (a HF folder, a checkpoint-named mapping, or (name, tensor)
    pairs, kept as references) under `layout`, checked from names, shapes and dtypes only.

    layout "nvfp4": quantized linears become NVFP4 triplets (converted on `device`, default where each
    tensor lives), other tensors go dense in their dtype; "bf16": every tensor goes dense as BF16 and
    the sampler quantizes on arrival. config: the model's HF config dict (a folder has config.json).
    recipe (a `sampler_format.Recipe`), shared_group_scale: the conversion's (`converters.ConvertOptions`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(source, (str, Path)):
        src = SafetensorsFolder(source)
    else:
        if config is None:
            raise ValueError("pushing an in-memory state dict needs the model's HF config dict (config=...)")
        src = StateDictSource(source if isinstance(source, Mapping) else dict(source), config=config)
    if layout == "bf16":
        for name, _, dtype in src.specs():
            if dtype not in _DENSE:
                raise ValueError(f"{name}: layout bf16 needs float tensors, got {dtype or 'NVFP4'}; "
                                 f"push NVFP4 sources with layout nvfp4")
    options = ConvertOptions(recipe=recipe, shared_group_scale=shared_group_scale, device=device,
                             bucket_bytes=bucket_bytes, report=False, quantize=layout == "nvfp4")
    entries = {}
    for name, shape, dtype in output_specs(src, options):
        if dtype is None:
            entries[name] = TensorEntry(name=name, layout="nvfp4", dtype="nvfp4", shape=list(shape))
        elif dtype in _DENSE:
            wire = WIRE_DTYPES[torch.bfloat16 if layout == "bf16" else dtype]
            entries[name] = TensorEntry(name=name, layout="dense", dtype=wire, shape=list(shape))
        else:
            raise ValueError(f"{name}: dtype {dtype} cannot be sent dense (bfloat16, float16 or float32)")
    if device is not None:
        cuda = torch.device(device) if torch.device(device).type == "cuda" else None
    else:
        cuda = next((t.device for _, t in src.tensors() if isinstance(t, torch.Tensor) and t.is_cuda), None) \
            if isinstance(src, StateDictSource) else None
    return Plan(src, options, entries, torch.bfloat16 if layout == "bf16" else None, cuda)


class _PinnedSlots:
    """Reusable pinned host buffers (flat uint8, grown to the largest bucket) that GPU buckets are
    copied into; slot i is reused only after its previous bucket was sent (Pipeline's semaphore)."""

    def __init__(self, count: int):
        self.buffers: list[torch.Tensor | None] = [None] * count

    def stage(self, bucket: dict[str, torch.Tensor], slot: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Host copies of `bucket` (cast to `dtype` if given) as views of pinned buffer `slot`."""
        layout, offset = [], 0
        for name, t in bucket.items():
            out_dtype = dtype or t.dtype
            layout.append((name, t, out_dtype, offset))
            offset += -(-t.numel() * out_dtype.itemsize // _ALIGN) * _ALIGN
        buf = self.buffers[slot]
        if buf is None or buf.numel() < offset:
            self.buffers[slot] = buf = None                      # free the smaller one first
            self.buffers[slot] = buf = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
        host = {}
        for name, t, out_dtype, off in layout:
            view = buf[off:off + t.numel() * out_dtype.itemsize].view(out_dtype).view(t.shape)
            view.copy_(t, non_blocking=True)
            host[name] = view
        torch.cuda.current_stream().synchronize()
        return host


class Pipeline:
    """Iterate host buckets of `plan` (only the entries in `only`, default all) produced by a
    background thread; at most `slots` buckets are alive at a time. Use as a context manager (the
    thread stops on exit). `prepare_seconds`: the producer's busy time (conversion + staging)."""

    def __init__(self, plan: Plan, *, only: Collection[str] | None = None, slots: int = 2):
        self.plan, self.only = plan, only
        self.prepare_seconds = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._free = threading.Semaphore(slots)
        self._stop = threading.Event()
        self._pinned = _PinnedSlots(slots)
        self._thread = threading.Thread(target=self._produce, name="push-producer", daemon=True)

    def __enter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._thread.start()
        return self._consume()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._free.release()                                      # wake a producer waiting for a slot
        self._thread.join()

    def _produce(self) -> None:
        try:
            if self.plan.cuda_device is not None:                 # this thread's kernels run on that GPU
                torch.cuda.set_device(self.plan.cuda_device)
            buckets = iter_buckets(self.plan.source, self.plan.options, only=self.only)
            slot = 0
            while True:
                self._free.acquire()
                if self._stop.is_set():
                    return
                start = time.perf_counter()
                bucket = next(buckets, None)
                if bucket is None:
                    break
                if any(t.device.type == "cuda" for t in bucket.values()):
                    bucket = self._pinned.stage(bucket, slot, self.plan.dense_dtype)
                elif self.plan.dense_dtype is not None:
                    bucket = {n: t.to(self.plan.dense_dtype) for n, t in bucket.items()}
                self.prepare_seconds += time.perf_counter() - start
                self._queue.put(bucket)
                bucket, slot = None, (slot + 1) % len(self._pinned.buffers)
            self._queue.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put(e)

    def _consume(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            item = None
            self._free.release()                                  # the caller is done with that bucket


def frames(bucket: Mapping[str, torch.Tensor], entries: Mapping[str, TensorEntry]) -> Iterator[memoryview | bytes]:
    """The frames of every manifest entry in a host bucket (payload buffers are views, not copies)."""
    for name in bucket:
        entry = entries.get(name)
        if entry is not None:
            yield from encode_frame(entry, bucket)
