"""vLLM linear method of nvfp4_sampler: NVFP4 weights, per-token NVFP4 activations.

Parameters of a quantized linear (checkpoint layout, kept as they are; no derived tensors):
  weight          uint8 [N, K/2]           (N = sum of this rank's output shards)
  weight_scale    float8_e4m3fn [N, K/16]
  weight_scale_2  float32 [N]              one decode scale per checkpoint tensor, spread over its rows
Every parameter's `weight_loader` takes one checkpoint tensor (BF16 `P.weight`, or one of the NVFP4
triplet) and writes it through `sampler_plugin.layers`.
"""
from __future__ import annotations

import types

import torch
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearMethodBase, QKVParallelLinear,
                                               RowParallelLinear)

from nvfp4_sampler.kernels import NVFP4Tensor

from .. import layers
from ..config import SamplerConfig
from .layerwise import abort_on_error, complete_load, records


@abort_on_error
def _load(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """`weight_loader` of an NVFP4 linear's parameters (bound to the layer): one checkpoint tensor into its shard.
    On meta parameters (vLLM's layerwise-reload counting pass) shape-only, and not recorded."""
    method = layer.quant_method
    index = layers.QKV_SHARD_INDEX[shard_id] if isinstance(shard_id, str) else (shard_id or 0)
    shard, storage = method.shards(layer)[index], method.storage(layer)
    layers.write(storage, shard, param.nvfp4_kind, loaded_weight, config=method.config)
    if records(layer, "weight", storage):
        method.tracker(layer).record(shard, param.nvfp4_kind, loaded_weight)


def linear_shards(layer: torch.nn.Module, shard_names: list[str]) -> list[layers.Shard]:
    """The checkpoint tensors of a (possibly fused, possibly tensor-parallel) vLLM linear layer."""
    sizes, input_size, k_part = layer.nvfp4_geometry
    tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    column = isinstance(layer, ColumnParallelLinear)
    row = isinstance(layer, RowParallelLinear)
    src_cols = slice(tp_rank * k_part, (tp_rank + 1) * k_part) if row else slice(None)
    shards, offset = [], 0
    for i, (name, size) in enumerate(zip(shard_names, sizes)):
        replicas = getattr(layer, "num_kv_head_replicas", 1) if isinstance(layer, QKVParallelLinear) and i > 0 else 1
        rank = tp_rank // replicas
        full_n = size * tp_size // replicas if column else size
        src_rows = slice(rank * size, (rank + 1) * size) if column else slice(None)
        shards.append(layers.Shard(name=name, shape=(full_n, input_size), rows=slice(offset, offset + size),
                                   src_rows=src_rows, src_cols=src_cols))
        offset += size
    return shards


class NVFP4LinearMethod(LinearMethodBase):
    """W4A4 linear for one module `prefix`; `shard_names` are its checkpoint tensors' prefixes."""

    def __init__(self, config: SamplerConfig, prefix: str, shard_names: list[str], on_processed):
        self.config = config
        self.prefix = prefix
        self.shard_names = shard_names
        self.on_processed = on_processed

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if len(output_partition_sizes) != len(self.shard_names):
            raise ValueError(f"nvfp4_sampler: {self.prefix}: {len(output_partition_sizes)} output shards but "
                             f"checkpoint names {self.shard_names}")
        w = layers.create_weight(sum(output_partition_sizes), input_size_per_partition, name=self.prefix)
        layer.nvfp4_geometry = (list(output_partition_sizes), input_size, input_size_per_partition)
        layers.register_weight(layer, w, self._loader(layer))
        # a row-parallel rank holds a K-slice of every token: its per-token amax must span all ranks
        row_sharded = isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1
        layer.nvfp4_tp_group = get_tp_group().device_group if row_sharded else None
        layer.nvfp4_backend = layers.choose_backend(self.config, op="linear", name=self.prefix, device=w.codes.device,
                                                    k=input_size_per_partition, tp_amax=row_sharded)

    @staticmethod
    def _loader(layer: torch.nn.Module):
        return types.MethodType(_load, layer)   # bound to the layer, as vLLM's layerwise reload expects

    def shards(self, layer: torch.nn.Module) -> list[layers.Shard]:
        if not hasattr(layer, "nvfp4_shards"):
            layer.nvfp4_shards = linear_shards(layer, self.shard_names)
        return layer.nvfp4_shards

    def tracker(self, layer: torch.nn.Module) -> layers.LoadTracker:
        if not hasattr(layer, "nvfp4_tracker"):
            layer.nvfp4_tracker = layers.LoadTracker(self.shards(layer))
        return layer.nvfp4_tracker

    @staticmethod
    def storage(layer: torch.nn.Module) -> NVFP4Tensor:
        return layers.module_weight(layer)

    @abort_on_error
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        loaded = self.storage(layer)
        complete_load(layer, {"weight": loaded}, [("weight", s) for s in self.shards(layer)], self.tracker(layer))
        self.on_processed((loaded,))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = NVFP4Tensor(layer.weight, layer.weight_scale, layer.weight_scale_2)
        return layers.apply_linear(x, w, bias=bias, config=self.config, backend=layer.nvfp4_backend,
                                   tp_group=layer.nvfp4_tp_group)
