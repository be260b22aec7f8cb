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
The per-tensor error report is `converters.report`; buckets and the folder writer are `converters.writer`.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Callable

import torch

from nvfp4_sampler.kernels import cpu_quant, dispatch
from nvfp4_sampler.kernels.format import BLOCK, NVFP4Tensor
from nvfp4_sampler.sampler_format import SCALE, SCALE_2, WEIGHT, Recipe, SamplerConfig, fused_group, is_nvfp4_weight

from . import name_map, schema
from .report import ConvertSummary, quantization_report, te_conversion_report
from .sources import SafetensorsFolder, SourceValue, StateDictSource, TENVFP4Weight, value_nbytes, value_spec
from .writer import Bucket, FolderWriter, nbytes, split_ranks

DEFAULT_BUCKET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """recipe: the learner's `Recipe` (weight recipe "1d"/"2d", op order "vllm"/"te", activation
      scaling); weights are quantized with it, and it is written into the checkpoint's
      quantization_config, so the sampler quantizes its activations the same way.
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

    recipe: Recipe = Recipe()
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
        self.sampler_config()   # validates recipe and keep_bf16

    def sampler_config(self) -> SamplerConfig:
        """The quantization_config written with the converted weights."""
        return SamplerConfig(recipe=self.recipe, keep_bf16=self.keep_bf16, prequantized=True)


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
        return self.options.quantize and is_nvfp4_weight(name, self.config)

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
                self.summary.reports.append(quantization_report(m.name, w[i], qi, err_i))
            prefix, _ = schema.split_name(m.name)
            groups.append({f"{prefix}.{WEIGHT}": qi.codes, f"{prefix}.{SCALE}": qi.block_scales,
                           f"{prefix}.{SCALE_2}": qi.global_scale})
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
            report = quantization_report(name, w, q, err) if self.options.report else None
        if report is not None:
            self.summary.reports.append(report)
        return {f"{prefix}.{WEIGHT}": q.codes, f"{prefix}.{SCALE}": q.block_scales,
                f"{prefix}.{SCALE_2}": q.global_scale}

    def _shared_amax(self, name: str, device: torch.device) -> torch.Tensor | None:
        """max|w| over the fused group of float weight `name` under options.shared_group_scale (read
        from the source once per group, then cached), else None (the weight's own amax)."""
        group = fused_group(name) if self.options.shared_group_scale else None
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
        kw = dict(recipe=self.options.recipe.weight, amax=amax, op_order=self.options.recipe.op_order)
        try:
            if self.options.report and w.device.type == "cpu" and self.options.backend in ("auto", "reference"):
                return cpu_quant.quantize_weight_with_error(w, **kw)
            return dispatch.quantize_weight_on(w, backend=self.options.backend, **kw), None
        except ValueError as e:
            raise ValueError(f"{what}: {str(e).removeprefix('weight: ')}") from e
    def _track(self, delta: int) -> None:
        self._live += delta
        self.summary.peak_tracked_bytes = max(self.summary.peak_tracked_bytes, self._live)


def _mapped_shape(shape: tuple[int, ...], m: name_map.Mapped) -> tuple[int, ...]:
    if m.index is None:
        return tuple(shape)
    rows = m.index[1]
    return (rows.stop - rows.start, *shape[2:])


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
    bucket = Bucket(options.bucket_bytes, conv._track)
    start = time.perf_counter()
    for group in conv.groups(only):
        full = bucket.add(group)
        if full is not None:
            conv.summary.bytes_out += nbytes(full)
            yield full
    last = bucket.take()
    if last is not None:
        conv.summary.bytes_out += nbytes(last)
        yield last
    conv.summary.seconds = time.perf_counter() - start


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
        writers = [FolderWriter(f) for f in folders]
        per_rank = max(1, options.bucket_bytes // options.tp)
        buckets = [Bucket(per_rank, conv._track) for _ in writers]
        done = 0
        for group in conv.groups():
            for writer, bucket, piece in zip(writers, buckets, split_ranks(group, options.tp)):
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
