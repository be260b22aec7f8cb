"""SGLang's FusedMoEMethodBase over the layer core (`core.ExpertsCore`: parameters, loaders, post-load).

No SGLang MoE runner: SGLang's TopK routes as the model defines it, `apply` takes the dispatch output
(hidden states, topk weights and ids) and returns a StandardCombineInput. Options the experts do not
compute (expert parallelism, biases, non-SwiGLU activations, shared experts, ...) are refused at start-up;
under tensor parallelism each rank holds I / tp of every expert, the SwiGLU rows' amax is all-reduced over
SGLang's MoE tensor-parallel group (`core.ExpertsCore`), and SGLang all-reduces the layer's output.
"""
from __future__ import annotations

import torch
from sglang.srt.distributed.parallel_state import get_moe_tp_group
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ..core import ExpertsCore


class NVFP4MoEMethod(ExpertsCore, FusedMoEMethodBase):
    """W4A4 SwiGLU experts of the SGLang FusedMoE layer `prefix` ("...mlp.experts", the checkpoint prefix)."""

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if layer.moe_ep_size != 1:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: expert parallelism is not supported by the "
                                      f"SGLang adapter yet (moe ep_size must be 1; tensor parallelism is)")
        if extra_weight_attrs.get("with_bias"):
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: MoE experts with biases are not supported")
        self.create_experts(layer, num_experts=num_experts, hidden=hidden_size, inter=intermediate_size_per_partition,
                            tp_rank=layer.moe_tp_rank, tp_size=layer.moe_tp_size,
                            tp_group=get_moe_tp_group().device_group if layer.moe_tp_size > 1 else None,
                            top_k=getattr(layer, "top_k", None), dtype=params_dtype)

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
        out = self.forward_experts(layer, dispatch_output.hidden_states, topk.topk_weights, topk.topk_ids)
        return StandardCombineInput(hidden_states=out)
