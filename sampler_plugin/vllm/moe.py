"""vLLM's FusedMoEMethodBase over the layer core (`core.ExpertsCore`: parameters, loaders, post-load).

vLLM's router computes topk_weights / topk_ids as the model defines them (softmax, top-k,
renormalisation) and hands them to `apply`; expert parallelism and shared experts are refused. Under
tensor parallelism each rank holds I / tp of every expert: the SwiGLU rows' amax is all-reduced over vLLM's
tensor-parallel group (`core.ExpertsCore`), vLLM all-reduces the layer's output.
"""
from __future__ import annotations

import torch
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from nvfp4_sampler.sampler_format import SamplerConfig

from .. import layers
from ..core import ExpertsCore
from .layerwise import abort_pending


class NVFP4MoEMethod(ExpertsCore, FusedMoEMethodBase):
    """W4A4 SwiGLU experts of the MoE layer whose checkpoint prefix is `prefix` ("...mlp.experts")."""

    abort_pending = staticmethod(abort_pending)

    def __init__(self, config: SamplerConfig, moe_config, prefix: str, memory: layers.MemoryReport):
        FusedMoEMethodBase.__init__(self, moe_config)
        ExpertsCore.__init__(self, config, prefix, memory)

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        parallel = self.moe.moe_parallel_config
        if parallel.use_ep:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: expert parallelism is not supported yet")
        group = get_tp_group()
        if parallel.tp_size > 1 and (parallel.tp_size, parallel.tp_rank) != (group.world_size, group.rank_in_group):
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: experts split over ranks other than the "
                                      f"tensor-parallel group (data parallelism flattened into the experts' tensor "
                                      f"parallelism) are not supported")
        self.create_experts(layer, num_experts=num_experts, hidden=hidden_size, inter=intermediate_size_per_partition,
                            tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
                            tp_group=group.device_group if parallel.tp_size > 1 else None,
                            top_k=self.moe.experts_per_token, dtype=params_dtype)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts, shared_experts_input) -> torch.Tensor:
        if shared_experts is not None:
            raise NotImplementedError("nvfp4_sampler: MoE layers with shared experts are not supported yet")
        return self.forward_experts(layer, x, topk_weights, topk_ids)
