"""vLLM QuantizationConfig `nvfp4_sampler`: parses SamplerConfig, picks a method per layer."""
from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .. import layers
from ..config import METHOD_NAME, SamplerConfig
from ..policy import should_quantize
from .linear import NVFP4LinearMethod
from .moe import NVFP4MoEMethod

logger = logging.getLogger("vllm.nvfp4_sampler")      # under vLLM's logger: its handler and level


class MemoryReport:
    """Bytes of the quantized weights vs the same weights in BF16; logged once all layers are processed."""

    def __init__(self):
        self.created = 0
        self.sizes: dict[str, tuple[int, int]] = {}      # layer prefix -> (bytes, BF16 bytes)

    def add_layer(self) -> None:
        self.created += 1

    def processed(self, prefix: str, weights: tuple[layers.QuantizedWeight, ...]) -> None:
        """Record a layer once (re-processing after a reload does not count twice); log the total at the last."""
        first = prefix not in self.sizes
        self.sizes[prefix] = (sum(w.nbytes for w in weights), sum(w.bf16_nbytes for w in weights))
        if first and len(self.sizes) == self.created:
            logger.info("nvfp4_sampler: %d quantized layers hold %.2f MiB, %.3fx their BF16 size (%.2f MiB)",
                        self.created, self.nbytes / 2**20, self.ratio, self.bf16_nbytes / 2**20)

    @property
    def nbytes(self) -> int:
        return sum(b for b, _ in self.sizes.values())

    @property
    def bf16_nbytes(self) -> int:
        return sum(b for _, b in self.sizes.values())

    @property
    def ratio(self) -> float:
        return self.nbytes / max(self.bf16_nbytes, 1)


@register_quantization_config(METHOD_NAME)
class NVFP4SamplerConfig(QuantizationConfig):
    """`--quantization nvfp4_sampler`, or `quantization_config.quant_method: nvfp4_sampler` in config.json."""

    def __init__(self, sampler: SamplerConfig | None = None):
        super().__init__()
        self.sampler = sampler or SamplerConfig()
        self.memory = MemoryReport()

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0      # the torch reference backend runs on every device

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NVFP4SamplerConfig":
        return cls(SamplerConfig.from_dict(config))

    def shard_names(self, prefix: str) -> list[str]:
        """Checkpoint prefixes of the tensors fused into module `prefix` (itself if not fused)."""
        parent, _, leaf = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf)
        if not parts:
            return [prefix]
        return [f"{parent}.{p}" if parent else p for p in parts]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            names = self.shard_names(prefix)
            keep = [not should_quantize(n, self.sampler) for n in [prefix, *names]]
            if all(keep):
                layer._cpu_skip_gemm_dispatch = True    # keep a plain, reloadable BF16 weight on CPU
                return UnquantizedLinearMethod()
            if any(keep):
                raise ValueError(f"nvfp4_sampler: keep_bf16 {list(self.sampler.keep_bf16)} splits the fused module "
                                 f"{prefix} ({names}); keep all of its parts or none")
            self.memory.add_layer()
            return NVFP4LinearMethod(self.sampler, prefix, names, self.memory.processed)
        if isinstance(layer, RoutedExperts):
            ckpt_prefix = prefix.removesuffix(".routed_experts")
            if not should_quantize(ckpt_prefix, self.sampler):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            self.memory.add_layer()
            return NVFP4MoEMethod(self.sampler, layer.moe_config, ckpt_prefix, self.memory.processed)
        return None
