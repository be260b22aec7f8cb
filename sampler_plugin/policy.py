"""Which modules nvfp4_sampler quantizes: the one rule shared by every engine adapter."""
from __future__ import annotations

from .config import SamplerConfig

# Always BF16: output head, embeddings, and MoE routers (`mlp.gate`, a plain linear in every engine;
# quantizing it changes expert choices). Matched on the module name's components.
ALWAYS_BF16_SUFFIXES = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate")


def should_quantize(prefix: str, config: SamplerConfig) -> bool:
    """True if the linear/MoE module named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj")
    is NVFP4 under `config`; False for always-BF16 modules and user `keep_bf16` prefixes."""
    if any(prefix == s or prefix.endswith("." + s) for s in ALWAYS_BF16_SUFFIXES):
        return False
    return not any(prefix == p or prefix.startswith(p.rstrip(".") + ".") for p in config.keep_bf16)
