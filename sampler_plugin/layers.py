"""Engine-agnostic operations on NVFP4 layers: create, load, check, apply (updates: `commit`).

Engine adapters (vLLM, SGLang) own the parameters and the module tree; this module owns what a
parameter holds and how a checkpoint tensor gets into it. It imports no engine and does no math of
its own: quantization and GEMMs are `kernels.dispatch` calls.

Storage of one (possibly fused, possibly expert-stacked) weight of logical shape [*E, N, K]:
  codes         uint8 [*E, N, K/2]          E2M1 pairs, even element in the low nibble
  block_scales  float8_e4m3fn [*E, N, K/16]  linear layout
(or, for a `hopper_mma` linear, both in the "mma_tiled" layout of `kernels.cuda_mma`: every write tiles
its rows on the way in (`as_stored`), `read` untiles them)
  global_scale  float32 [*E, N] (per row) or [*E] (per expert), decode direction
A fused layer (qkv, gate_up, w13) holds one `weight_scale_2` per checkpoint tensor, spread over
that tensor's rows (docs/ARCHITECTURE.md, "Weight second-level scales are per checkpoint tensor").

Checkpoint tensors of a quantized linear `P` (ModelOpt names): `P.weight` uint8 [N, K/2] with
`P.weight_scale` float8_e4m3fn [N, K/16] and `P.weight_scale_2` float32 []; or `P.weight` in a float
dtype [N, K], quantized on arrival with the config's recipe. Shapes are the checkpoint's (before
tensor-parallel slicing); a `Shard` says which part of it this rank holds and where it goes.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
import torch.distributed._functional_collectives as funcol

from nvfp4_sampler.kernels import cuda_mma, dispatch, ops, reference  # noqa: F401  (ops registers torch.ops.nvfp4_sampler.*)
from nvfp4_sampler.kernels.format import BLOCK, NVFP4Tensor
from nvfp4_sampler.sampler_format import TRIPLET, TRIPLET_DTYPES, SamplerConfig, triplet_shapes


KINDS = TRIPLET                                     # weight, weight_scale, weight_scale_2 (sampler_format)
_NVFP4_DTYPES = {kind: getattr(torch, TRIPLET_DTYPES[kind]) for kind in TRIPLET}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
logger = logging.getLogger("nvfp4_sampler")


class MemoryReport:
    """Bytes of the quantized weights vs the same weights in BF16; logged once all layers are processed.

    An engine adapter calls add_layer() per quantized layer it creates, then processed_weight(w) for
    its weights and processed_layer() when the layer is loaded. Once every layer is counted, later
    calls (an engine re-running its post-load step after a reload) change nothing.
    """

    def __init__(self):
        self.created = self.processed = self.nbytes = self.bf16_nbytes = 0

    def add_layer(self) -> None:
        self.created += 1

    @property
    def complete(self) -> bool:
        return self.created > 0 and self.processed == self.created

    def processed_weight(self, w: NVFP4Tensor) -> None:
        if not self.complete:
            self.nbytes += w.nbytes
            self.bf16_nbytes += w.shape.numel() * 2            # the same weight in BF16

    def processed_layer(self) -> None:
        if self.complete:
            return
        self.processed += 1
        if self.complete:
            logger.warning("nvfp4_sampler: %d quantized layers hold %.2f MiB, %.3fx their BF16 size (%.2f MiB)",
                           self.created, self.nbytes / 2**20, self.ratio, self.bf16_nbytes / 2**20)

    @property
    def ratio(self) -> float:
        return self.nbytes / max(self.bf16_nbytes, 1)


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where checkpoint tensor `name` ([N, K] logical) lives in a NVFP4Tensor.

    rows: rows of this rank's weight (of expert `expert` when stacked) that it fills;
    src_rows / src_cols: the rows and the K range of the checkpoint tensor this rank holds
    (tensor parallelism; the full tensor by default). src_cols must start and end on 16-blocks.
    """

    name: str
    shape: tuple[int, int]
    rows: slice
    expert: int | None = None
    src_rows: slice = dataclasses.field(default_factory=lambda: slice(None))
    src_cols: slice = dataclasses.field(default_factory=lambda: slice(None))

    def tensor_name(self, kind: str) -> str:
        return f"{self.name}.{kind}"


