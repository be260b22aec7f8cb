"""What the sidecar needs from an engine, and the tensor table an update is validated against."""
from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from safetensors import safe_open

from nvfp4_sampler.sampler_format import BLOCK, SCALE, SCALE_2, WEIGHT, SamplerConfig, is_nvfp4_weight

from ..protocol import DENSE_DTYPES, LogprobsRequest, SequenceLogprobs, TensorEntry

_SCALE_SUFFIXES = (f".{SCALE}", f".{SCALE_2}", ".input_scale")


class EngineError(RuntimeError):
    """The engine refused or failed an operation; `status` is the HTTP status to answer."""

    def __init__(self, message: str, *, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor an update may carry: checkpoint `name`, logical `shape`; `quantized` NVFP4 linears
    accept dense (quantized on arrival) and nvfp4 layouts, everything else dense only."""

    name: str
    shape: tuple[int, ...]
    quantized: bool

    def check(self, entry: TensorEntry) -> str | None:
        """None if `entry` fits this tensor, else a message naming the problem."""
        if tuple(entry.shape) != self.shape:
            return f"{entry.name}: shape {entry.shape} does not match the model's {list(self.shape)}"
        if entry.layout == "nvfp4" and not self.quantized:
            return f"{entry.name}: this tensor is not quantized by the sampler; send it dense"
        if entry.layout == "dense" and entry.dtype not in DENSE_DTYPES:
            return f"{entry.name}: dtype {entry.dtype} is not a float dtype"
        return None


def sampler_config(model_dir: str | Path) -> SamplerConfig:
    """The checkpoint's nvfp4_sampler quantization_config, or the defaults (online quantization)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    return SamplerConfig.from_dict(qc) if qc else SamplerConfig()


def checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """The update table of a BF16 or pre-quantized sampler checkpoint, from its safetensors headers.

    A 2-D `P.weight` whose module P is quantized under the checkpoint's SamplerConfig (and K % 16 == 0)
    is quantized; its NVFP4 scales are not separate entries (they travel inside an nvfp4 frame).
    """
    config = sampler_config(model_dir)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                shapes[name] = (tuple(sl.get_shape()), sl.get_dtype())
    specs = {}
    for name, (shape, dtype) in shapes.items():
        if name.endswith(_SCALE_SUFFIXES):
            continue
        if dtype == "U8" and name.endswith(f".{WEIGHT}"):               # pre-quantized triplet
            specs[name] = TensorSpec(name, (shape[0], shape[1] * 2), True)
        else:
            quantized = is_nvfp4_weight(name, config) and len(shape) == 2 and shape[1] % BLOCK == 0
            specs[name] = TensorSpec(name, shape, quantized)
    return specs


class Engine(abc.ABC):
    """An inference engine behind the sidecar. Every call is made while the app holds its
    read lock (serving) or write lock (`apply_update`), so calls never interleave with an update."""

    kind: str
    model_id: str
    specs: dict[str, TensorSpec]

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def weight_version(self) -> int: ...

    @abc.abstractmethod
    async def apply_update(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Write checkpoint-named tensors (CPU, or on the engine's device) into the running model and
        set the weight version; names, dtypes and shapes are validated before anything is written
        (values were checked on arrival). Returns a report; "stage_seconds" in it, if any, is the
        time spent handing the tensors over (e.g. writing a file) before the engine applied them."""

    async def apply_fused(self, entries: list, version: int) -> dict:
        """A planned update's fused entries (`sampler_plugin.commit.FusedEntry`, views of the staged
        buckets): same contract as `apply_update`. This default hands over their checkpoint-named
        members; an engine that can writes each fused entry with one copy per tensor kind."""
        return await self.apply_update({k: t for e in entries for k, t in e.members().items()}, version)

    @abc.abstractmethod
    async def logprobs(self, req: LogprobsRequest) -> list[SequenceLogprobs]: ...

    @abc.abstractmethod
    async def openai(self, route: str, body: dict) -> tuple[int, dict]:
        """An OpenAI-compatible call (route "models", "completions" or "chat/completions") -> (status, JSON)."""

    @abc.abstractmethod
    async def openai_stream(self, route: str, body: dict) -> tuple[int, AsyncIterator[bytes] | dict]:
        """A streaming OpenAI call (`"stream": true`, route "completions" or "chat/completions"):
        (200, server-sent-event bytes ending with `data: [DONE]`) or (error status, JSON error)."""

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 [nbytes] CPU buffer for an update's staging area (an engine in another
        process allocates it in shared memory, so the commit hands it over without a copy)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def queue_depth(self) -> int:
        return 0
