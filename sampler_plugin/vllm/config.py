"""vLLM QuantizationConfig `nvfp4_sampler`: parses SamplerConfig, picks a method per layer."""
from __future__ import annotations

from typing import Any

import torch
import vllm.envs as envs
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.platforms import current_platform

from nvfp4_sampler.sampler_format import METHOD_NAME, SamplerConfig, should_quantize

from ..core import ConfigCore
from .linear import NVFP4LinearMethod
from .moe import NVFP4MoEMethod


@register_quantization_config(METHOD_NAME)
class NVFP4SamplerConfig(ConfigCore, QuantizationConfig):
    """`--quantization nvfp4_sampler`, or `quantization_config.quant_method: nvfp4_sampler` in config.json."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NVFP4SamplerConfig":
        """Raises ValueError for strict on a GPU without vLLM's batch-invariant mode: our GEMMs alone do
        not make a token's log-probs batch-invariant while attention, RMSNorm, the BF16 GEMMs (lm_head,
        routers) and log_softmax still depend on the batch."""
        sampler = SamplerConfig.from_dict(config)
        if sampler.strict and current_platform.is_cuda_alike() and not envs.VLLM_BATCH_INVARIANT:
            raise ValueError(f"{METHOD_NAME}: strict needs vLLM's batch-invariant mode on {current_platform.device_name}: "
                             f"set VLLM_BATCH_INVARIANT=1 in the environment of every engine process (it makes "
                             f"attention, RMSNorm, the BF16 GEMMs and log_softmax batch-invariant; docs/VLLM.md)")
        return cls(sampler)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            method = self.linear_method(NVFP4LinearMethod, prefix)
            if method is None:
                layer._cpu_skip_gemm_dispatch = True    # keep a plain, reloadable BF16 weight on CPU
                return UnquantizedLinearMethod()
            return method
        if isinstance(layer, RoutedExperts):
            ckpt_prefix = prefix.removesuffix(".routed_experts")
            if not should_quantize(ckpt_prefix, self.sampler):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return NVFP4MoEMethod(self.sampler, layer.moe_config, ckpt_prefix, self.memory)
        if isinstance(layer, VocabParallelEmbedding):
            return LiveEmbeddingMethod()
        return None


class LiveEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Embeddings and lm_head stay unquantized and compute from their live `weight` parameter.

    On CPU, vLLM's own method makes a packed copy of lm_head's weight at load (oneDNN or sgl-kernel
    GEMM) that `model.load_weights(...)` after start (TRL colocate, verl) never refreshes, so the
    log-probs stayed those of the old lm_head. Here the CPU GEMM reads `layer.weight` on every call
    (torch.nn.functional.linear). On GPUs vLLM keeps no copy: nothing changes there.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if current_platform.is_cpu():
            layer.cpu_linear = torch.nn.functional.linear
