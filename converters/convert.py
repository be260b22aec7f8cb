"""Streaming conversion of learner tensors to the sampler layout (converters/schema.py).

    convert(src, dst, options)        -> ConvertSummary   files: safetensors shards + index + config.json
    iter_buckets(source, options)     -> Iterator[dict]   checkpoint-named tensors for a weight update

Tensors are read one at a time, converted, and collected in buckets of at most
`options.bucket_bytes` output bytes (a group P.weight/P.weight_scale/P.weight_scale_2 never spans
two buckets); a full bucket is written as one shard (or yielded) and dropped. Peak memory is the
bucket plus one source tensor and its conversion temporaries.

Sources of a quantized linear:
  float tensor      quantized with `kernels.dispatch.quantize_weight_on(recipe=...)` on options.device
  TENVFP4Weight     TransformerEngine storage: codes and scales copied byte for byte (0 bits changed)
  NVFP4Tensor       already in the sampler format: copied
Every check that needs no data (architecture, names, shapes, dtypes, K % 16, TP divisibility) runs
before the first tensor is converted; files appear at `dst` only once all are written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from nvfp4_sampler.kernels import cpu_quant, dispatch, reference
from nvfp4_sampler.kernels.format import BLOCK, NVFP4Tensor
from nvfp4_sampler.sampler_format import SamplerConfig

from . import name_map, schema
from .sources import SafetensorsFolder, SourceValue, StateDictSource, TENVFP4Weight, value_nbytes, value_spec

DEFAULT_BUCKET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """recipe: the learner's weight recipe, "1d" (1x16 blocks) or "2d" (16x16 tiles, TE's).
    op_order: the quantizers' float-op order, "vllm" (the spec) or "te" (TransformerEngine's, bit
      for bit); written into the checkpoint's quantization_config, so the sampler quantizes its
      activations the same way.
    shared_group_scale: float weights that engines fuse (q/k/v, gate/up; per expert) share one
      second-level scale, from the amax of the whole group (`reference.quantize_weight_group`), as
      learners that quantize a fused QKV / gate-up tensor hold them (Megatron + TE). Costs one more
      read of each group's other members; needs a source whose names are known up front.
    keep_bf16: module-name prefixes left in BF16 (on top of lm_head, embeddings, routers).
    tp: write the checkpoint pre-sharded for this many tensor-parallel ranks (files only).
    device: where tensors are converted and output ("cpu", "cuda", "cuda:1"); None (default): on the
      device each source tensor lives on (GPU tensors on their GPU, files on the CPU).
    backend: kernels backend of the weight quantizer.
    quantize: False passes every tensor through renamed, unquantized (a BF16 weight update).
    bucket_bytes: output bytes per shard / per yielded bucket.
    report: compute per-tensor errors (on the CPU in the quantizing pass, elsewhere one dequantize).
    """

    recipe: str = "1d"
    op_order: str = "vllm"
    shared_group_scale: bool = False
    keep_bf16: tuple[str, ...] = ()
    tp: int = 1
    device: str | None = None
    backend: str = "auto"
    quantize: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    report: bool = True

    def __post_init__(self):
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        self.sampler_config()   # validates recipe, op_order and keep_bf16

    def sampler_config(self) -> SamplerConfig:
        """The quantization_config written with the converted weights."""
        return SamplerConfig(weight_recipe=self.recipe, op_order=self.op_order, keep_bf16=self.keep_bf16,
                             prequantized=True)


@dataclasses.dataclass(frozen=True)
class TensorReport:
    """Errors of one quantized linear weight [N, K].

    quant_*: dequantized NVFP4 vs the float source (relative Frobenius norm, max abs); None when the
      source holds no float weight (TE / NVFP4 sources).
    conv_*: conversion error for NVFP4 sources (TE, NVFP4Tensor): max |decoded before - decoded
      after| and the number of bits that differ in codes, block scales and global scale; None for
      float sources. Both are 0 by construction; the report proves it per tensor.
    """

    name: str
    shape: tuple[int, ...]
    source: str
    quant_rel_fro: float | None = None
    quant_max_abs: float | None = None
    conv_max_abs: float | None = None
    conv_bits_changed: int | None = None


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did; `table()` renders the worst tensors."""

    tensors_in: int = 0
    tensors_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_tracked_bytes: int = 0
    reports: list[TensorReport] = dataclasses.field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds else 0.0

    def table(self, *, top: int = 10) -> str:
        """The `top` tensors by conversion error, then quantization error, as a text table."""
        def key(r: TensorReport):
            return (r.conv_bits_changed or 0, r.conv_max_abs or 0.0, r.quant_rel_fro or 0.0)
        rows = sorted(self.reports, key=key, reverse=True)[:top]
        fmt = "{:<56} {:>14} {:>5} {:>10} {:>10} {:>10} {:>6}"
        lines = [fmt.format("tensor", "shape", "src", "q_relfro", "q_maxabs", "c_maxabs", "c_bits")]
        for r in rows:
            num = [("-" if v is None else f"{v:.3e}") for v in (r.quant_rel_fro, r.quant_max_abs, r.conv_max_abs)]
            lines.append(fmt.format(r.name[-56:], "x".join(map(str, r.shape)), r.source, *num,
                                    "-" if r.conv_bits_changed is None else r.conv_bits_changed))
        return "\n".join(lines)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def _popcount_xor(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of differing bits between two tensors of equal shape and byte size."""
    x = a.reshape(-1).contiguous().view(torch.uint8) ^ b.reshape(-1).contiguous().view(torch.uint8)
    return int(_POPCOUNT[x.long()].sum())


class _Converter:
    """Checks and converts the tensors of one source under one set of options."""

    def __init__(self, source: SafetensorsFolder | StateDictSource, options: ConvertOptions):
        self.source, self.options = source, options
        self.hf_config = source.config
        schema.check_architecture(self.hf_config)
        self.config = options.sampler_config()
        self.tied = bool(self.hf_config.get("tie_word_embeddings"))
        if options.tp > 1:
            for key, count in schema.tp_divisors(self.hf_config).items():
                if count % options.tp:
                    raise ValueError(f"--tp {options.tp} does not divide {key}={count}")
        self.device = None if options.device is None else torch.device(options.device)
        self.summary = ConvertSummary()
        self._live = 0                       # bytes held by buckets + the current tensor
        specs = source.specs()
        self._prechecked = specs is not None     # every output checked here; else as tensors arrive
        self._origin: dict[str, tuple[str, name_map.Mapped]] = {}    # sampler name -> (source name, mapping)
        self._group_amax: dict[tuple[str, ...], torch.Tensor] = {}
        if options.shared_group_scale and specs is None:
            raise ValueError("shared_group_scale needs a source whose tensors are known up front (a folder or a "
                             "mapping), not a one-shot iterable: a group's amax is read before it is quantized")
        if specs is not None:
            for name, shape, dtype in specs:
                for m in name_map.expand(name, shape, tied_embeddings=self.tied):
                    self._check(m.name, _mapped_shape(shape, m), dtype)
                    self._origin[m.name] = (name, m)

    def quantized(self, name: str) -> bool:
        """True if sampler tensor `name` is written as an NVFP4 triplet under these options."""
        return self.options.quantize and schema.is_nvfp4_weight(name, self.config)

    def outputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype | None]]:
        """(sampler name, logical shape, dtype) of every output, dtype None for NVFP4 triplets
        (named by their P.weight), from the source specs alone; ValueError if the source has none."""
        specs = self.source.specs()
        if specs is None:
            raise ValueError("the outputs of a one-shot iterable source are unknown before conversion; pass a mapping")
        out = []
        for name, shape, dtype in specs:
            for m in name_map.expand(name, shape, tied_embeddings=self.tied):
                out.append((m.name, _mapped_shape(shape, m), None if self.quantized(m.name) else dtype))
        return out

    # ---- checks (no data) ----
    def _check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
        """Validate one sampler tensor (dtype None: an NVFP4 value). Raises ValueError naming it."""
        expected = schema.expected_shape(name, self.hf_config)
        if expected is not None and tuple(shape) != expected:
            raise ValueError(f"{name}: shape mismatch, got {list(shape)}, the model config expects {list(expected)}")
        quantized = self.quantized(name)
        if quantized:
            if dtype is not None and dtype not in schema.FLOAT_DTYPES:
                raise ValueError(f"{name}: dtype mismatch, a linear weight must be one of "
                                 f"{[str(d) for d in schema.FLOAT_DTYPES]} or NVFP4, got {dtype}")
            if len(shape) != 2 or shape[-1] % BLOCK:
                raise ValueError(f"{name}: K={shape[-1] if shape else None} is not a multiple of {BLOCK} "
                                 f"(shape {list(shape)}); NVFP4 needs 16-element blocks")
        elif dtype is None:
            raise ValueError(f"{name}: source is NVFP4 but the sampler keeps this module in BF16 "
                             f"(always-BF16 module or keep_bf16={list(self.config.keep_bf16)})")
        dim = schema.tp_dim(name)
        if self.options.tp > 1 and dim is not None and dim < len(shape):
            unit = BLOCK * self.options.tp if (quantized and dim == 1) else self.options.tp
            if shape[dim] % unit:
                what = "on a 16-element block boundary " if unit != self.options.tp else ""
                raise ValueError(f"{name}: dim {dim} of size {shape[dim]} cannot be split {what}"
                                 f"into {self.options.tp} tensor-parallel ranks")

    # ---- conversion of one tensor ----
    def groups(self, only: Collection[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Output groups (a quantized triplet or one kept tensor), in source order; with `only`,
        just the outputs of those names (a triplet by its P.weight), reading only their sources."""
        names = None
        if only is not None:
            only = set(only)
            names = {n for n, shape, _ in self.source.specs()
                     if any(m.name in only for m in name_map.expand(n, shape, tied_embeddings=self.tied))}
        for src_name, value in self.source.tensors(names):
            shape, dtype = value_spec(value)
            self.summary.tensors_in += 1
            self.summary.bytes_in += value_nbytes(value)
            self._track(value_nbytes(value))
            maps = name_map.expand(src_name, shape, tied_embeddings=self.tied)
            if not self._prechecked:
                for m in maps:
                    self._check(m.name, _mapped_shape(shape, m), dtype)
            fused = None
            if len(maps) > 1 and (only is None or all(m.name in only for m in maps)):
                fused = self._convert_fused(src_name, value, maps)
            for i, m in enumerate(maps):
                if only is not None and m.name not in only:
                    continue
                group = self._convert(m.name, value if m.index is None else value[m.index]) if fused is None \
                    else fused[i]
                self.summary.tensors_out += len(group)
                yield group
            self._track(-value_nbytes(value))
            value = fused = group = None          # release the source tensor before the next one is read

    def _convert_fused(self, src_name: str, value: SourceValue,
                       maps: list[name_map.Mapped]) -> list[dict[str, torch.Tensor]] | None:
        """The groups of a fused expert tensor [E, parts * R, C] quantized in ONE call as stacked
        weights [E * parts, R, C]: one second-level scale per expert part, bit for bit what quantizing
        each part alone gives (one kernel launch instead of E * parts on a GPU). None if some part
        is not quantized or the value is not a float tensor (the parts are then converted one by one)."""
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()
                and all(self.quantized(m.name) for m in maps)):
            return None
        rows = maps[0].index[1]
        w = value if self.device is None else value.to(self.device)
        parts = w.shape[1] // (rows.stop - rows.start)
        amax = None
        if self.options.shared_group_scale:              # an expert's parts (gate, up) are its fused group
            amax = w.abs().amax(dim=(1, 2)).float().repeat_interleave(parts)
        w = w.reshape(-1, rows.stop - rows.start, w.shape[-1])                  # [E * parts, R, C]
        q, err = self._quantize(w, amax, src_name)
        groups = []
        for i, m in enumerate(maps):
            qi = NVFP4Tensor(q.codes[i], q.block_scales[i], q.global_scale[i])
            if self.options.report:
                err_i = None if err is None else cpu_quant.QuantizationError(*(t[i] for t in err))
                self.summary.reports.append(self._quant_report(m.name, w[i], qi, err_i))
            prefix, _ = schema.split_name(m.name)
            groups.append({f"{prefix}.{schema.WEIGHT}": qi.codes, f"{prefix}.{schema.SCALE}": qi.block_scales,
                           f"{prefix}.{schema.SCALE_2}": qi.global_scale})
        return groups

    def _convert(self, name: str, value: SourceValue) -> dict[str, torch.Tensor]:
        if not self.quantized(name):                 # (the weight quantizers check NaN/Inf themselves)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() \
                    and not torch.isfinite(value.abs().amax()):     # amax propagates NaN; ~10x faster than isfinite
                raise ValueError(f"{name}: contains NaN or Inf")
            t = value if self.device is None else value.to(self.device)
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()            # a slice of a fused tensor: do not keep the whole tensor alive
            return {name: t}
        prefix, _ = schema.split_name(name)
        if isinstance(value, TENVFP4Weight):
            q = value.to_nvfp4(name)
            q = q if self.device is None else q.to(self.device)
            report = te_conversion_report(name, value, q) if self.options.report else None
        elif isinstance(value, NVFP4Tensor):
            if value.global_scale.dim():
                raise ValueError(f"{name}: NVFP4 source must have a per-tensor global_scale [], "
                                 f"got {list(value.global_scale.shape)}")
            q = value if self.device is None else value.to(self.device)
            report = None
        else:
            w = value if self.device is None else value.to(self.device)
            q, err = self._quantize(w, self._shared_amax(name, w.device), name)
            report = self._quant_report(name, w, q, err) if self.options.report else None
        if report is not None:
            self.summary.reports.append(report)
        return {f"{prefix}.{schema.WEIGHT}": q.codes, f"{prefix}.{schema.SCALE}": q.block_scales,
                f"{prefix}.{schema.SCALE_2}": q.global_scale}

    def _shared_amax(self, name: str, device: torch.device) -> torch.Tensor | None:
        """max|w| over the fused group of float weight `name` under options.shared_group_scale (read
        from the source once per group, then cached), else None (the weight's own amax)."""
        group = schema.fused_group(name) if self.options.shared_group_scale else None
        if group is None:
            return None
        if group not in self._group_amax:
            members = [self._origin[n] for n in group if n in self._origin]
            amax = torch.zeros((), dtype=torch.float32)
            for src_name, value in self.source.tensors({src for src, _ in members}):
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise ValueError(f"{src_name}: shared_group_scale quantizes float weights; this group member is "
                                     f"already NVFP4 (it keeps the learner's own scale)")
                for src, m in members:
                    if src == src_name:
                        part = (value if m.index is None else value[m.index]).abs().amax().float().cpu()
                        if not torch.isfinite(part):
                            raise ValueError(f"{src_name}: contains NaN or Inf")
                        amax = torch.maximum(amax, part)
            self._group_amax[group] = amax
        return self._group_amax[group].to(device)

    def _quantize(self, w: torch.Tensor, amax: torch.Tensor | None,
                  what: str) -> tuple[NVFP4Tensor, cpu_quant.QuantizationError | None]:
        """NVFP4 of float w ([N, K] or stacked [E, N, K]) under the options, with its error per matrix
        when the report is on and w is on the CPU (`cpu_quant` computes it in the quantizing pass;
        elsewhere `_quant_report` dequantizes). ValueError messages name `what`."""
        kw = dict(recipe=self.options.recipe, amax=amax, op_order=self.options.op_order)
        try:
            if self.options.report and w.device.type == "cpu" and self.options.backend in ("auto", "reference"):
                return cpu_quant.quantize_weight_with_error(w, **kw)
            return dispatch.quantize_weight_on(w, backend=self.options.backend, **kw), None
        except ValueError as e:
            raise ValueError(f"{what}: {str(e).removeprefix('weight: ')}") from e

    def _quant_report(self, name: str, w: torch.Tensor, q: NVFP4Tensor, err: cpu_quant.QuantizationError | None,
                      *, chunk: int = 1 << 16) -> TensorReport:
        """Relative Frobenius and max abs error of deq(q) against w: `err` when the quantizer gave it,
        else computed over cache-sized row chunks (no whole-tensor fp32 temporaries; sums in fp32
        within a chunk, fp64 across chunks)."""
        if err is None:
            w2, gs = w.reshape(-1, w.shape[-1]), q.row_global_scale().reshape(-1)
            codes, scales = q.codes.reshape(-1, q.codes.shape[-1]), q.block_scales.reshape(-1, q.block_scales.shape[-1])
            err2 = ref2 = emax = torch.zeros((), dtype=torch.float64, device=w.device)
            rows = max(1, chunk // w2.shape[-1])
            for r in range(0, w2.shape[0], rows):
                part = NVFP4Tensor(codes[r:r + rows], scales[r:r + rows], gs[r:r + rows])
                wf = w2[r:r + rows].float()
                diff = reference.dequantize(part).sub_(wf)
                err2 = err2 + diff.square().sum().double()
                ref2 = ref2 + wf.square().sum().double()
                emax = torch.maximum(emax, diff.abs().max())
            err = cpu_quant.QuantizationError(err2, ref2, emax)
        norm, enorm, emax = err.ref_sq.sqrt().item(), err.err_sq.sqrt().item(), err.max_abs.item()
        rel = enorm / norm if norm else float(emax > 0)
        return TensorReport(name, tuple(w.shape), str(w.dtype).removeprefix("torch."), rel, emax)

    def _track(self, delta: int) -> None:
        self._live += delta
        self.summary.peak_tracked_bytes = max(self.summary.peak_tracked_bytes, self._live)


def te_conversion_report(name: str, te: TENVFP4Weight, q: NVFP4Tensor) -> TensorReport:
    """Compare the written NVFP4 with TE's own storage: codes bitwise, scales bitwise at the
    valid positions of TE's padded (compact or swizzled) buffer, global scale vs TE's amax."""
    m, k = te.shape
    ksf = k // BLOCK
    scales = q.block_scales.cpu()
    stored = te.scale_inv.cpu().view(torch.float8_e4m3fn)
    if te.with_gemm_swizzled_scales:
        valid = reference.swizzle_scales_128x4(torch.ones(m, ksf).to(torch.float8_e4m3fn)).view(torch.uint8) != 0
        scale_bits = _popcount_xor(reference.swizzle_scales_128x4(scales).view(torch.uint8)[valid],
                                   stored.view(torch.uint8)[valid])
        te_scales = reference.unswizzle_scales_128x4(stored, m, ksf)
    else:
        te_scales = stored[:m, :ksf]
        scale_bits = _popcount_xor(scales, te_scales)
    gs = reference.decode_scale_from_amax(te.amax.reshape(()).cpu())
    bits = _popcount_xor(q.codes.cpu(), te.data.cpu()) + scale_bits + _popcount_xor(q.global_scale.cpu(), gs)
    diff = 0.0                   # identical bytes decode identically; decode only when they differ
    if bits:
        before = NVFP4Tensor(te.data.cpu(), te_scales.contiguous(), gs)
        diff = (reference.dequantize(before) - reference.dequantize(q.to("cpu"))).abs().max().item()
    return TensorReport(name, (m, k), "te", conv_max_abs=diff, conv_bits_changed=bits)


def _mapped_shape(shape: tuple[int, ...], m: name_map.Mapped) -> tuple[int, ...]:
    if m.index is None:
        return tuple(shape)
    rows = m.index[1]
    return (rows.stop - rows.start, *shape[2:])


class _Bucket:
    """Collects groups of tensors up to `limit` bytes; `add` returns the full bucket to flush."""

    def __init__(self, limit: int, track: Callable[[int], None]):
        self.limit, self.track = limit, track
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        size = _nbytes(group)
        full = self.take() if self.tensors and self.bytes + size > self.limit else None
        self.tensors.update(group)
        self.bytes += size
        self.track(size)
        return full

    def take(self) -> dict[str, torch.Tensor] | None:
        full, self.tensors = self.tensors, {}
        self.track(-self.bytes)
        self.bytes = 0
        return full or None


def output_specs(source: SafetensorsFolder | StateDictSource,
                 options: ConvertOptions = ConvertOptions()) -> list[tuple[str, tuple[int, ...], torch.dtype | None]]:
    """(sampler name, logical shape, dtype or None for an NVFP4 triplet named by its P.weight) of
    everything `iter_buckets(source, options)` yields, checked and computed without reading data
    (a weight update's manifest). `source` must know its specs (a folder or a mapping)."""
    return _Converter(source, options).outputs()


def iter_buckets(source: SafetensorsFolder | StateDictSource, options: ConvertOptions = ConvertOptions(),
                 *, summary: ConvertSummary | None = None,
                 only: Collection[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Checkpoint-named sampler tensors in dicts of at most options.bucket_bytes (a larger group
    is a bucket of its own), on options.device. For the weight-update server; `options.tp` must be
    1 (the engine shards on load). If `summary` is given it is filled as the stream advances.
    only: output names to produce (as `output_specs` names them; a resumed update's missing
    tensors); the other source tensors are not read.
    """
    if options.tp != 1:
        raise ValueError("iter_buckets streams unsharded tensors; the engine shards them (tp must be 1)")
    conv = _Converter(source, options)
    if summary is not None:
        conv.summary = summary
    bucket = _Bucket(options.bucket_bytes, conv._track)
    start = time.perf_counter()
    for group in conv.groups(only):
        full = bucket.add(group)
        if full is not None:
            conv.summary.bytes_out += _nbytes(full)
            yield full
    last = bucket.take()
    if last is not None:
        conv.summary.bytes_out += _nbytes(last)
        yield last
    conv.summary.seconds = time.perf_counter() - start


def _split(group: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Per-rank pieces of a group: split along schema.tp_dim, replicated otherwise."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in group.items():
        dim = schema.tp_dim(name)
        pieces = t.chunk(tp, dim) if dim is not None and dim < t.dim() else [t] * tp
        for r, piece in enumerate(pieces):
            ranks[r][name] = piece
    return ranks


class _FolderWriter:
    """Writes buckets as numbered shards into `folder`; `finish` names them and writes the index."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        self.shards: list[list[str]] = []
        self.total = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> int:
        cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        save_file(cpu, self.folder / f"part-{len(self.shards) + 1}", metadata=schema.SHARD_METADATA)
        self.shards.append(list(cpu))
        size = _nbytes(cpu)
        self.total += size
        return size

    def finish(self, config_json: dict[str, Any], extra_files: list[Path]) -> None:
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            file = schema.shard_file(i, len(self.shards))
            os.rename(self.folder / f"part-{i}", self.folder / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / schema.INDEX_FILE).write_text(json.dumps(index, indent=2))
        (self.folder / schema.CONFIG_FILE).write_text(json.dumps(config_json, indent=2))
        for f in extra_files:
            shutil.copy2(f, self.folder / f.name)


def convert(src: str | Path | SafetensorsFolder | StateDictSource, dst: str | Path,
            options: ConvertOptions = ConvertOptions(), *,
            progress: Callable[[int], None] | None = None) -> ConvertSummary:
    """Convert `src` (a HF folder path or a source) into a sampler checkpoint folder `dst`.

    With options.tp > 1, dst holds one complete folder per rank (schema.RANK_DIR). Everything is
    written to a temporary folder next to dst and renamed at the end; on any error dst is left as
    it was (it must not exist yet). `progress(n)` is called with the number of source bytes done.
    """
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    source = SafetensorsFolder(src) if isinstance(src, (str, os.PathLike)) else src
    conv = _Converter(source, options)
    config_json = schema.sampler_config_json(source.config, conv.config)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    start = time.perf_counter()
    try:
        folders = [tmp] if options.tp == 1 else [tmp / schema.RANK_DIR.format(rank=r) for r in range(options.tp)]
        writers = [_FolderWriter(f) for f in folders]
        per_rank = max(1, options.bucket_bytes // options.tp)
        buckets = [_Bucket(per_rank, conv._track) for _ in writers]
        done = 0
        for group in conv.groups():
            for writer, bucket, piece in zip(writers, buckets, _split(group, options.tp)):
                full = bucket.add(piece)
                if full is not None:
                    conv.summary.bytes_out += writer.write(full)
            if progress is not None and conv.summary.bytes_in != done:
                progress(conv.summary.bytes_in - done)
                done = conv.summary.bytes_in
        for writer, bucket in zip(writers, buckets):
            last = bucket.take()
            if last is not None:
                conv.summary.bytes_out += writer.write(last)
            writer.finish(config_json, source.extra_files())
        tmp.rename(dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    conv.summary.seconds = time.perf_counter() - start
    return conv.summary