def expert_shards(prefix: str, expert: int, *, hidden: int, inter: int, tp_rank: int = 0, tp_size: int = 1,
                  proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, Shard]:
    """Shards of expert `expert` of the MoE layer `prefix` ("...mlp.experts") on one tensor-parallel rank.

    Keyed "w1" (gate), "w3" (up), "w2" (down). w13 storage [E, 2I, H]: gate rows [0, I), up rows
    [I, 2I); w2 storage [E, H, I]; `inter` is I on this rank, the checkpoint holds I * tp_size.
    """
    name = f"{prefix}.{expert}"
    gate, up, down = proj_names
    part = slice(tp_rank * inter, (tp_rank + 1) * inter)
    return {
        "w1": Shard(f"{name}.{gate}", (inter * tp_size, hidden), slice(0, inter), expert, src_rows=part),
        "w3": Shard(f"{name}.{up}", (inter * tp_size, hidden), slice(inter, 2 * inter), expert, src_rows=part),
        "w2": Shard(f"{name}.{down}", (hidden, inter * tp_size), slice(0, hidden), expert, src_cols=part),
    }


QKV_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}   # engines' string shard ids of a fused qkv layer


def register_weight(module: torch.nn.Module, w: NVFP4Tensor, loader, *, stem: str = "") -> None:
    """Register w's tensors on `module` as frozen parameters `{stem}weight`, `{stem}weight_scale`,
    `{stem}weight_scale_2`, each tagged with its kind (`nvfp4_kind`) and the engine's `weight_loader`."""
    for kind, data in zip(KINDS, (w.codes, w.block_scales, w.global_scale)):
        p = torch.nn.Parameter(data, requires_grad=False)
        p.nvfp4_kind = kind
        p.weight_loader = loader
        module.register_parameter(f"{stem}{kind}", p)


def module_weight(module: torch.nn.Module, *, stem: str = "") -> NVFP4Tensor:
    """The NVFP4Tensor over the parameters `register_weight` put on `module`, in the layout its backend
    stores (`module.nvfp4_layout`, set when the backend is chosen)."""
    return NVFP4Tensor(*(getattr(module, f"{stem}{kind}").data for kind in KINDS),
                       layout=getattr(module, "nvfp4_layout", "modelopt"))


