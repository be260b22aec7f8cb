"""Random BF16 checkpoints of real model shapes, built on the GPU when there is one (no tokenizer:
engines take token ids); the GPU engine tests and the end-to-end benchmark load them.

  SHAPES[name]  transformers config fields of Qwen3 / Qwen3-MoE shapes (layer count set per call)
  build(path, name, *, seed, layers)  -> path (config.json + model.safetensors)
"""
from __future__ import annotations

from pathlib import Path

import torch

_QWEN3 = dict(head_dim=128, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
              initializer_range=0.02, bos_token_id=0, eos_token_id=1)
SHAPES = {
    "dense-small": dict(arch="Qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                        num_key_value_heads=8, **_QWEN3),
    "moe-small": dict(arch="Qwen3Moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
                      num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                      num_attention_heads=16, num_key_value_heads=8, **_QWEN3),
    "qwen3-1.7b": dict(arch="Qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, **{**_QWEN3, "vocab_size": 151936}),
    "qwen3-8b": dict(arch="Qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, **{**_QWEN3, "vocab_size": 151936}),
    "qwen3-30b-a3b": dict(arch="Qwen3Moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          num_attention_heads=32, num_key_value_heads=4, **{**_QWEN3, "vocab_size": 151936}),
}


def build(path: str | Path, name: str, *, seed: int, layers: int) -> Path:
    """A random BF16 checkpoint of shape `name` with `layers` decoder layers, deterministic in seed."""
    import transformers

    fields = dict(SHAPES[name])
    arch = fields.pop("arch")
    config = getattr(transformers, f"{arch}Config")(num_hidden_layers=layers, **fields)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.bfloat16)
    path = Path(path)
    model.save_pretrained(path, max_shard_size="100GB")
    del model
    return path
