"""Writing a weight update into an engine's NVFP4 layers, all or nothing.

`apply_update` takes checkpoint-named tensors, `apply_fused` whole planned entries (`server.plan`: all
experts of a projection, a fused qkv / gate_up, as one tensor per kind); both check the whole call
first (names, dtypes, shapes, NaN/Inf, complete triplets) and write nothing when any tensor is bad,
naming it (docs/ARCHITECTURE.md, "Weight updates: one rule"). `Target` says where a checkpoint tensor
lives in the engine (`core.reload_targets`). Storage layouts and the per-tensor writes: `layers`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_format import SamplerConfig

from . import layers


@dataclasses.dataclass(frozen=True)
class Target:
    """A reloadable checkpoint tensor group: an NVFP4 shard (weight + shard) or a plain tensor (param).
    A plain tensor may hold rows `rows` of a checkpoint tensor of shape `shape` in its first rows (an
    engine's vocab-parallel embedding or head: its vocabulary part, then padding); None: all of it."""

    weight: NVFP4Tensor | None = None
    shard: layers.Shard | None = None
    param: torch.Tensor | None = None
    rows: slice | None = None
    shape: tuple[int, ...] | None = None

    @property
    def held(self) -> torch.Tensor:
        """A plain target's rows that hold checkpoint values (all of `param` unless `rows` is set)."""
        return self.param if self.rows is None else self.param[:self.rows.stop - self.rows.start]

    def plain_write(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination, source) of a plain checkpoint tensor of `shape`: this rank's rows of it."""
        return self.held, tensor if self.rows is None else tensor[self.rows]


class Region(NamedTuple):
    """Rows [row0, row1) and columns (K) [col0, col1) of a checkpoint tensor that a rank holds. quantized: an
    NVFP4 shard's part (sent as a float weight the tensor cannot be cut: its quantization takes the whole
    tensor's amax); else a plain tensor's rows (all its columns)."""

    row0: int
    row1: int
    col0: int
    col1: int
    quantized: bool = True


def _region(t: Target) -> Region | None:
    """The part of its checkpoint tensor a target holds, None when it holds all of it."""
    if t.shard is None:
        return None if t.rows is None else Region(t.rows.start, t.rows.stop, 0, t.shape[1], quantized=False)
    shard = t.shard
    (r0, r1, rs), (c0, c1, cs) = shard.src_rows.indices(shard.shape[0]), shard.src_cols.indices(shard.shape[1])
    if rs != 1 or cs != 1:
        raise ValueError(f"nvfp4_sampler: {shard.name}: a shard holds a contiguous part of its tensor")
    return None if (r0, r1, c0, c1) == (0, shard.shape[0], 0, shard.shape[1]) else Region(r0, r1, c0, c1)


def held_regions(targets: Mapping[str, Target]) -> dict[str, Region | None]:
    """What a rank holds of each update tensor: an NVFP4 shard's "P.weight" or a plain tensor's name ->
    the `Region` of the checkpoint tensor it holds (None: all of it). Names absent are not held here
    (another rank's, or no one's). What per-rank transfer plans are cut by (`server.plan.rank_manifest`)."""
    return {name if t.shard is None else f"{name}.weight": _region(t) for name, t in targets.items()}


def local_targets(targets: Mapping[str, Target]) -> dict[str, Target]:
    """`targets` with every target that holds part of its checkpoint tensor made whole over that part:
    the targets of updates whose tensors arrive already cut to this rank's `held_regions`."""
    out = {}
    for name, t in targets.items():
        region = _region(t)
        if region is None:
            out[name] = t
        elif t.shard is None:
            out[name] = Target(param=t.held)
        else:
            out[name] = dataclasses.replace(t, shard=layers.Shard(
                t.shard.name, (region.row1 - region.row0, region.col1 - region.col0), t.shard.rows, t.shard.expert))
    return out


def split_name(name: str) -> tuple[str, str]:
    """"a.b.q_proj.weight_scale" -> ("a.b.q_proj", "weight_scale")."""
    prefix, _, kind = name.rpartition(".")
    return prefix, kind


def check_group(prefix: str, group: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless an update's tensors of checkpoint tensor `prefix` ({kind: tensor}) are a
    float weight alone (quantized on arrival) or the whole NVFP4 triplet."""
    online = "weight" in group and group["weight"].dtype in layers.FLOAT_DTYPES
    expected = {"weight"} if online else set(layers.KINDS)
    if set(group) != expected:
        wrong = sorted(expected - set(group)) or sorted(set(group) - expected)
        raise ValueError(f"nvfp4_sampler: {prefix}.{wrong[0]}: an update of {prefix} holds either a float "
                         f"weight (quantized on arrival) or all of {list(layers.KINDS)}; got {sorted(group)}")


def e4m3_nan(bits: torch.Tensor) -> torch.Tensor:
    """Elementwise: which bytes of float8_e4m3fn values (viewed as uint8) are NaN (S.1111.111; e4m3fn
    has no Inf)."""
    return (bits & 0x7F) == 0x7F


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor | None:
    """A device bool: whether a float tensor holds a NaN or Inf (float8 widened first); None for others."""
    if not tensor.is_floating_point():
        return None
    return ~torch.isfinite(tensor.float() if tensor.element_size() == 1 else tensor).all()


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf (True for integer tensors; float8 is widened first)."""
    flag = _nonfinite(tensor)
    return flag is None or not bool(flag)


def any_flagged(flags: Iterable[torch.Tensor]) -> bool:
    """Whether any of the device bools is set: one host synchronisation per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return any(bool(torch.stack(fs).any()) for fs in by_device.values())


JOINED_MAX_NUMEL = 1 << 22    # float tensors up to this size are checked joined, per device and dtype


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first name whose float tensor holds a NaN or Inf, or None: one host synchronisation per device
    for all of them, the small ones (norms, routers: hundreds a model) joined into one tensor per device and
    dtype so that they take a few launches, not a few each; a tensor at a time only once one is flagged."""
    named = [(name, t) for name, t in named if t.is_floating_point()]
    joined: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    flags = []
    for _, t in named:
        if t.numel() > JOINED_MAX_NUMEL:
            flags.append(_nonfinite(t))
        else:                                  # as bytes: cat need not support the dtype (float8)
            joined.setdefault((t.device, t.dtype), []).append(t.reshape(-1).view(torch.uint8))
    flags += [_nonfinite(torch.cat(parts).view(dtype)) for (_, dtype), parts in joined.items()]
    if not any_flagged(flags):
        return None
    return next((name for name, t in named if bool(_nonfinite(t))), None)


def apply_update(targets: Mapping[str, Target], tensors: Mapping[str, torch.Tensor], *,
                 config: SamplerConfig) -> list[str]:
    """Write checkpoint-named `tensors` into a running model, all-or-nothing (the update rule,
    docs/ARCHITECTURE.md "Weight updates: one rule").

    targets: checkpoint module prefix (NVFP4 shards) or full tensor name (plain tensors) -> Target.
    An NVFP4 shard takes a float `P.weight` (quantized here) or the full triplet. Every name, dtype,
    shape and value (no NaN/Inf in a float tensor) is checked before anything is written;
    ValueError names the first bad tensor. Returns the names written.
    """
    checked = _check_update(targets, tensors)
    _write_checked(targets, checked, config=config)
    return sorted(tensors)


def _check_update(targets: Mapping[str, Target], tensors: Mapping[str, torch.Tensor]):
    """The whole-call check of `apply_update` (writes nothing): (plain copies, NVFP4 groups)."""
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups: dict[str, dict[str, torch.Tensor]] = {}
    finite: list[tuple[str, torch.Tensor]] = []                     # checked together after the loop
    for name in sorted(tensors):
        tensor = tensors[name]
        target = targets.get(name)
        if target is not None and target.param is not None:
            shape = target.shape or tuple(target.param.shape)
            if tuple(tensor.shape) != shape or not tensor.dtype.is_floating_point:
                raise ValueError(f"nvfp4_sampler: {name}: shape {tuple(tensor.shape)} dtype {tensor.dtype} does not "
                                 f"match the model's {shape} {target.param.dtype}")
            finite.append((name, tensor))
            plain.append(target.plain_write(tensor))
            continue
        prefix, kind = split_name(name)
        target = targets.get(prefix)
        if target is None or target.shard is None:
            raise ValueError(f"nvfp4_sampler: {name}: no such tensor in the model")
        layers.validate(target.shard, kind, tensor)                  # a float weight: NaN/Inf checked there
        if kind != "weight":
            finite.append((name, tensor))
        groups.setdefault(prefix, {})[kind] = tensor
    for prefix, group in groups.items():
        check_group(prefix, group)
    bad = first_nonfinite(finite)
    if bad is not None:
        raise ValueError(f"nvfp4_sampler: {bad}: contains NaN or Inf")
    return plain, groups


# From this size a tensor is written by a copy of its own (a device memcpy): `_foreach_copy_`'s kernel moved
# a whole-model commit's 16.8 GB at ~1.6 TB/s (read + written) where one copy_ moves ~3.0 (H100, twenty-second
# session, docs/BENCHMARKS.md); smaller tensors share its launches.
LARGE_COPY_BYTES = 4 << 20


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i: tensors of LARGE_COPY_BYTES or more one copy each, the rest
    one `torch._foreach_copy_` (per dtype and device, as it groups them)."""
    small_dst, small_src = [], []
    for d, s in zip(dst, src, strict=True):
        if d.numel() * d.element_size() >= LARGE_COPY_BYTES:
            d.copy_(s)
        else:
            small_dst.append(d)
            small_src.append(s)
    if small_dst:
        torch._foreach_copy_(small_dst, small_src)


def _write_checked(targets: Mapping[str, Target], checked, *, config: SamplerConfig) -> None:
    plain, groups = checked
    # one batched copy; a parameter named twice (tied embeddings) written once, by its last name as before
    last = {(param.data_ptr(), param.dtype, tuple(param.shape), param.stride()): (param, tensor) for param, tensor in plain}
    copy_all([param for param, _ in last.values()], [tensor for _, tensor in last.values()])
    for prefix, group in groups.items():
        for kind, tensor in group.items():
            layers.write(targets[prefix].weight, targets[prefix].shard, kind, tensor, config=config)


# ---- fused updates: one copy per tensor kind of a whole fused entry ------------------------------

@dataclasses.dataclass(frozen=True)
class FusedSlot:
    """A checkpoint tensor inside a fused entry: its rows [row0, row1) (of every expert when
    `experts` is set) and its decode-scale slot (an index into the last dim of weight_scale_2).
    name: the checkpoint tensor name ("P.weight" for NVFP4); with `experts`, a template holding "{e}"
    ("...mlp.experts.{e}.gate_proj.weight"), one checkpoint tensor per expert 0 .. experts-1."""

    name: str
    row0: int
    row1: int
    slot: int = 0
    experts: int | None = None

    def names(self) -> list[tuple[str, int | None]]:
        """(checkpoint tensor name, expert) of every tensor this slot stands for."""
        if self.experts is None:
            return [(self.name, None)]
        return [(self.name.format(e=e), e) for e in range(self.experts)]

    def to_list(self) -> list:
        return [self.name, self.row0, self.row1, self.slot, self.experts]

    @classmethod
    def from_list(cls, row) -> FusedSlot:
        name, row0, row1, slot, experts = row
        return cls(str(name), int(row0), int(row1), int(slot), None if experts is None else int(experts))


@dataclasses.dataclass(frozen=True)
class FusedEntry:
    """One fused entry of an update as the engines hold it (`server.plan`): all experts of a MoE
    projection stacked (`P.experts.w13_weight`: codes [E, 2I, K/2], block scales [E, 2I, K/16],
    decode scales [E, 2]), a fused linear (`P.qkv_proj.weight`: [N, K/2], [N, K/16], [3]), a single
    NVFP4 tensor (decode scale []), or a dense tensor. `tensors`: {"weight", "weight_scale",
    "weight_scale_2"} (layout "nvfp4") or {"dense"} (layout "dense")."""

    name: str
    layout: str
    slots: tuple[FusedSlot, ...]
    tensors: Mapping[str, torch.Tensor]

    def members(self) -> dict[str, torch.Tensor]:
        """The checkpoint-named tensors (views, no copy): what the per-tensor path takes."""
        out: dict[str, torch.Tensor] = {}
        for slot in self.slots:
            for name, e in slot.names():
                lead = () if e is None else (e,)
                rows = lead + (slice(slot.row0, slot.row1),)
                if self.layout == "dense":
                    t = self.tensors["dense"]
                    out[name] = t if (e is None and len(self.slots) == 1) else t[rows]
                    continue
                prefix = name.removesuffix(".weight")
                s2 = self.tensors["weight_scale_2"]
                out[name] = self.tensors["weight"][rows]
                out[f"{prefix}.weight_scale"] = self.tensors["weight_scale"][rows]
                out[f"{prefix}.weight_scale_2"] = s2 if s2.dim() == 0 else s2[lead + (slot.slot,)]
        return out


def _full(s: slice, n: int) -> bool:
    """Whether slice `s` of a dim of size n is all of it."""
    return s.step in (None, 1) and s.start in (None, 0) and (s.stop is None or s.stop == n)


class _Part(NamedTuple):
    """A storage a fused entry fills exactly: per_row (its decode scales are one per row), index (row ->
    the entry's slot, for per-row scales gathered from several slots; None: broadcast), rows and slot (the
    entry's rows and decode-scale slot it takes; None: the whole entry)."""

    storage: NVFP4Tensor
    per_row: bool
    index: torch.Tensor | None
    rows: tuple[int, int] | None
    slot: int | None


def _fused_plan(targets: Mapping[str, Target], entry: FusedEntry):
    """(parts, checkpoint names) if `entry` fills one NVFP4 storage exactly, row for row, in its layout
    (one part: its tensors copied whole), or its slots fill one storage each (a fused qkv / gate_up whose
    engine holds the parts apart: a part per slot, its rows copied whole); None otherwise (the per-tensor
    path)."""
    if entry.layout != "nvfp4" or set(entry.tensors) != set(layers.KINDS):
        return None
    whole = _whole_storage(targets, entry)
    parts = (whole,) if whole is not None else _storage_per_slot(targets, entry)
    if parts is None:
        return None
    names = []
    for slot in entry.slots:
        for n, _ in slot.names():
            p = n.removesuffix(".weight")
            names += [n, f"{p}.weight_scale", f"{p}.weight_scale_2"]
    return parts, names


def _whole_storage(targets: Mapping[str, Target], entry: FusedEntry):
    """The one part of an entry that fills one storage exactly, or None."""
    storage, nrows, row_slot = None, None, {}
    for slot in entry.slots:
        for name, e in slot.names():
            t = targets.get(name.removesuffix(".weight"))
            if t is None or t.shard is None:
                return None
            sh = t.shard
            if storage is None:
                storage = t.weight
                nrows = storage.codes.shape[-2]
            elif t.weight.codes.data_ptr() != storage.codes.data_ptr() or t.weight.codes.shape != storage.codes.shape:
                return None
            if (sh.expert != e or not _full(sh.src_rows, sh.shape[0]) or not _full(sh.src_cols, sh.shape[1])
                    or (sh.rows.start, sh.rows.stop) != (slot.row0, slot.row1) or sh.shape[0] != slot.row1 - slot.row0):
                return None
        row_slot[(slot.row0, slot.row1)] = slot.slot
    if storage is None or storage.codes.is_meta:
        return None
    w, ws, s2 = (entry.tensors[k] for k in layers.KINDS)
    if (w.dtype != storage.codes.dtype or ws.dtype != storage.block_scales.dtype
            or tuple(w.shape) != tuple(storage.codes.shape) or tuple(ws.shape) != tuple(storage.block_scales.shape)):
        return None
    covered = sorted(row_slot)                                # the slots tile the rows exactly
    if covered[0][0] != 0 or covered[-1][1] != nrows or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        return None
    lead = tuple(storage.codes.shape[:-2])
    nslots = len(row_slot)
    if nslots != len(entry.slots) or sorted(row_slot.values()) != list(range(nslots)):
        return None
    if s2.dtype != torch.float32 or tuple(s2.shape) != lead + (nslots,) and not (s2.dim() == 0 and nslots == 1
                                                                               and not lead):
        return None
    per_row = storage.global_scale.dim() == storage.codes.dim() - 1
    if not per_row and nslots != 1:
        return None
    index = None
    if per_row and s2.dim():
        index = torch.empty(nrows, dtype=torch.long)
        for (r0, r1), k in row_slot.items():
            index[r0:r1] = k
        index = index.to(storage.global_scale.device)
    return _Part(storage, per_row, index, None, None)


def _storage_per_slot(targets: Mapping[str, Target], entry: FusedEntry):
    """The parts of an entry whose slots (no experts) each fill a storage of their own exactly and tile
    the entry's rows, or None."""
    w, ws, s2 = (entry.tensors[k] for k in layers.KINDS)
    if (any(slot.experts is not None for slot in entry.slots) or s2.dtype != torch.float32
            or tuple(s2.shape) not in ((), (len(entry.slots),))
            or sorted(slot.slot for slot in entry.slots) != list(range(len(entry.slots)))):
        return None
    parts, rows = [], []
    for slot in entry.slots:
        t = targets.get(slot.name.removesuffix(".weight"))
        if t is None or t.shard is None or t.weight.codes.is_meta or t.weight.codes.dim() != 2:
            return None
        sh, storage = t.shard, t.weight
        n = slot.row1 - slot.row0
        if (sh.expert is not None or not _full(sh.src_rows, sh.shape[0]) or not _full(sh.src_cols, sh.shape[1])
                or not _full(sh.rows, storage.codes.shape[0]) or sh.shape[0] != n or storage.codes.shape[0] != n
                or w.dtype != storage.codes.dtype or ws.dtype != storage.block_scales.dtype
                or tuple(w[slot.row0:slot.row1].shape) != tuple(storage.codes.shape)
                or tuple(ws[slot.row0:slot.row1].shape) != tuple(storage.block_scales.shape)):
            return None
        parts.append(_Part(storage, storage.global_scale.dim() == 1, None, (slot.row0, slot.row1), slot.slot))
        rows.append((slot.row0, slot.row1))
    rows.sort()
    if (len({id(p.storage) for p in parts}) != len(parts) or rows[0][0] != 0 or rows[-1][1] != w.shape[0]
            or any(a[1] != b[0] for a, b in zip(rows, rows[1:]))):
        return None
    return tuple(parts)


def _part_tensors(entry: FusedEntry, part: _Part) -> Mapping[str, torch.Tensor]:
    """The entry's tensors a part writes: all of them, or its rows and its decode scale."""
    if part.rows is None:
        return entry.tensors
    (r0, r1), s2 = part.rows, entry.tensors["weight_scale_2"]
    return {"weight": entry.tensors["weight"][r0:r1], "weight_scale": entry.tensors["weight_scale"][r0:r1],
            "weight_scale_2": s2 if s2.dim() == 0 else s2[part.slot]}


def _cached_plan(targets: Mapping[str, Target], entry: FusedEntry, cache: dict | None):
    """`_fused_plan`, looked up in `cache` (keyed by the entry's name, slots and tensor shapes) when given;
    a cached plan whose storage is no longer where the entry's first tensor lives (an engine put fresh
    parameters in place, as vLLM's layerwise reload may) is found again."""
    if cache is None:
        return _fused_plan(targets, entry)
    key = (entry.name, entry.layout, entry.slots,
           tuple((k, t.dtype, tuple(t.shape)) for k, t in sorted(entry.tensors.items())))
    plan = cache.get(key, _UNSEEN)
    if plan is _UNSEEN or (plan is not None and not _serving(plan[0][0].storage, targets, entry)):
        plan = cache[key] = _fused_plan(targets, entry)
    return plan


_UNSEEN = object()


def per_tensor_entries(cache: dict) -> list[str]:
    """Names of the NVFP4 entries in an `apply_fused` cache that are written tensor by tensor (their
    storage does not hold them whole: a shard, parts held apart, another layout); a colocated engine
    whose layers all take the batched path has none."""
    return sorted(key[0] for key, plan in cache.items() if plan is None and key[1] == "nvfp4")


def _serving(storage: NVFP4Tensor, targets: Mapping[str, Target], entry: FusedEntry) -> bool:
    """Whether `storage` is still the storage of the entry's first checkpoint tensor in `targets`."""
    slot = entry.slots[0]
    name = slot.name if slot.experts is None else slot.name.format(e=0)
    t = targets.get(name.removesuffix(".weight"))
    return t is not None and t.weight is not None and t.weight.codes.data_ptr() == storage.codes.data_ptr()


def _write_fused(writes: list[tuple[NVFP4Tensor, bool, torch.Tensor | None, Mapping[str, torch.Tensor]]]) -> None:
    """All fused writes: codes and block scales (tiled first for a "mma_tiled" storage) by `copy_all`
    per dtype; decode scales broadcast into their storage by one more, or gathered
    per row (a storage whose rows take their parts' scales) one op per entry."""
    copy_all([s.codes for s, _, _, _ in writes], [layers.as_stored(s, "weight", t["weight"]) for s, _, _, t in writes])
    copy_all([s.block_scales for s, _, _, _ in writes],
             [layers.as_stored(s, "weight_scale", t["weight_scale"]) for s, _, _, t in writes])
    dst, src = [], []
    for storage, per_row, index, tensors in writes:
        s2, gs = tensors["weight_scale_2"].to(storage.global_scale.device), storage.global_scale
        if per_row and s2.dim():
            torch.index_select(s2, -1, index, out=gs)
        else:
            dst.append(gs)
            src.append((s2 if s2.dim() == 0 else s2[..., 0]).expand_as(gs))
    if dst:
        torch._foreach_copy_(dst, src)


def apply_fused(targets: Mapping[str, Target], entries: Iterable[FusedEntry], *, config: SamplerConfig,
                tensors: Mapping[str, torch.Tensor] | None = None, check_only: bool = False,
                cache: dict | None = None) -> list[str]:
    """Write fused entries (and checkpoint-named `tensors`, if any) into a running model, all-or-
    nothing, with the same checks and the same resulting storage as `apply_update` of their members.

    An NVFP4 entry that fills one storage exactly (every expert of w13 / w2, every part of a fused
    qkv / gate_up, unsharded), or whose parts each fill one (q / k / v held apart), is checked whole
    (dtypes, shapes, no NaN in the block scales, finite decode scales; neighbouring tensors of one
    buffer, as a planned bucket holds them, in one pass) and written with one batched copy per tensor
    kind. Any other entry (a tensor-parallel shard, a dense tensor) takes the per-tensor checks and
    writes of `apply_update`. Everything is checked before anything is written; ValueError names
    the first bad tensor (on failure the per-tensor check of the fused entry's members names the
    checkpoint tensor). cache: a dict kept by the caller across updates of a model whose `targets`
    stay the same (an engine's): each entry's write plan is found once. Returns the checkpoint names
    written (check_only: checks everything, writes nothing, returns []).
    """
    fast: list[tuple[FusedEntry, tuple]] = []
    rest: dict[str, torch.Tensor] = dict(tensors or {})
    for entry in entries:
        plan = _cached_plan(targets, entry, cache)
        if plan is None:
            _add_members(rest, entry)
        else:
            fast.append((entry, plan))
    bad = _invalid_fused([e for e, _ in fast])                # one host sync for all of them
    if bad:
        for i in bad:                                         # the per-tensor check names the bad tensor
            _add_members(rest, fast[i][0])
        fast = [f for i, f in enumerate(fast) if i not in bad]
    checked = _check_update(targets, rest)                    # raises before anything is written
    if check_only:
        return []
    if fast:
        _write_fused([(part.storage, part.per_row, part.index, _part_tensors(entry, part))
                      for entry, (parts, _) in fast for part in parts])
    _write_checked(targets, checked, config=config)
    return sorted([*rest, *(n for _, (_, names) in fast for n in names)])


def _add_members(rest: dict[str, torch.Tensor], entry: FusedEntry) -> None:
    members = entry.members()
    dup = members.keys() & rest.keys()
    if dup:
        raise ValueError(f"nvfp4_sampler: {sorted(dup)[0]}: sent twice in one update")
    rest.update(members)


def _invalid_fused(entries: list[FusedEntry]) -> set[int]:
    """Indices of the entries whose block scales hold a NaN (e4m3fn: S.1111.111) or whose decode
    scales are not finite. Tensors that are neighbours in one buffer are checked as one span (a
    planned bucket: a few passes per bucket, whatever the entry count); one host synchronisation per
    device, and only if a span is flagged, one more to find its entries."""
    if not entries:
        return set()
    scales = _spans([e.tensors["weight_scale"] for e in entries])
    decode = _spans([e.tensors["weight_scale_2"] for e in entries])
    flags = [e4m3_nan(s).any() for s in scales] + [~torch.isfinite(s.view(torch.float32)).all() for s in decode]
    if not any_flagged(flags):
        return set()
    return {i for i, e in enumerate(entries)
            if bool(e4m3_nan(e.tensors["weight_scale"].view(torch.uint8)).any())
            or not bool(torch.isfinite(e.tensors["weight_scale_2"]).all())}


def _spans(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Flat uint8 views covering `tensors` (each contiguous): tensors that abut in one storage merge
    into one span, so a region of a planned bucket is one view however many entries it holds."""
    spans: list[list] = []                                  # [storage, start byte, end byte]
    for t in sorted((t.contiguous() for t in tensors),
                    key=lambda t: (t.device.type, t.device.index or 0, t.untyped_storage().data_ptr(),
                                   t.storage_offset() * t.element_size())):
        st = t.untyped_storage()
        a = t.storage_offset() * t.element_size()
        b = a + t.numel() * t.element_size()
        if spans and spans[-1][0].data_ptr() == st.data_ptr() and spans[-1][0].device == st.device \
                and a <= spans[-1][2]:
            spans[-1][2] = max(spans[-1][2], b)
        else:
            spans.append([st, a, b])
    return [torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, a, (b - a,)) for st, a, b in spans]
