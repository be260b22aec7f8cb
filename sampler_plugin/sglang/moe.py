"""SGLang fused-MoE method of nvfp4_sampler: NVFP4 experts, routing left to the model.

SGLang's TopK computes topk_weights / topk_ids exactly as the model defines them (softmax, top-k,
renormalisation) and hands them over in the dispatch output; `apply` runs the experts through
`torch.ops.nvfp4_sampler.moe` and returns a StandardCombineInput. Parameters (checkpoint layout):
  w13_weight [E, 2I, H/2] uint8, w13_weight_scale [E, 2I, H/16] e4m3, w13_weight_scale_2 [E, 2I] fp32
     (gate rows then up rows; each expert's gate_proj and up_proj keep their own decode scale)
  w2_weight  [E, H, I/2] uint8,  w2_weight_scale  [E, H, I/16] e4m3,  w2_weight_scale_2  [E] fp32
"""
from __future__ import annotations

import torch
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from nvfp4_sampler.kernels import NVFP4Tensor

from .. import layers
from ..config import SamplerConfig
from .linear import ShardLoader, UpdateTracking


class NVFP4MoEMethod(UpdateTracking, FusedMoEMethodBase):
    """W4A4 SwiGLU experts of the SGLang FusedMoE layer `prefix` ("...mlp.experts", the checkpoint prefix)."""

    def __init__(self, config: SamplerConfig, prefix: str, memory: layers.MemoryReport):
        self.config = config
        self.prefix = prefix
        self.memory = memory

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if layer.moe_tp_size != 1 or layer.moe_ep_size != 1:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: tensor or expert parallelism is not supported "
                                      f"by the SGLang adapter yet (moe tp_size and ep_size must be 1)")
        if extra_weight_attrs.get("with_bias"):
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: MoE experts with biases are not supported")
        inter = intermediate_size_per_partition
        w13 = layers.create_weight(2 * inter, hidden_size, experts=num_experts, name=f"{self.prefix}.*.gate_proj/up_proj")
        w2 = layers.create_weight(hidden_size, inter, experts=num_experts, global_per_row=False,
                                  name=f"{self.prefix}.*.down_proj")
        loader = self._loader(layer)
        for stem, w in (("w13", w13), ("w2", w2)):
            layers.register_weight(layer, w, loader, stem=f"{stem}_")
        layer.nvfp4_shards = [layers.expert_shards(self.prefix, e, hidden=hidden_size, inter=inter)
                              for e in range(num_experts)]
        layer.nvfp4_tracker = layers.LoadTracker(s for e in layer.nvfp4_shards for s in e.values())
        layer.nvfp4_loaded = False
        layer.nvfp4_backend = layers.choose_backend(self.config, op="moe", name=self.prefix, device=w13.codes.device,
                                                    k=hidden_size)
        self.memory.add_layer()

    def _loader(self, layer: torch.nn.Module) -> ShardLoader:
        def locate(weight_name: str, shard_id: str, expert_id: int) -> tuple[NVFP4Tensor, layers.Shard]:
            storage = self.storage(layer)["w2" if shard_id == "w2" else "w13"]
            return storage, layer.nvfp4_shards[expert_id][shard_id]
        return ShardLoader(layer, self.config, locate)

    @staticmethod
    def storage(layer: torch.nn.Module) -> dict[str, NVFP4Tensor]:
        return {stem: layers.module_weight(layer, stem=f"{stem}_") for stem in ("w13", "w2")}

    def quantized_weights(self, layer: torch.nn.Module) -> list[NVFP4Tensor]:
        return list(self.storage(layer).values())

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        """No SGLang runner: `apply` calls the kernels directly. Refuses what kernels.moe does not compute."""
        c = moe_runner_config
        unsupported = {
            "activation": c.activation != "silu" or not c.is_gated,
            "apply_router_weight_on_input": c.apply_router_weight_on_input,
            "routed_scaling_factor": c.routed_scaling_factor not in (None, 1.0),
            "num_fused_shared_experts": bool(c.num_fused_shared_experts),
            "no_combine": c.no_combine,
            "gemm1_alpha/gemm1_clamp_limit/swiglu_limit": any(
                v is not None for v in (c.gemm1_alpha, c.gemm1_beta, c.gemm1_clamp_limit, c.swiglu_limit)),
        }
        bad = [name for name, flag in unsupported.items() if flag]
        if bad:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: MoE options {bad} are not supported "
                                      f"(experts are SwiGLU, silu(gate) * up, combined with the router weights)")

    def apply(self, layer: torch.nn.Module, dispatch_output) -> StandardCombineInput:
        topk = dispatch_output.topk_output
        w13 = NVFP4Tensor(layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2)
        w2 = NVFP4Tensor(layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_scale_2)
        out = layers.apply_moe(dispatch_output.hidden_states, w13, w2, topk.topk_weights, topk.topk_ids,
                               config=self.config, backend=layer.nvfp4_backend)
        return StandardCombineInput(hidden_states=out)
