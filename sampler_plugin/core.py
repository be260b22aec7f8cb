"""The engine-agnostic layer core: one NVFP4 linear layer, or one MoE layer's experts, in any engine.

An engine adapter's quantization config inherits `ConfigCore` and its engine's QuantizationConfig;
its methods inherit `LinearCore` or `ExpertsCore` and their engine's method base class, and
translate the engine's argument names and layer attributes into the core's calls (`create_linear` /
`create_experts`, `parallel`, `forward_experts`). Where both engines call a method with the same
arguments (`process_weights_after_loading`, a linear's `apply`), the core answers it itself. An
adapter does no math and keeps no state of its own. The core owns, per layer:
- config and checkpoint names: the SamplerConfig, the layer's checkpoint prefix(es);
- shards: which checkpoint tensor fills which rows (and, under tensor parallelism, which part of it);
- backend: the kernels backend chosen once when the weights are created (`layer.nvfp4_backend`);
- storage: the parameters (`weight`, `weight_scale`, `weight_scale_2`, with a `w13_` / `w2_` stem for
  experts), the checkpoint's shapes and dtypes in the layout of the backend (`layer.nvfp4_layout`:
  ModelOpt, or "mma_tiled" for `hopper_mma` linears, into which every write tiles its rows): nothing
  derived can go stale and a reload writes the tensors the engine serves with (same addresses);
- loading: every parameter's `weight_loader`, bound to the layer (vLLM's layerwise reload unbinds
  and rebinds loaders bound to the layer), and the load bookkeeping (`process_weights_after_loading`);
- reload targets: `reload_targets(model)`, checkpoint name -> where that tensor lives.

Per-layer state lives on the layer (`layer.nvfp4_*`), the method holds config, names and the memory
report. Load bookkeeping, one protocol for both engines: the storage the first post-load step sees
is the serving storage (`layer.nvfp4_serving`). A write into any other storage (vLLM's layerwise
reload materializes fresh parameters for each layer) is recorded, and the post-load step copies the
shards that received nothing from the serving storage (a partial update keeps what it did not
send), then requires every checkpoint tensor (ValueError naming the missing ones). A write straight
into the serving storage after the first load (SGLang's updates, `model.load_weights` on a running
vLLM model) is not recorded: each tensor is validated as it is written, and the update paths that
can be are checked whole first (docs/ARCHITECTURE.md, "Weight updates: one rule"). Writes on `meta`
storage (vLLM's counting pass) are shape-only and not recorded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Iterator

import torch

from nvfp4_sampler.kernels import NVFP4Tensor, dispatch, switches
from nvfp4_sampler.sampler_format import METHOD_NAME, SamplerConfig

from . import commit, layers
from .policy import quantized_linear_shards

# Load-time warm-up (CUDA): a layer of a shape not seen before runs its forward at these token counts as the
# first post-load step ends, so every kernel variant the dispatch can pick compiles before the engine serves
# (without it vLLM's JIT monitor saw _act_quant_kernel, _schedule_kernel and _exact_gemm_kernel compile while
# serving, and timed runs stalled up to 6.7 s: H100, twenty-second session). Powers of two, one more and 1.5x,
# up to 8192 tokens: both sides of every size bound of the dispatch (rows 4/5, 8/9, 16/17, 64/65; pairs at
# top-8 32, 513, 2048, 4096, 8192 and 256 rows an expert); larger counts take the variants of 8192. The kernels
# do not specialize on counts of tokens (`do_not_specialize`): Triton's divisibility classes of several counts
# (rows, pairs, tiles) combine by the routing, which no grid covers (H100, twenty-third session: compilations
# while serving after a warm-up). NVFP4_SAMPLER_WARMUP=0 turns it off.
WARMUP_TOKENS = tuple(sorted({n for i in range(14) for n in (1 << i, (1 << i) + 1, (3 << i) >> 1) if n <= 8192}))
WARMUP = switches.choice("NVFP4_SAMPLER_WARMUP", ("1", "0")) == "1"
_WARMED: set[tuple] = set()


class ConfigCore:
    """What vLLM's and SGLang's QuantizationConfig both hold and answer; adapters list it before their
    engine's QuantizationConfig base class and pick the method per layer with `linear_method`."""

    packed_modules_mapping: dict[str, list[str]]

    def __init__(self, sampler: SamplerConfig | None = None):
        super().__init__()
        self.sampler = sampler or SamplerConfig()
        self.memory = layers.MemoryReport()      # logged once every quantized layer is loaded

    def linear_method(self, method_cls: type[LinearCore], prefix: str) -> LinearCore | None:
        """`method_cls` for linear module `prefix` if it is NVFP4 (its fused parts named from
        `packed_modules_mapping`), None if it stays BF16."""
        names = quantized_linear_shards(prefix, self.packed_modules_mapping, self.sampler)
        return None if names is None else method_cls(self.sampler, prefix, names, self.memory)

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0      # the torch reference backend runs on every device

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []     # quantization_config lives in config.json; none: online quantization


