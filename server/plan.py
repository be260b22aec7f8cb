"""The transfer plan of a weight update: computed once per run, so each bucket carries only its index.

A manifest (one `TensorEntry` per checkpoint tensor: ~18.9k for Qwen3-30B-A3B, every expert's
projection its own NVFP4 triplet) is grouped into **fused entries** as the engines hold them:

  * all experts of a layer's MoE projections: `...mlp.experts.w13_weight` (gate rows then up rows
    per expert: codes [E, 2I, H/2], block scales [E, 2I, H/16], decode scales [E, 2]) and
    `...mlp.experts.w2_weight` ([E, H, I/2], [E, H, I/16], [E, 1]), vLLM's FusedMoE layout;
  * `...self_attn.qkv_proj.weight` (q, k, v rows; decode scales [3]) and `...mlp.gate_up_proj.weight`
    (gate, up; [2]), vLLM's fused linear layout;
  * every other tensor (o_proj, down_proj, norms, router, embeddings, lm_head) on its own.

A group fuses only when complete and uniform (every expert, every shard; one layout, dtype and
column count); otherwise its members stay single entries, so partial updates plan too. Each planned
part (codes, block scales, decode scales, or a dense tensor) has a fixed byte offset in its bucket.
A bucket is laid out by value class, each region tightly packed and 64-byte aligned: decode scales
(fp32, finite and > 0), dense fp32, bf16, fp16 (finite), block scales e4m3 (not NaN), codes
(unchecked). `validate` therefore runs a fixed handful of kernels per bucket whatever the entry
count, and records the result in a device flag (no host sync); `find_invalid` (the slow path, only
after the flag is set) names the first bad checkpoint tensor.

Both ends build the same plan from the same manifest (`TransferPlan.build` is deterministic;
`plan_id` hashes it). `member_views` turns a received bucket into checkpoint-named views (no copy)
for the engines' `apply_update`; `fused_views` gives the fused tensors themselves (a trainer can
quantize straight into them); `fused_entries` gives them as `commit.FusedEntry`s, which the
sidecar's commit hands to the engine (`commit.apply_fused`: one copy per tensor kind of an entry
that fills one engine parameter set exactly, the per-tensor path otherwise).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping

import torch

from nvfp4_sampler.sampler_format import BLOCK
from nvfp4_sampler.sampler_plugin import commit

from .protocol import TensorEntry

ALIGN = 64
DEFAULT_BUCKET_BYTES = 512 << 20

# value classes, in bucket order: (class, dtype, check)
REGIONS: tuple[tuple[str, torch.dtype, str], ...] = (
    ("scale_2", torch.float32, "positive"),
    ("float32", torch.float32, "finite"),
    ("bfloat16", torch.bfloat16, "finite"),
    ("float16", torch.float16, "finite"),
    ("scale", torch.float8_e4m3fn, "not_nan"),
    ("codes", torch.uint8, "none"),
)
_REGION = {r[0]: r for r in REGIONS}
_DENSE = {"float32", "bfloat16", "float16"}

# checkpoint name -> (fused name, expert-stacked?, slot, slots in order)
_FUSE_RULES: tuple[tuple[re.Pattern, str, bool, tuple[str, ...]], ...] = (
    (re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<s>gate_proj|up_proj)\.weight$"), "{p}.w13_weight", True,
     ("gate_proj", "up_proj")),
    (re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<s>down_proj)\.weight$"), "{p}.w2_weight", True, ("down_proj",)),
    (re.compile(r"^(?P<p>.+\.self_attn)\.(?P<s>q_proj|k_proj|v_proj)\.weight$"), "{p}.qkv_proj.weight", False,
     ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"^(?P<p>.+\.mlp)\.(?P<s>gate_proj|up_proj)\.weight$"), "{p}.gate_up_proj.weight", False,
     ("gate_proj", "up_proj")),
)


@dataclasses.dataclass(frozen=True)
class Part:
    """One tensor of a planned entry in its bucket: value class (region), shape, byte offset."""

    kind: str                      # "weight" | "weight_scale" | "weight_scale_2" | "dense"
    region: str
    shape: tuple[int, ...]
    offset: int

    @property
    def dtype(self) -> torch.dtype:
        return _REGION[self.region][1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.region, self.shape)


@dataclasses.dataclass(frozen=True)
class Member:
    """A checkpoint entry inside a fused entry: rows [row0, row1) of expert `expert` (None: not
    stacked), and its decode-scale slot `slot` (an index into the last dim of weight_scale_2)."""

    entry: TensorEntry
    expert: int | None
    row0: int
    row1: int
    slot: int


@dataclasses.dataclass(frozen=True)
class PlannedEntry:
    name: str
    layout: str                    # "nvfp4" | "dense"
    bucket: int
    parts: tuple[Part, ...]
    members: tuple[Member, ...]

    @functools.cached_property
    def slots(self) -> tuple[commit.FusedSlot, ...]:
        """The members as `commit.FusedSlot`s: one per slot (a name template over the experts when
        stacked), so a fused entry of 128 experts is described by 1-3 rows."""
        if self.members[0].expert is None:
            return tuple(commit.FusedSlot(m.entry.name, m.row0, m.row1, m.slot) for m in self.members)
        experts = len({m.expert for m in self.members})
        out = []
        for m in self.members:
            if m.expert == 0:
                pattern = re.compile(r"\.experts\.0\.")
                out.append(commit.FusedSlot(pattern.sub(".experts.{e}.", m.entry.name, count=1), m.row0, m.row1,
                                            m.slot, experts))
        return tuple(out)

    def fused(self, tensors: Mapping[str, torch.Tensor]) -> commit.FusedEntry:
        """This entry over its part tensors ({part kind: tensor}, e.g. from `fused_views`)."""
        return commit.FusedEntry(self.name, self.layout, self.slots, tensors)


@dataclasses.dataclass(frozen=True)
class Bucket:
    nbytes: int
    entries: tuple[int, ...]       # indices into TransferPlan.entries
    regions: tuple[tuple[str, int, int], ...]     # (class, byte offset, byte length), non-empty only


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    manifest: tuple[TensorEntry, ...]
    entries: tuple[PlannedEntry, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @functools.cached_property
    def plan_id(self) -> str:
        """The hash of `to_dict` (hashed once: every planned status answer names it, and a 48-layer 30B-A3B
        manifest takes ~0.1 s to dump and hash)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def tensor_count(self) -> int:
        return sum(len(e.parts) for e in self.entries)

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def build(cls, manifest: Iterable[TensorEntry], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              fuse: bool = True) -> TransferPlan:
        """The plan of `manifest` (order kept, fused groups placed where their first member is)."""
        manifest = tuple(manifest)
        groups = _group(manifest) if fuse else [(e.name, [(e, None, 0)], False) for e in manifest]
        shapes = [_fused_shapes(g) for g in groups]
        # bucket assignment: greedy in order; an entry larger than bucket_bytes gets its own bucket
        assign, cur, size = [], 0, 0
        for s in shapes:
            n = sum(_nbytes(r, sh) for _, r, sh in s) + ALIGN * len(s)
            if size and size + n > bucket_bytes:
                cur, size = cur + 1, 0
            assign.append(cur)
            size += n
        entries, buckets = [], []
        for b in range(cur + 1 if shapes else 0):
            idx = [i for i, a in enumerate(assign) if a == b]
            offsets, regions, off = {}, [], 0
            for region, _, _ in REGIONS:                          # lay out region by region
                start = off
                for i in idx:
                    for j, (_, r, sh) in enumerate(shapes[i]):
                        if r == region:
                            offsets[i, j] = off
                            off += _nbytes(r, sh)
                if off > start:
                    regions.append((region, start, off - start))
                    off = -(-off // ALIGN) * ALIGN
            for i in idx:
                name, members, _ = groups[i]
                parts = tuple(Part(k, r, sh, offsets[i, j]) for j, (k, r, sh) in enumerate(shapes[i]))
                entries.append(PlannedEntry(name, members[0][0].layout, b, parts, _members(members)))
            buckets.append(Bucket(off, tuple(range(len(entries) - len(idx), len(entries))), tuple(regions)))
        return cls(manifest, tuple(entries), tuple(buckets), bucket_bytes)

    def for_rank(self, held: Mapping[str, commit.Region | None]) -> TransferPlan:
        """The plan of what one rank holds (`commit.held_regions`): `rank_manifest`, planned as `build`
        plans (same bucket size)."""
        return TransferPlan.build(rank_manifest(self.manifest, held), bucket_bytes=self.bucket_bytes)

    # ---- buffers ------------------------------------------------------------------------------
    def fused_views(self, b: int, flat: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Fused entry name -> {part kind: view of `flat`} for bucket `b` (no copy)."""
        self._check(b, flat)
        return {e.name: {p.kind: _view(flat, p) for p in e.parts} for e in (self.entries[i] for i in self.buckets[b].entries)}

    def fused_entries(self, b: int, flat: torch.Tensor) -> list[commit.FusedEntry]:
        """Bucket `b`'s entries as `commit.FusedEntry`s over views of `flat` (for `commit.apply_fused`)."""
        views = self.fused_views(b, flat)
        return [self.entries[i].fused(views[self.entries[i].name]) for i in self.buckets[b].entries]

    def member_views(self, b: int, flat: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Checkpoint entry name -> {checkpoint tensor name: view} for bucket `b` (no copy): an NVFP4
        entry `P.weight` -> P.weight, P.weight_scale, P.weight_scale_2 ([] each); dense -> itself."""
        out = {}
        for i in self.buckets[b].entries:
            e = self.entries[i]
            parts = {p.kind: _view(flat, p) for p in e.parts}
            for m in e.members:
                out[m.entry.name] = _member_tensors(m, parts)
        return out

    def pack(self, b: int, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """Copy the checkpoint-named `tensors` (NVFP4 triplets or dense, as in `wire.iter_entries`)
        of bucket `b`'s members into `flat` (uint8 [>= nbytes], zeroed padding: `new_buffer`)."""
        for name, parts in self.member_views(b, flat).items():
            for tname, view in parts.items():
                src = tensors[tname]
                if src.dtype != view.dtype or src.numel() != view.numel():
                    raise ValueError(f"{tname}: expected {view.dtype} {list(view.shape)}, got {src.dtype} "
                                     f"{list(src.shape)}")
                view.copy_(src.reshape(view.shape))
        return flat

    def new_buffer(self, b: int | None = None, *, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed flat uint8 buffer for bucket `b` (None: the largest bucket, reusable for all)."""
        n = self.buckets[b].nbytes if b is not None else max((k.nbytes for k in self.buckets), default=0)
        return torch.zeros(n, dtype=torch.uint8, device=device)

    # ---- validation ---------------------------------------------------------------------------
    def validate(self, b: int, flat: torch.Tensor, flag: torch.Tensor | None = None) -> torch.Tensor:
        """OR into `flag` (a bool scalar on flat's device, new if None) whether bucket `b` holds a
        NaN/Inf float, a NaN block scale or a non-positive decode scale: one pass per value class
        over the whole bucket, no host synchronisation. Returns the flag (True = invalid)."""
        self._check(b, flat)
        if flag is None:
            flag = torch.zeros((), dtype=torch.bool, device=flat.device)
        for region, off, n in self.buckets[b].regions:
            _, dtype, check = _REGION[region]
            if check == "none":
                continue
            span = flat[off:off + n]
            if check == "not_nan":
                flag |= commit.e4m3_nan(span).any()
                continue
            v = span.view(dtype)
            bad = ~torch.isfinite(v)
            if check == "positive":
                bad |= v <= 0
            flag |= bad.any()
        return flag

    def find_invalid(self, b: int, flat: torch.Tensor) -> str | None:
        """The slow path after `validate` flagged bucket `b`: a message naming the first bad
        checkpoint tensor (None if none is bad)."""
        for name, parts in self.member_views(b, flat).items():
            for tname, t in parts.items():
                if t.dtype == torch.uint8:
                    continue
                if t.dtype == torch.float8_e4m3fn:
                    if commit.e4m3_nan(t.view(torch.uint8)).any():
                        return f"{tname}: NaN in the block scales"
                elif not bool(torch.isfinite(t).all()):
                    return f"{tname}: NaN or Inf values"
                elif tname.endswith(".weight_scale_2") and bool((t <= 0).any()):
                    return f"{tname}: the decode scale must be positive, got {t.item()}"
        return None

    def _check(self, b: int, flat: torch.Tensor) -> None:
        if not 0 <= b < len(self.buckets):
            raise ValueError(f"bucket {b} is not in the plan ({len(self.buckets)} buckets)")
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < self.buckets[b].nbytes:
            raise ValueError(f"bucket {b} needs a flat uint8 buffer of {self.buckets[b].nbytes} bytes, got "
                             f"{flat.dtype} {list(flat.shape)}")

    # ---- wire ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """What travels once per run: the manifest and bucket size (both ends rebuild the rest)."""
        return {"bucket_bytes": self.bucket_bytes, "manifest": [e.model_dump() for e in self.manifest]}

    @classmethod
    def from_dict(cls, d: Mapping) -> TransferPlan:
        return cls.build([TensorEntry.model_validate(e) for e in d["manifest"]], bucket_bytes=int(d["bucket_bytes"]))


def rank_manifest(manifest: Iterable[TensorEntry], held: Mapping[str, commit.Region | None]) -> list[TensorEntry]:
    """The entries of `manifest` a rank holds (`commit.held_regions`), each cut to the rank's rows and K
    range (NVFP4 shards) or rows (plain vocab-parallel tensors). ValueError for a float entry of an NVFP4
    shard held in part: an online-quantized shard needs the whole tensor's amax, so a per-rank plan takes
    sharded layers as NVFP4 triplets."""
    out = []
    for e in manifest:
        if e.name not in held:
            continue
        r = held[e.name]
        if r is None:
            out.append(e)
        elif e.layout != "nvfp4" and r.quantized:
            raise ValueError(f"{e.name}: a rank holds part of it, but it is sent as a {e.dtype} tensor (quantized on "
                             f"arrival with the whole tensor's amax): send its NVFP4 triplet, or broadcast the update")
        else:
            out.append(e.model_copy(update={"shape": [r.row1 - r.row0, r.col1 - r.col0, *e.shape[2:]]}))
    return out


class RankTensors(Mapping):
    """Checkpoint-named tensors as one rank holds them (no copy): each NVFP4 triplet's codes and block
    scales cut to the rank's `held_regions` region, everything else as given. What `TransferPlan.pack`
    of a `for_rank` plan takes on the sending side."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], held: Mapping[str, commit.Region | None]):
        self._tensors, self._held = tensors, held

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        r = self._held.get(name)
        if r is not None and not r.quantized:                # a plain tensor's rows
            return t[r.row0:r.row1, r.col0:r.col1]
        for kind, per in (("weight", 2), ("weight_scale", BLOCK)):
            if name.endswith(f".{kind}") and t.dtype in (torch.uint8, torch.float8_e4m3fn):
                r = self._held.get(f"{name.removesuffix(kind)}weight")
                if r is not None:
                    return t[r.row0:r.row1, r.col0 // per:r.col1 // per]
        return t

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _nbytes(region: str, shape: tuple[int, ...]) -> int:
    n = _REGION[region][1].itemsize
    for s in shape:
        n *= s
    return n


def _view(flat: torch.Tensor, p: Part) -> torch.Tensor:
    return flat[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)


def _group(manifest: tuple[TensorEntry, ...]) -> list[tuple[str, list[tuple[TensorEntry, int | None, int]], bool]]:
    """[(fused name, [(entry, expert, slot)], stacked)] in manifest order; incomplete or non-uniform
    groups are split back into single entries."""
    found: dict[str, dict] = {}
    order: list[tuple[str, object]] = []
    for e in manifest:
        for pattern, fmt, stacked, slots in _FUSE_RULES:
            m = pattern.match(e.name)
            if m and not (not stacked and ".experts." in e.name):
                key = fmt.format(p=m["p"])
                g = found.get(key)
                if g is None:
                    g = found[key] = {"stacked": stacked, "slots": slots, "items": []}
                    order.append(("group", key))
                g["items"].append((e, int(m["e"]) if stacked else None, slots.index(m["s"])))
                break
        else:
            order.append(("single", e))
    out = []
    for kind, x in order:
        if kind == "single":
            out.append((x.name, [(x, None, 0)], False))
            continue
        g = found[x]
        items = g["items"]
        if _fusable(items, g["stacked"], len(g["slots"])):
            items = sorted(items, key=lambda it: ((it[1] or 0), it[2]))
            out.append((x, items, g["stacked"]))
        else:
            out.extend((e.name, [(e, None, 0)], False) for e, _, _ in items)
    return out


def _fusable(items, stacked: bool, nslots: int) -> bool:
    e0 = items[0][0]
    if any(e.layout != e0.layout or e.dtype != e0.dtype or len(e.shape) != 2 or e.shape[1] != e0.shape[1]
           for e, _, _ in items):
        return False
    if e0.layout == "nvfp4" and e0.shape[1] % BLOCK:
        return False
    keys = {(x, s) for _, x, s in items}
    if len(keys) != len(items):
        return False
    if not stacked:
        return len(items) == nslots and len(items) > 1
    experts = {x for _, x, _ in items}
    if experts != set(range(len(experts))) or len(items) != len(experts) * nslots:
        return False
    rows = {}
    for e, _, s in items:                                  # each slot has one row count across experts
        if rows.setdefault(s, e.shape[0]) != e.shape[0]:
            return False
    return True


def _fused_shapes(group) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(part kind, region, shape)] of a group."""
    _, items, stacked = group
    e0 = items[0][0]
    if len(items) == 1 and e0.layout == "dense":
        return [("dense", e0.dtype, tuple(e0.shape))]
    k = e0.shape[1]
    nslots = len({s for _, _, s in items})
    if stacked:
        E = len({x for _, x, _ in items})
        rows = sum(e.shape[0] for e, x, _ in items if x == 0)
        lead: tuple[int, ...] = (E,)
    else:
        rows = sum(e.shape[0] for e, _, _ in items)
        lead = ()
    if e0.layout == "nvfp4":
        return [("weight_scale_2", "scale_2", lead + (nslots,) if (stacked or len(items) > 1) else ()),
                ("weight_scale", "scale", lead + (rows, k // BLOCK)),
                ("weight", "codes", lead + (rows, k // 2))]
    return [("dense", e0.dtype, lead + (rows, k))]


def _members(items) -> tuple[Member, ...]:
    out, row = [], {}
    for e, x, s in items:
        r0 = row.get(x, 0)
        out.append(Member(e, x, r0, r0 + (e.shape[0] if len(e.shape) else 0), s))
        row[x] = r0 + (e.shape[0] if len(e.shape) else 0)
    return tuple(out)


def _member_tensors(m: Member, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = m.entry.name
    lead = () if m.expert is None else (m.expert,)
    if m.entry.layout == "nvfp4":
        prefix = name[: -len(".weight")]
        s2 = parts["weight_scale_2"]
        return {name: parts["weight"][lead + (slice(m.row0, m.row1),)],
                f"{prefix}.weight_scale": parts["weight_scale"][lead + (slice(m.row0, m.row1),)],
                f"{prefix}.weight_scale_2": s2 if s2.dim() == 0 else s2[lead + (m.slot,)]}
    t = parts["dense"]
    if t.shape == tuple(m.entry.shape) and m.expert is None and m.row0 == 0:
        return {name: t}
    return {name: t[lead + (slice(m.row0, m.row1),)]}
