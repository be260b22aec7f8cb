"""Which modules nvfp4_sampler quantizes: the one rule shared by every engine adapter."""
from __future__ import annotations

from nvfp4_sampler.sampler_format import SamplerConfig, should_quantize


def fused_shard_names(prefix: str, packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """Checkpoint prefixes of the tensors an engine fused into module `prefix` (itself if not fused),
    e.g. "...self_attn.qkv_proj" -> ["...self_attn.q_proj", "...k_proj", "...v_proj"]."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    if not parts:
        return [prefix]
    return [f"{parent}.{p}" if parent else p for p in parts]


def quantized_linear_shards(prefix: str, packed_modules_mapping: dict[str, list[str]],
                            config: SamplerConfig) -> list[str] | None:
    """The checkpoint prefixes of linear module `prefix` if it is NVFP4 under `config`, None if it
    stays BF16. Raises ValueError if `keep_bf16` keeps only some parts of a fused module."""
    names = fused_shard_names(prefix, packed_modules_mapping)
    keep = [not should_quantize(n, config) for n in [prefix, *names]]
    if all(keep):
        return None
    if any(keep):
        raise ValueError(f"nvfp4_sampler: keep_bf16 {list(config.keep_bf16)} splits the fused module "
                         f"{prefix} ({names}); keep all of its parts or none")
    return names