def as_stored(dst: NVFP4Tensor, kind: str, tensor: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rows of checkpoint tensor `kind` ([R, K/2] codes or [R, K/16] scales, ModelOpt) in dst's layout
    (inverse: rows of dst back to ModelOpt); decode scales and the ModelOpt layout as they are."""
    if dst.layout == "modelopt" or kind == "weight_scale_2":
        return tensor
    tile = cuda_mma.tile_codes if kind == "weight" else cuda_mma.tile_scales
    return tile(tensor, inverse=inverse)


def check_block_aligned(name: str, k: int) -> None:
    """Raise ValueError unless K (a full or per-rank input size) is a multiple of 16."""
    if k % BLOCK:
        raise ValueError(f"nvfp4_sampler: {name}: input size K={k} is not a multiple of {BLOCK} "
                         f"(an NVFP4 block scale covers {BLOCK} consecutive elements along K); a "
                         f"tensor-parallel shard must hold whole blocks: keep this module in BF16 "
                         f"(keep_bf16) or use a tensor-parallel size that divides K/{BLOCK}")


def create_weight(rows: int, k: int, *, experts: int | None = None, global_per_row: bool = True,
                  device: torch.device | str | None = None, name: str = "weight") -> NVFP4Tensor:
    """Empty storage for [*E, rows, K]; scales start as NaN so a tensor never loaded is detectable."""
    check_block_aligned(name, k)
    lead = () if experts is None else (experts,)
    gs_shape = (*lead, rows) if global_per_row else lead
    return NVFP4Tensor(
        codes=torch.zeros((*lead, rows, k // 2), dtype=torch.uint8, device=device),
        block_scales=torch.full((*lead, rows, k // BLOCK), float("nan"), device=device).to(torch.float8_e4m3fn),
        global_scale=torch.full(gs_shape, float("nan"), dtype=torch.float32, device=device),
    )


def _expected_shape(shard: Shard, kind: str) -> tuple[int, ...]:
    return triplet_shapes(*shard.shape)[kind]


def validate(shard: Shard, kind: str, tensor: torch.Tensor) -> None:
    """Raise ValueError naming `shard.name.kind` if the checkpoint tensor has a wrong dtype or shape."""
    name = shard.tensor_name(kind)
    if kind not in KINDS:
        raise ValueError(f"nvfp4_sampler: {name}: unknown tensor kind {kind!r}; expected one of {KINDS}")
    n, k = shard.shape
    if kind == "weight" and tensor.dtype in FLOAT_DTYPES:
        if tuple(tensor.shape) != (n, k):
            raise ValueError(f"nvfp4_sampler: {name}: shape {tuple(tensor.shape)} does not match the model's {(n, k)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"nvfp4_sampler: {name}: contains NaN or Inf")
        return
    if tensor.dtype != _NVFP4_DTYPES[kind]:
        expected = "uint8 (NVFP4 codes) or a float dtype (quantized on load)" if kind == "weight" else _NVFP4_DTYPES[kind]
        raise ValueError(f"nvfp4_sampler: {name}: dtype {tensor.dtype}, expected {expected}")
    shape = tuple(tensor.shape)
    expected = _expected_shape(shard, kind)
    if kind == "weight_scale_2" and shape in ((), (1,)):
        return
    if shape != expected:
        raise ValueError(f"nvfp4_sampler: {name}: shape {shape} does not match the model's {expected} "
                         f"(logical weight {(n, k)})")


def _cols(src_cols: slice, per: int) -> slice:
    """A K-element slice as a slice of a packed dim holding `per` elements per entry."""
    start, stop = src_cols.start, src_cols.stop
    return slice(None if start is None else start // per, None if stop is None else stop // per)


def _dst(dst: NVFP4Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of codes, block_scales, global_scale that shard writes."""
    lead = () if shard.expert is None else (shard.expert,)
    per_row = dst.global_scale.dim() == dst.codes.dim() - 1
    gs = dst.global_scale[(*lead, shard.rows)] if per_row else dst.global_scale[lead]
    return dst.codes[(*lead, shard.rows)], dst.block_scales[(*lead, shard.rows)], gs


def write(dst: NVFP4Tensor, shard: Shard, kind: str, tensor: torch.Tensor, *, config: SamplerConfig) -> None:
    """Write checkpoint tensor `shard.name.kind` (validated here) into its rows of dst, in place.

    A float `weight` is quantized with config.recipe.weight and config.recipe.op_order using the amax of the
    whole checkpoint tensor (so tensor-parallel slices agree) and fills all three storage tensors.
    On `meta` storage the same views are written shape-only (nothing of `tensor` read but its dtype
    and shape): vLLM's layerwise reload runs every weight loader on meta copies first and counts
    the elements copied.
    No host sync: scalars are copied on the device.
    """
    validate(shard, kind, tensor)
    codes, scales, gs = _dst(dst, shard)
    online = kind == "weight" and tensor.dtype in FLOAT_DTYPES
    if online and config.recipe.weight == "2d" and (shard.src_rows.start or 0) % BLOCK:
        raise ValueError(f"nvfp4_sampler: {shard.tensor_name(kind)}: the 2d recipe needs tensor-parallel row "
                         f"slices that start on a {BLOCK}-row tile, got row {shard.src_rows.start}")
    if codes.is_meta:
        views = (codes, scales, gs) if online else {"weight": (codes,), "weight_scale": (scales,),
                                                    "weight_scale_2": (gs,)}[kind]
        for view in views:
            view.copy_(torch.empty_like(view))
        return
    tensor = tensor.to(codes.device)
    if online:
        part = tensor[shard.src_rows, shard.src_cols]
        q = dispatch.quantize_weight_on(part, recipe=config.recipe.weight, amax=reference.weight_amax(tensor),
                                        op_order=config.recipe.op_order, backend=config.backend)
        codes.copy_(as_stored(dst, "weight", q.codes))
        scales.copy_(as_stored(dst, "weight_scale", q.block_scales))
        gs.copy_(q.global_scale.reshape(()).expand_as(gs))
    elif kind == "weight":
        codes.copy_(as_stored(dst, kind, tensor[shard.src_rows, _cols(shard.src_cols, 2)]))
    elif kind == "weight_scale":
        scales.copy_(as_stored(dst, kind, tensor[shard.src_rows, _cols(shard.src_cols, BLOCK)]))
    else:
        gs.copy_(tensor.reshape(()).expand_as(gs))


def copy_shard(dst: NVFP4Tensor, src: NVFP4Tensor, shard: Shard) -> None:
    """Copy shard's rows (codes, block scales, decode scales) from src into dst (same geometry)."""
    for d, s in zip(_dst(dst, shard), _dst(src, shard)):
        d.copy_(s)


def read(src: NVFP4Tensor, shard: Shard) -> dict[str, torch.Tensor]:
    """The checkpoint triplet of `shard` as this rank holds it: {kind: tensor} (inverse of `write`)."""
    codes, scales, gs = _dst(src, shard)
    return {"weight": as_stored(src, "weight", codes, inverse=True).clone(),
            "weight_scale": as_stored(src, "weight_scale", scales, inverse=True).clone(),
            "weight_scale_2": gs.reshape(-1)[0].clone()}


class LoadTracker:
    """Which checkpoint tensors of a layer were written, to name the missing ones after loading."""

    def __init__(self, shards: Iterable[Shard]):
        self.shards = list(shards)
        self.seen: set[tuple[str, str]] = set()

    def record(self, shard: Shard, kind: str, tensor: torch.Tensor) -> None:
        if kind == "weight" and tensor.dtype in FLOAT_DTYPES:
            self.seen.update((shard.name, k) for k in KINDS)
        else:
            self.seen.add((shard.name, kind))

    def untouched(self) -> list[Shard]:
        """Shards of which no tensor was written."""
        touched = {name for name, _ in self.seen}
        return [s for s in self.shards if s.name not in touched]

    def kept(self, shard: Shard) -> None:
        """Record that shard keeps the values it had (copied from the serving storage)."""
        self.seen.update((shard.name, k) for k in KINDS)

    def missing(self) -> list[str]:
        """Tensors never written."""
        return [s.tensor_name(k) for s in self.shards for k in KINDS if (s.name, k) not in self.seen]

    def check(self) -> None:
        """Raise ValueError naming every checkpoint tensor that never arrived (see `missing`)."""
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"nvfp4_sampler: checkpoint tensor(s) missing: {shown} (a pre-quantized layer needs "
                             f"weight, weight_scale and weight_scale_2; a BF16 one needs weight)")

    def reset(self) -> None:
        """Start a new load (the next reload records from scratch)."""
        self.seen.clear()


