"""SGLang's LinearMethodBase over the layer core (`core.LinearCore`: parameters, loaders, post-load, apply).

Tensor parallelism is refused (not run with SGLang here). Updates are checked whole before they write
(`updates.py`); parameters stay in checkpoint layout, so restore_weights_before_loading has nothing to undo.
"""
from __future__ import annotations

import torch
from sglang.srt.distributed.utils import get_group_rank_size
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from ..core import LinearCore


class NVFP4LinearMethod(LinearCore, LinearMethodBase):
    """W4A4 linear for one module `prefix`; `shard_names` are its checkpoint tensors' prefixes."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if get_group_rank_size(layer.tp_group)[1] != 1:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: tensor parallelism is not supported by the "
                                      f"SGLang adapter yet (tp_size must be 1)")
        self.create_linear(layer, output_sizes=output_partition_sizes, input_size=input_size,
                           k_part=input_size_per_partition, dtype=params_dtype)
