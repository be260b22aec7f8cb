"""Where learner tensors come from: lazily, one tensor in memory at a time.

A source has
  config        the model's HF config dict (config.json)
  specs()       (name, logical shape, dtype) of every tensor without reading data, or None when
                unknown before iterating (a one-shot iterator)
  tensors(names=None)  iterator of (name, value), all or only those named (the others are not
                read); value is a torch.Tensor, an NVFP4Tensor (already in the sampler format) or
                a TENVFP4Weight (TransformerEngine storage)
  extra_files() files to copy next to the converted weights (tokenizer, generation config, ...)
  nbytes        total bytes of the source tensors (for throughput)
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open

from nvfp4_sampler.kernels.format import BLOCK, SWIZZLE_COLS, SWIZZLE_ROWS, NVFP4Tensor
from nvfp4_sampler.kernels.reference import decode_scale_from_amax, unswizzle_scales_128x4

from . import schema

# safetensors dtype strings (header) -> torch dtypes
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TENVFP4Weight:
    """A weight [M, K] as TransformerEngine's NVFP4Tensor stores it (row-wise part).

    data       uint8 [M, K/2]: E2M1 codes, even element in the low nibble (`_rowwise_data`)
    scale_inv  uint8 or float8_e4m3fn [roundup(M, 128), roundup(K/16, 4)]: E4M3 block scales
               (`_rowwise_scale_inv`), zero/garbage padded. TE keeps them plain row-major
               ("compact") unless the quantizer had `optimize_for_gemm`; then they are already in
               the 128x4 GEMM swizzle and `with_gemm_swizzled_scales` is True.
    amax       float32 [1] or []: max|w| (`_amax_rowwise`), from which S_dec = 1 / (2688 / amax)
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    with_gemm_swizzled_scales: bool = False

    @classmethod
    def from_te(cls, t: Any) -> "TENVFP4Weight":
        """From a TE NVFP4Tensor / NVFP4TensorStorage (read through its storage attributes)."""
        if t._rowwise_data is None:
            raise ValueError("TE NVFP4 tensor has no row-wise data (columnwise-only usage); quantize it row-wise")
        return cls(t._rowwise_data, t._rowwise_scale_inv, t._amax_rowwise, bool(t._with_gemm_swizzled_scales))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] * 2)

    def to_nvfp4(self, name: str) -> NVFP4Tensor:
        """The same codes and scales in the sampler layout (a byte copy: no value changes)."""
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{name}: TE data must be uint8 [M, K/2], got {self.data.dtype} {tuple(self.data.shape)}")
        m, k = self.shape
        if k % BLOCK:
            raise ValueError(f"{name}: K={k} is not a multiple of {BLOCK}")
        padded = (_roundup(m, SWIZZLE_ROWS), _roundup(k // BLOCK, SWIZZLE_COLS))
        if tuple(self.scale_inv.shape) != padded or self.scale_inv.dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise ValueError(f"{name}: TE scale_inv must be uint8/float8_e4m3fn {list(padded)} for data "
                             f"{list(self.data.shape)}, got {self.scale_inv.dtype} {list(self.scale_inv.shape)}")
        if self.amax.dtype != torch.float32 or self.amax.numel() != 1:
            raise ValueError(f"{name}: TE amax must be one float32, got {self.amax.dtype} {list(self.amax.shape)}")
        scales = self.scale_inv.view(torch.float8_e4m3fn)
        if self.with_gemm_swizzled_scales:
            scales = unswizzle_scales_128x4(scales, m, k // BLOCK)
        else:
            scales = scales[:m, :k // BLOCK].contiguous()
        return NVFP4Tensor(self.data.contiguous(), scales, decode_scale_from_amax(self.amax.reshape(())))


SourceValue = Union[torch.Tensor, NVFP4Tensor, TENVFP4Weight]


def value_spec(value: SourceValue) -> tuple[tuple[int, ...], torch.dtype | None]:
    """(logical shape, dtype) of a source value; dtype None for quantized values."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return tuple(value.shape), None


def value_nbytes(value: SourceValue) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, NVFP4Tensor):
        return value.nbytes
    return sum(t.numel() * t.element_size() for t in (value.data, value.scale_inv, value.amax))


class SafetensorsFolder:
    """A Hugging Face folder: config.json plus model.safetensors or shards listed in the index.

    Every shard is checked to exist and every indexed tensor to be in its shard at open time.
    Tensors are read one at a time with `safe_open`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = self.path / schema.CONFIG_FILE
        if not cfg.is_file():
            raise FileNotFoundError(f"{self.path}: no {schema.CONFIG_FILE}")
        self.config: dict[str, Any] = json.loads(cfg.read_text())
        index = self.path / schema.INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{self.path}: neither {schema.INDEX_FILE} nor model.safetensors")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.path}: missing shard(s) {missing} listed in {schema.INDEX_FILE}")
        self._specs: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            with safe_open(self.path / file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = _ST_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{name}: unsupported safetensors dtype {sl.get_dtype()} in {file}")
                    self._specs[name] = (file, tuple(sl.get_shape()), dtype)
        if weight_map:
            for name, file in weight_map.items():
                if self._specs.get(name, (None,))[0] != file:
                    raise ValueError(f"{name}: listed in {schema.INDEX_FILE} under {file} but not stored there")
        self.nbytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in self._specs.values())

    def specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, shape, dtype) for name, (_, shape, dtype) in self._specs.items()]

    def tensors(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[str, list[str]] = {}
        for name, (file, _, _) in self._specs.items():
            if names is None or name in names:
                by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(self.path / file, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)

    def extra_files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir()
                      if p.is_file() and p.name != schema.CONFIG_FILE and not p.name.endswith(_WEIGHT_SUFFIXES))


class StateDictSource:
    """Tensors of a training process: a mapping (validated up front) or a one-shot iterable of
    (name, value) pairs (validated tensor by tensor). `config` is the model's HF config dict."""

    def __init__(self, tensors: Mapping[str, SourceValue] | Iterable[tuple[str, SourceValue]], *,
                 config: dict[str, Any]):
        self.config = dict(config)
        self._tensors = tensors
        self.nbytes = sum(value_nbytes(v) for v in tensors.values()) if isinstance(tensors, Mapping) else None

    def specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype | None]] | None:
        if not isinstance(self._tensors, Mapping):
            return None
        return [(name, *value_spec(v)) for name, v in self._tensors.items()]

    def tensors(self, names: Collection[str] | None = None) -> Iterator[tuple[str, SourceValue]]:
        items = self._tensors.items() if isinstance(self._tensors, Mapping) else self._tensors
        return iter(items) if names is None else ((n, v) for n, v in items if n in names)

    def extra_files(self) -> list[Path]:
        return []
