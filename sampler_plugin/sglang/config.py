"""SGLang QuantizationConfig `nvfp4_sampler`: parses SamplerConfig, picks a method per layer."""
from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from nvfp4_sampler.sampler_format import SamplerConfig, should_quantize

from ..core import ConfigCore
from .linear import NVFP4LinearMethod
from .moe import NVFP4MoEMethod

# HF checkpoint names of SGLang's fused linears, for models whose class declares no packed_modules_mapping.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class NVFP4SamplerConfig(ConfigCore, QuantizationConfig):
    """`--quantization nvfp4_sampler`, or `quantization_config.quant_method: nvfp4_sampler` in config.json."""

    def __init__(self, sampler: SamplerConfig | None = None, packed_modules_mapping: dict | None = None):
        super().__init__(sampler)
        self.packed_modules_mapping = {**DEFAULT_PACKED_MODULES, **(packed_modules_mapping or {})}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NVFP4SamplerConfig":
        """A checkpoint's quantization_config, plus the keys SGLang adds to it (weight_utils.get_quant_config)."""
        config = dict(config)
        packed = config.pop("packed_modules_mapping", None)
        config.pop("hf_config", None)
        return cls(SamplerConfig.from_dict(config), packed)

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return self.linear_method(NVFP4LinearMethod, prefix) or UnquantizedLinearMethod()
        if isinstance(layer, FusedMoE) and should_quantize(prefix, self.sampler):
            return NVFP4MoEMethod(self.sampler, prefix, self.memory)
        return None       # embeddings, lm_head, BF16 experts: SGLang's unquantized methods
