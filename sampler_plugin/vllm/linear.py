"""vLLM's LinearMethodBase over the layer core (`core.LinearCore`: parameters, loaders, post-load, apply).

Translates vLLM's layer attributes: tensor-parallel placement (column / row parallel, replicated
k/v heads) and the TP group of a row-parallel layer, whose activation amax is all-reduced. How the
core meets vLLM's layerwise reload: `layerwise.py`.
"""
from __future__ import annotations

import torch
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearMethodBase, QKVParallelLinear,
                                               RowParallelLinear)

from ..core import LinearCore, LinearParallel
from .layerwise import abort_pending


class NVFP4LinearMethod(LinearCore, LinearMethodBase):
    """W4A4 linear for one module `prefix`; `shard_names` are its checkpoint tensors' prefixes."""

    abort_pending = staticmethod(abort_pending)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        # a row-parallel rank holds a K-slice of every token: its per-token amax must span all ranks
        row_sharded = isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1
        tp_group = get_tp_group().device_group if row_sharded else None
        self.create_linear(layer, output_sizes=output_partition_sizes, input_size=input_size,
                           k_part=input_size_per_partition, tp_group=tp_group, dtype=params_dtype)

    def parallel(self, layer: torch.nn.Module) -> LinearParallel:
        qkv = isinstance(layer, QKVParallelLinear)
        return LinearParallel(tp_rank=getattr(layer, "tp_rank", 0), tp_size=getattr(layer, "tp_size", 1),
                              column=isinstance(layer, ColumnParallelLinear), row=isinstance(layer, RowParallelLinear),
                              kv_replicas=getattr(layer, "num_kv_head_replicas", 1) if qkv else 1)
