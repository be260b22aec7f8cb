"""vLLM fused-MoE method of nvfp4_sampler: NVFP4 experts, routing left to the model.

vLLM's router computes topk_weights / topk_ids exactly as the model defines them (softmax, top-k,
renormalisation); `apply` runs the experts through `torch.ops.nvfp4_sampler.moe` with the backend
chosen in `create_weights`. Parameters:
  w13_weight [E, 2I, H/2] uint8, w13_weight_scale [E, 2I, H/16] e4m3, w13_weight_scale_2 [E, 2I] fp32
     (gate rows then up rows; each expert's gate_proj and up_proj keep their own decode scale)
  w2_weight  [E, H, I/2] uint8,  w2_weight_scale  [E, H, I/16] e4m3,  w2_weight_scale_2  [E] fp32
"""
from __future__ import annotations

import types

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from nvfp4_sampler.kernels import NVFP4Tensor

from .. import layers
from ..config import SamplerConfig
from .layerwise import abort_on_error, complete_load, records


@abort_on_error
def _load(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
          shard_id: str, expert_id: int, return_success: bool = False):
    """`weight_loader` of the expert parameters (bound to the layer): one expert's checkpoint tensor into
    its shard. On meta parameters (vLLM's layerwise-reload counting pass) shape-only, and not recorded."""
    method = layer.quant_method
    shard = method.expert_shards(layer, expert_id)[shard_id]
    stem = "w2" if shard_id == "w2" else "w13"
    storage = method.storage(layer)[stem]
    layers.write(storage, shard, param.nvfp4_kind, loaded_weight, config=method.config)
    if records(layer, stem, storage):
        layer.nvfp4_tracker.record(shard, param.nvfp4_kind, loaded_weight)
    return True if return_success else None


class NVFP4MoEMethod(FusedMoEMethodBase):
    """W4A4 SwiGLU experts of the MoE layer whose checkpoint prefix is `ckpt_prefix` ("...mlp.experts")."""

    def __init__(self, config: SamplerConfig, moe_config, ckpt_prefix: str, on_processed):
        super().__init__(moe_config)
        self.config = config
        self.ckpt_prefix = ckpt_prefix
        self.on_processed = on_processed

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if self.config.activation_scaling != "per_token":
            raise ValueError(f"nvfp4_sampler: {self.ckpt_prefix}: MoE experts support activation_scaling="
                             f"'per_token' only, got {self.config.activation_scaling!r}")
        parallel = self.moe.moe_parallel_config
        if parallel.use_ep:
            raise NotImplementedError(f"nvfp4_sampler: {self.ckpt_prefix}: expert parallelism is not supported yet")
        inter = intermediate_size_per_partition
        w13 = layers.create_weight(2 * inter, hidden_size, experts=num_experts,
                                   name=f"{self.ckpt_prefix}.*.gate_proj/up_proj")
        w2 = layers.create_weight(hidden_size, inter, experts=num_experts, global_per_row=False,
                                  name=f"{self.ckpt_prefix}.*.down_proj (intermediate size per tensor-parallel rank)")
        loader = self._loader(layer)
        for stem, w in (("w13", w13), ("w2", w2)):
            layers.register_weight(layer, w, loader, stem=f"{stem}_")
        layer.nvfp4_geometry = (hidden_size, inter, parallel.tp_rank, parallel.tp_size)
        layer.nvfp4_backend = layers.choose_backend(self.config, op="moe", name=self.ckpt_prefix,
                                                    device=w13.codes.device, k=hidden_size)
        layer.nvfp4_tracker = layers.LoadTracker(
            s for e in range(num_experts) for s in self.expert_shards(layer, e).values())

    def expert_shards(self, layer: torch.nn.Module, expert: int) -> dict[str, layers.Shard]:
        """Shards of expert `expert` on this rank, keyed by vLLM shard id (w1, w3, w2)."""
        hidden, inter, tp_rank, tp_size = layer.nvfp4_geometry
        return layers.expert_shards(self.ckpt_prefix, expert, hidden=hidden, inter=inter, tp_rank=tp_rank,
                                    tp_size=tp_size)

    @staticmethod
    def _loader(layer: torch.nn.Module):
        return types.MethodType(_load, layer)   # bound to the layer, as vLLM's layerwise reload expects

    @staticmethod
    def storage(layer: torch.nn.Module) -> dict[str, NVFP4Tensor]:
        return {stem: layers.module_weight(layer, stem=f"{stem}_") for stem in ("w13", "w2")}

    @abort_on_error
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        loaded = self.storage(layer)
        shards = [("w2" if sid == "w2" else "w13", s) for e in range(loaded["w13"].codes.shape[0])
                  for sid, s in self.expert_shards(layer, e).items()]
        complete_load(layer, loaded, shards, layer.nvfp4_tracker)
        self.on_processed(tuple(loaded.values()))

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts, shared_experts_input) -> torch.Tensor:
        if shared_experts is not None:
            raise NotImplementedError("nvfp4_sampler: MoE layers with shared experts are not supported yet")
        w13 = NVFP4Tensor(layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2)
        w2 = NVFP4Tensor(layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_scale_2)
        return layers.apply_moe(x, w13, w2, topk_weights, topk_ids, config=self.config, backend=layer.nvfp4_backend)
