"""SGLang's LinearMethodBase over the layer core (`core.LinearCore`: parameters, loaders, post-load, apply).

Translates SGLang's layer attributes: tensor-parallel placement (column / row parallel, replicated k/v
heads) from the layer's own group, and the device group of a row-parallel layer, whose activation amax is
all-reduced. Groups other than a plain tensor-parallel one (attention data parallelism's logical or
replicated groups, a k/v group of its own) and pre-sharded checkpoints are refused at start-up. Updates are
checked whole before they write (`updates.py`); parameters stay in checkpoint layout, so
restore_weights_before_loading has nothing to undo.
"""
from __future__ import annotations

import torch
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.distributed.utils import get_group_rank_size
from sglang.srt.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from ..core import LinearCore, LinearParallel


class NVFP4LinearMethod(LinearCore, LinearMethodBase):
    """W4A4 linear for one module `prefix`; `shard_names` are its checkpoint tensors' prefixes."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        group = getattr(layer, "tp_group", None)
        sharded = get_group_rank_size(group)[1] > 1
        if sharded and not isinstance(group, GroupCoordinator):
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: a linear layer partitioned over a logical or "
                                      f"replicated group (attention data parallelism) is not supported")
        if sharded and isinstance(layer, QKVParallelLinear) and layer.kv_tp_group is not group:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: k/v heads partitioned over a group of "
                                      f"their own are not supported")
        if getattr(layer, "use_presharded_weights", False):
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: pre-sharded checkpoints are not supported "
                                      f"(the loaders cut each rank's shard from the whole tensor)")
        # a row-parallel rank holds a K-slice of every token: its per-token amax must span all ranks
        row_sharded = sharded and isinstance(layer, RowParallelLinear)
        self.create_linear(layer, output_sizes=output_partition_sizes, input_size=input_size,
                           k_part=input_size_per_partition, tp_group=group.device_group if row_sharded else None,
                           dtype=params_dtype)

    def parallel(self, layer: torch.nn.Module) -> LinearParallel:
        rank, size = get_group_rank_size(getattr(layer, "tp_group", None))
        qkv = isinstance(layer, QKVParallelLinear)
        return LinearParallel(tp_rank=rank, tp_size=size, column=isinstance(layer, ColumnParallelLinear),
                              row=isinstance(layer, RowParallelLinear),
                              kv_replicas=layer.num_kv_head_replicas if qkv else 1)
