"""The sampler checkpoint layout on disk (docs/ARCHITECTURE.md, "Sampler checkpoint"): file names,
config.json, expected shapes per architecture, TP split dims. The NVFP4 triplet (names, dtypes,
shapes) and the rule for which tensors are NVFP4 (`is_nvfp4_weight`) are the format contract's
(`sampler_format`); import them from there.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from nvfp4_sampler.sampler_format import (COLUMN_PARALLEL, FORMAT_VERSION, LINEARS, ROW_PARALLEL, SCALE, TRIPLET,
                                          TRIPLET_DTYPES, WEIGHT, SamplerConfig, triplet_shapes)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
RANK_DIR = "rank-{rank:02d}"                  # DST/rank-00 ... with --tp N (each a complete folder)
SHARD_METADATA = {"format": "pt", "nvfp4_sampler_format_version": str(FORMAT_VERSION)}

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one checkpoint tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def split_name(name: str) -> tuple[str, str]:
    """"a.b.q_proj.weight" -> ("a.b.q_proj", "weight")."""
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def quantized_specs(prefix: str, n: int, k: int) -> dict[str, TensorSpec]:
    """The three checkpoint tensors of quantized linear `prefix` with a logical weight [n, k]."""
    try:
        shapes = triplet_shapes(n, k)
    except ValueError as e:
        raise ValueError(f"{prefix}.{WEIGHT}: {e}") from e
    return {f"{prefix}.{kind}": TensorSpec(getattr(torch, TRIPLET_DTYPES[kind]), shapes[kind]) for kind in TRIPLET}


def tp_dim(name: str) -> int | None:
    """The dim a TP rank splits checkpoint tensor `name` on: 0 (column-parallel weight/scale/bias),
    1 (row-parallel weight/scale), None (replicated: scale_2, row-parallel bias, norms, embeddings...)."""
    prefix, leaf = split_name(name)
    module = prefix.rpartition(".")[2]
    if module in COLUMN_PARALLEL and leaf in (WEIGHT, SCALE, "bias"):
        return 0
    if module in ROW_PARALLEL and leaf in (WEIGHT, SCALE):
        return 1
    return None


def check_architecture(hf_config: dict[str, Any]) -> str:
    """The model's architecture name; ValueError if it is not one the sampler layout knows."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {archs or hf_config.get('model_type')!r}: the converter knows "
                         f"{list(ARCHITECTURES)}")
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method")
        raise ValueError(f"source is already quantized (quant_method {method!r}); convert a BF16/FP32 checkpoint")
    return archs[0]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(experts\.(\d+)\.)?(\w+)\.weight$")


def expected_shape(name: str, hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """Logical [N, K] of the weight of a known linear per the HF config, None for other tensors.

    Raises ValueError for a linear the architecture does not have (expert index out of range,
    experts in a dense model).
    """
    m = _LAYER.match(name)
    if m is None or m[5] not in LINEARS:
        return None
    c = hf_config
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    if m[3] is not None:
        experts = c.get("num_experts") or c.get("num_local_experts")   # transformers 5 writes the latter
        if not experts or int(m[4]) >= experts:
            raise ValueError(f"{name}: expert {m[4]} does not exist (num_experts={experts})")
        inter = c["moe_intermediate_size"]
    else:
        inter = c.get("intermediate_size")
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
            "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[m[5]]


def tp_divisors(hf_config: dict[str, Any]) -> dict[str, int]:
    """Head counts a TP degree must divide (query and key/value heads)."""
    heads = hf_config["num_attention_heads"]
    return {"num_attention_heads": heads, "num_key_value_heads": hf_config.get("num_key_value_heads") or heads}


def sampler_config_json(hf_config: dict[str, Any], config: SamplerConfig) -> dict[str, Any]:
    """config.json of a sampler checkpoint: the HF config plus quantization_config (prequantized)."""
    if not config.prequantized:
        raise ValueError("a converted checkpoint holds NVFP4 weights: SamplerConfig.prequantized must be True")
    return {**hf_config, "quantization_config": config.to_dict()}


def shard_file(index: int, count: int) -> str:
    """File name of shard `index` (1-based) of `count`."""
    return SHARD_FILE.format(index=index, count=count)