def choose_backend(config: SamplerConfig, *, op: str, name: str, device: torch.device | str, k: int,
                   tp_amax: bool = False, rows: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> str:
    """The kernels backend name that runs layer `name` (once per layer, when weights are created);
    its `weight_layout` is the layout the layer stores.

    op: "linear" or "moe"; k: the layer's (per-rank) input size; tp_amax: a row-parallel layer on
    more than one tensor-parallel rank, which passes the all-reduced activation amax; rows: the rows
    of each checkpoint tensor the layer stacks (this rank's; layers written by shard pass them); dtype:
    the activations' dtype when the engine says it (None: unknown). Raises
    RuntimeError naming the layer and every backend's reason if none can serve it (or the one
    `config.backend` forces cannot).
    """
    req = dispatch.Requirements(op, scaling=config.recipe.activation_scaling, amax_override=tp_amax, k=k,
                                rows=tuple(rows), strict=config.strict, dtype=dtype)
    try:
        return dispatch.choose_backend(device, config.backend, req=req).name
    except (RuntimeError, ValueError) as e:
        raise type(e)(f"nvfp4_sampler: {name}: {e}") from None


def apply_linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, config: SamplerConfig,
                 backend: str | None = None, tp_group=None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: activations quantized per config, W4A4 GEMM
    (`torch.ops.nvfp4_sampler.linear`).

    backend: the name `choose_backend` gave at load (engine forwards always pass it); None chooses
    here, which probes (tools and tests outside engines only).
    tp_group: the tensor-parallel process group of a row-parallel layer sharded over more than one
    rank, whose x holds only this rank's K-slice of each token. The activation amax (per token, or
    per tensor) is then all-reduced (MAX) over the group first (a functional collective, so
    torch.compile traces it), and every rank quantizes its slice with the scale of the whole row:
    the codes equal those of the unsharded layer (and of the learner).
    """
    amax = None
    if tp_group is not None:
        per_token = config.recipe.activation_scaling == "per_token"
        amax = x.abs().float().amax(-1) if per_token else x.abs().float().amax()
        amax = funcol.all_reduce(amax, "max", tp_group)
    if backend is None:
        backend = choose_backend(config, op="linear", name="linear", device=x.device, k=x.shape[-1],
                                 tp_amax=amax is not None)
    return torch.ops.nvfp4_sampler.linear(x, w.codes, w.block_scales, w.global_scale, bias, amax,
                                          scaling=config.recipe.activation_scaling, op_order=config.recipe.op_order,
                                          backend=backend, strict=config.strict)


def apply_moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, config: SamplerConfig, backend: str | None = None,
              tp_group=None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] gate rows then up rows; w2 [E, H, I]; routing given -> [T, H]
    (`torch.ops.nvfp4_sampler.moe`). backend: as in `apply_linear`. tp_group: the process group of the
    tensor-parallel ranks over which I is split (each holds I / tp of every expert): each SwiGLU row's
    amax is all-reduced over it before the row is quantized for w2, as the unsharded layer quantizes it;
    the result is this rank's partial sum, which the engine all-reduces."""
    if backend is None:
        backend = choose_backend(config, op="moe", name="moe", device=x.device, k=x.shape[-1],
                                 tp_amax=tp_group is not None)
    return torch.ops.nvfp4_sampler.moe(x, w13.codes, w13.block_scales, w13.global_scale, w2.codes, w2.block_scales,
                                       w2.global_scale, topk_weights, topk_ids, op_order=config.recipe.op_order,
                                       backend=backend, strict=config.strict,
                                       amax_group=None if tp_group is None else tp_group.group_name)