def _stem(storage: str) -> str:
    """Storage name -> parameter-name stem: "weight" -> "" (weight, weight_scale, ...), "w13" -> "w13_"."""
    return "" if storage == "weight" else f"{storage}_"


@dataclasses.dataclass(frozen=True)
class LinearParallel:
    """Where a linear layer sits in tensor parallelism (the engine's layer attributes, translated).

    column: output rows split over ranks (each checkpoint tensor's rows); row: input K split over
    ranks; kv_replicas: ranks that hold the same k/v heads of a fused qkv layer.
    """

    tp_rank: int = 0
    tp_size: int = 1
    column: bool = False
    row: bool = False
    kv_replicas: int = 1


class LayerCore:
    """What linear and experts share: config, storage, the weight loader, load bookkeeping, targets."""

    storages: tuple[str, ...]

    def __init__(self, config: SamplerConfig, prefix: str, memory: layers.MemoryReport):
        self.config = config
        self.prefix = prefix       # the checkpoint prefix ("...self_attn.qkv_proj", "...mlp.experts")
        self.memory = memory

    # -- engine hooks ---------------------------------------------------------------------------
    def abort_pending(self) -> None:
        """Called when a weight loader or the post-load step raises, before the error propagates (vLLM puts
        the layers of a layerwise reload in progress back on their serving tensors)."""

    @contextlib.contextmanager
    def _aborting(self) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.abort_pending()
            raise

    # -- storage and shards ---------------------------------------------------------------------
    def storage(self, layer: torch.nn.Module) -> dict[str, NVFP4Tensor]:
        """The layer's NVFP4 weights by storage name, over its parameters as they are now."""
        return {s: layers.module_weight(layer, stem=_stem(s)) for s in self.storages}

    def shards(self, layer: torch.nn.Module) -> list[tuple[str, layers.Shard]]:
        """(storage name, shard) of every checkpoint tensor of the layer."""
        raise NotImplementedError

    def locate(self, layer: torch.nn.Module, *args, **kwargs) -> tuple[str, layers.Shard]:
        """(storage name, shard) that a weight-loader call writes, from the loader's arguments after
        (param, loaded_weight)."""
        raise NotImplementedError

    def tracker(self, layer: torch.nn.Module) -> layers.LoadTracker:
        if not hasattr(layer, "nvfp4_tracker"):
            layer.nvfp4_tracker = layers.LoadTracker(s for _, s in self.shards(layer))
        return layer.nvfp4_tracker

    def targets(self, layer: torch.nn.Module) -> dict[str, commit.Target]:
        """Checkpoint prefix of each shard -> Target over the storage the layer serves with now."""
        storage = self.storage(layer)
        return {s.name: commit.Target(weight=storage[name], shard=s) for name, s in self.shards(layer)}

    def _register(self, layer: torch.nn.Module, weights: dict[str, NVFP4Tensor], loader, *, op: str,
                  k: int, tp_amax: bool = False, rows: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> None:
        bound = types.MethodType(loader, layer)
        for name, w in weights.items():
            layers.register_weight(layer, w, bound, stem=_stem(name))
        first = next(iter(weights.values()))
        layer.nvfp4_backend = layers.choose_backend(self.config, op=op, name=self.prefix, device=first.codes.device,
                                                    k=k, tp_amax=tp_amax, rows=rows, dtype=dtype)
        layer.nvfp4_layout = dispatch.BACKENDS[layer.nvfp4_backend].weight_layout
        self.memory.add_layer()

    # -- loading --------------------------------------------------------------------------------
    def load(self, layer: torch.nn.Module, param: torch.nn.Parameter, tensor: torch.Tensor, *args, **kwargs) -> None:
        """One checkpoint tensor into its shard (`layers.write`: validated; shape-only on meta)."""
        with self._aborting():
            name, shard = self.locate(layer, *args, **kwargs)
            storage = self.storage(layer)[name]
            layers.write(storage, shard, param.nvfp4_kind, tensor, config=self.config)
            serving = getattr(layer, "nvfp4_serving", None)
            if not storage.codes.is_meta and (serving is None or
                                              serving[name].codes.data_ptr() != storage.codes.data_ptr()):
                self.tracker(layer).record(shard, param.nvfp4_kind, tensor)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The post-load step (both engines call it after loading and after updates): keep what a
        reload did not send, check that every checkpoint tensor arrived, start the next load, count
        the memory. Repeated with nothing recorded since, it checks nothing."""
        with self._aborting():
            loaded = self.storage(layer)
            tracker = self.tracker(layer)
            first = not hasattr(layer, "nvfp4_serving")
            if first:
                layer.nvfp4_serving = dict(loaded)
            if first or tracker.seen:
                serving = layer.nvfp4_serving
                untouched = {s.name for s in tracker.untouched()}
                for name, shard in self.shards(layer):
                    if shard.name in untouched and loaded[name].codes.data_ptr() != serving[name].codes.data_ptr():
                        layers.copy_shard(loaded[name], serving[name], shard)
                        tracker.kept(shard)
                tracker.check()
                tracker.reset()
        for w in loaded.values():
            self.memory.processed_weight(w)
        self.memory.processed_layer()
        if first and WARMUP and next(iter(loaded.values())).codes.is_cuda:
            self.warm_up(layer)

    def warm_up(self, layer: torch.nn.Module, tokens: tuple[int, ...] = WARMUP_TOKENS) -> int:
        """Run the layer's forward at each of `tokens` (zero activations, any routing) unless a layer of the
        same shapes, backend, dtype and config ran them in this process: its kernels compile now, not while
        serving. Returns the forwards run (0: warmed before, or nothing to run)."""
        storage = self.storage(layer)
        key = (type(self).__name__, layer.nvfp4_backend, getattr(layer, "nvfp4_dtype", None), repr(self.config),
               tuple((n, tuple(w.shape), w.codes.device, w.global_scale.dim()) for n, w in storage.items()),
               getattr(layer, "nvfp4_top_k", None))
        if key in _WARMED:
            return 0
        _WARMED.add(key)
        t0 = time.perf_counter()
        with torch.no_grad():
            runs = sum(self._warm_up_forward(layer, t) for t in tokens)
        device = next(iter(storage.values())).codes.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()                 # its activations' blocks: not the engine's to account for
        if runs:
            layers.logger.warning("nvfp4_sampler: %s: kernels warmed at %d token counts in %.1f s (once per layer "
                                  "shape; NVFP4_SAMPLER_WARMUP=0 skips it)", self.prefix, runs, time.perf_counter() - t0)
        return runs

    def _warm_up_forward(self, layer: torch.nn.Module, tokens: int) -> bool:
        """One forward of `tokens` tokens for `warm_up`; False where the layer cannot run one alone."""
        raise NotImplementedError


def _load_linear(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
    """`weight_loader` of a linear's NVFP4 parameters (bound to the layer). shard_id: the engine's id of
    a fused layer's part (0, 1, ... or "q", "k", "v"), None for an unfused layer."""
    layer.quant_method.load(layer, param, loaded_weight, shard_id)


def _load_experts(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                  shard_id: str, expert_id: int, return_success: bool = False):
    """`weight_loader` of the expert parameters (bound to the layer): one expert's checkpoint tensor,
    shard_id "w1" (gate), "w3" (up) or "w2" (down)."""
    layer.quant_method.load(layer, param, loaded_weight, weight_name, shard_id, expert_id)
    return True if return_success else None


class LinearCore(LayerCore):
    """One NVFP4 linear layer (possibly fused, possibly tensor-parallel); `shard_names` are the
    checkpoint prefixes of its parts, in the engine's output order."""

    storages = ("weight",)

    def __init__(self, config: SamplerConfig, prefix: str, shard_names: list[str], memory: layers.MemoryReport):
        super().__init__(config, prefix, memory)
        self.shard_names = shard_names

    def parallel(self, layer: torch.nn.Module) -> LinearParallel:
        """Engine hook: the layer's tensor-parallel placement (read at the first load)."""
        return LinearParallel()

    def create_linear(self, layer: torch.nn.Module, *, output_sizes: list[int], input_size: int, k_part: int,
                      tp_group=None, dtype: torch.dtype | None = None) -> None:
        """Register the parameters for outputs `output_sizes` (this rank's rows of each part) x `k_part`
        (this rank's K of `input_size`), and choose the backend. tp_group: the process group of a
        row-parallel layer over more than one rank (its activation amax is all-reduced). dtype: the
        engine's activation dtype (params_dtype), so a backend that cannot take it is refused at load."""
        if len(output_sizes) != len(self.shard_names):
            raise ValueError(f"nvfp4_sampler: {self.prefix}: {len(output_sizes)} output shards but "
                             f"checkpoint names {self.shard_names}")
        w = layers.create_weight(sum(output_sizes), k_part, name=self.prefix)
        layer.nvfp4_geometry = (list(output_sizes), input_size, k_part)
        layer.nvfp4_tp_group = tp_group
        layer.nvfp4_dtype = dtype
        self._register(layer, {"weight": w}, _load_linear, op="linear", k=k_part, tp_amax=tp_group is not None,
                       rows=tuple(output_sizes), dtype=dtype)

    def shards(self, layer: torch.nn.Module) -> list[tuple[str, layers.Shard]]:
        if not hasattr(layer, "nvfp4_shards"):
            sizes, input_size, k_part = layer.nvfp4_geometry
            p = self.parallel(layer)
            src_cols = slice(p.tp_rank * k_part, (p.tp_rank + 1) * k_part) if p.row else slice(None)
            shards, offset = [], 0
            for i, (name, size) in enumerate(zip(self.shard_names, sizes)):
                replicas = p.kv_replicas if i > 0 else 1
                rank = p.tp_rank // replicas
                full_n = size * p.tp_size // replicas if p.column else size
                src_rows = slice(rank * size, (rank + 1) * size) if p.column else slice(None)
                shards.append(("weight", layers.Shard(name=name, shape=(full_n, input_size),
                                                      rows=slice(offset, offset + size),
                                                      src_rows=src_rows, src_cols=src_cols)))
                offset += size
            layer.nvfp4_shards = shards
        return layer.nvfp4_shards

    def locate(self, layer: torch.nn.Module, shard_id=None) -> tuple[str, layers.Shard]:
        index = layers.QKV_SHARD_INDEX[shard_id] if isinstance(shard_id, str) else (shard_id or 0)
        return self.shards(layer)[index]

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = NVFP4Tensor(layer.weight, layer.weight_scale, layer.weight_scale_2)
        return layers.apply_linear(x, w, bias=bias, config=self.config, backend=layer.nvfp4_backend,
                                   tp_group=layer.nvfp4_tp_group)

    def _warm_up_forward(self, layer: torch.nn.Module, tokens: int) -> bool:
        if layer.nvfp4_tp_group is not None:       # its amax all-reduce: every rank would have to join
            return False
        bias = getattr(layer, "bias", None)
        dtype = layer.nvfp4_dtype or torch.bfloat16
        self.apply(layer, torch.zeros(tokens, layer.weight.shape[-1] * 2, dtype=dtype, device=layer.weight.device),
                   bias if isinstance(bias, torch.Tensor) else None)
        return True


class ExpertsCore(LayerCore):
    """The SwiGLU experts of one MoE layer (`prefix` "...mlp.experts"), routing left to the engine.
    w13 [E, 2I, H] gate rows then up rows, one decode scale per row; w2 [E, H, I], one per expert."""

    storages = ("w13", "w2")

    def create_experts(self, layer: torch.nn.Module, *, num_experts: int, hidden: int, inter: int,
                       tp_rank: int = 0, tp_size: int = 1, tp_group=None, top_k: int | None = None,
                       dtype: torch.dtype | None = None) -> None:
        """Register the expert parameters (`inter`: the intermediate size on this rank) and choose the backend.
        tp_group: with tp_size > 1, the ranks' process group (each SwiGLU row's amax is all-reduced over it,
        `layers.apply_moe`). top_k, dtype: the routing's experts per token and the activations' dtype (the
        load-time warm-up's forwards; without top_k it runs none)."""
        if (tp_size > 1) != (tp_group is not None):
            raise ValueError(f"nvfp4_sampler: {self.prefix}: tp_size {tp_size} needs a tensor-parallel group "
                             f"exactly when it is above 1")
        layer.nvfp4_top_k, layer.nvfp4_dtype, layer.nvfp4_tp_group = top_k, dtype, tp_group
        if self.config.recipe.activation_scaling != "per_token":
            raise ValueError(f"nvfp4_sampler: {self.prefix}: MoE experts support activation_scaling="
                             f"'per_token' only, got {self.config.recipe.activation_scaling!r}")
        w13 = layers.create_weight(2 * inter, hidden, experts=num_experts, name=f"{self.prefix}.*.gate_proj/up_proj")
        w2 = layers.create_weight(hidden, inter, experts=num_experts, global_per_row=False,
                                  name=f"{self.prefix}.*.down_proj (intermediate size per tensor-parallel rank)")
        layer.nvfp4_experts = [layers.expert_shards(self.prefix, e, hidden=hidden, inter=inter, tp_rank=tp_rank,
                                                    tp_size=tp_size) for e in range(num_experts)]
        self._register(layer, {"w13": w13, "w2": w2}, _load_experts, op="moe", k=hidden, tp_amax=tp_group is not None)

    def shards(self, layer: torch.nn.Module) -> list[tuple[str, layers.Shard]]:
        return [("w2" if sid == "w2" else "w13", s) for expert in layer.nvfp4_experts for sid, s in expert.items()]

    def locate(self, layer: torch.nn.Module, weight_name: str, shard_id: str,
               expert_id: int) -> tuple[str, layers.Shard]:
        return "w2" if shard_id == "w2" else "w13", layer.nvfp4_experts[expert_id][shard_id]

    def forward_experts(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        w13 = NVFP4Tensor(layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2)
        w2 = NVFP4Tensor(layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_scale_2)
        return layers.apply_moe(x, w13, w2, topk_weights, topk_ids, config=self.config, backend=layer.nvfp4_backend,
                                tp_group=layer.nvfp4_tp_group)

    def _warm_up_forward(self, layer: torch.nn.Module, tokens: int) -> bool:
        k = layer.nvfp4_top_k
        if not k or layer.nvfp4_tp_group is not None:     # its amax all-reduce: every rank would have to join
            return False
        experts, _, half_hidden = layer.w13_weight.shape              # codes: two per byte
        device = layer.w13_weight.device
        ids = (torch.arange(tokens * k, device=device, dtype=torch.int32) % experts).view(tokens, k)  # as vLLM routes:
        weights = torch.full((tokens, k), 1.0 / k, device=device)                                    # int32, fp32
        x = torch.zeros(tokens, half_hidden * 2, dtype=layer.nvfp4_dtype or torch.bfloat16, device=device)
        self.forward_experts(layer, x, weights, ids)
        return True


def is_nvfp4(module: torch.nn.Module) -> bool:
    """Whether `module` is an NVFP4 layer of this plugin (its quant_method is a layer core)."""
    return isinstance(getattr(module, "quant_method", None), LayerCore)


def shard_of(loader, *args, **kwargs) -> layers.Shard:
    """The shard a core `weight_loader` (bound to its layer) would write, given its arguments after
    (param, loaded_weight): for checks that validate a tensor without writing it."""
    layer = loader.__self__
    return layer.quant_method.locate(layer, *args, **kwargs)[1]


def reload_targets(model: torch.nn.Module, plain_rows=None) -> dict[str, commit.Target]:
    """Checkpoint name -> Target for every reloadable tensor of an engine's model.

    NVFP4 layers are keyed by checkpoint module prefix ("model.layers.0.self_attn.k_proj",
    "model.layers.0.mlp.experts.3.up_proj"); plain tensors by full name ("model.norm.weight").
    plain_rows(module, parameter name) -> (rows, checkpoint rows) or None: the engine adapter's word on
    which rows of its checkpoint tensor a plain parameter holds (a vocab-parallel embedding's part).
    """
    targets: dict[str, commit.Target] = {}
    for module in model.modules():
        if is_nvfp4(module):
            targets.update(module.quant_method.targets(module))
    for name, p in model.named_parameters(remove_duplicate=False):
        if not hasattr(p, "nvfp4_kind") and p.numel() > 0:
            owner, _, pname = name.rpartition(".")
            part = plain_rows(model.get_submodule(owner), pname) if plain_rows else None
            targets[name] = (commit.Target(param=p.data) if part is None else
                             commit.Target(param=p.data, rows=part[0], shape=(part[1], *p.shape[1:])))
    return targets
