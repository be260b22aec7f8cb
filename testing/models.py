"""Tiny model builders shared by the test suites and benchmarks (plugins, converter, server).

  tiny_qwen3(path)      random 2-layer Qwen3 (dense), BF16, byte-level BPE tokenizer (vocab 512)
  tiny_qwen3_moe(path)  random 2-layer Qwen3-MoE (8 experts, top-2), same tokenizer
  smollm2()             the real SmolLM2-135M-Instruct (converters/smollm2.py, shared with the demo)
  write_prequantized(src, dst)  a sampler (pre-quantized) checkpoint of a BF16 folder, quantized
                        tensor by tensor with kernels.reference (an independent path from the plugins)
  tokenizer(path)       the byte-level BPE tokenizer of the tiny models, saved into path

Every builder writes a complete HF folder (config.json, model.safetensors, tokenizer files) that
vLLM, SGLang and transformers load as they are, and returns its path. The random models are
deterministic in `seed`; every quantized dimension is a multiple of 16.

Command line: `python -m nvfp4_sampler.testing.models {tiny_qwen3,tiny_qwen3_moe,smollm2} [PATH]`.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from nvfp4_sampler.converters.smollm2 import CACHE_DIR, smollm2  # noqa: F401  (re-exported for tests and benchmarks)

VOCAB_SIZE = 512
# Training text of the tiny tokenizer (and handy prompts for tests).
TEXT = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    "Reinforcement learning trains a policy on samples drawn from the policy itself. "
    "A sampler serves the model while a learner updates its weights; both use four-bit floats. "
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n"
    "Once upon a time there was a small model that learned to count: one, two, three, four, five. "
    "Numbers 0123456789 and symbols +-*/=<>()[]{}.,;:!?'\" are part of the alphabet too."
)
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tokenizer(path: str | os.PathLike) -> None:
    """Train a byte-level BPE tokenizer of VOCAB_SIZE on TEXT and save it (tokenizer.json + config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=4096)
    fast.save_pretrained(path)


def _save(model: torch.nn.Module, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer(path)
    return path


def _common(vocab_size: int) -> dict:
    """Config fields shared by both tiny models: head_dim 64 (every vLLM CPU attention backend has it)."""
    return dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
                initializer_range=0.08, bos_token_id=0, eos_token_id=0, dtype="bfloat16")


def tiny_qwen3(path: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """Random Qwen3ForCausalLM: hidden 128, 2 layers, 4 heads (2 KV) of 64, MLP 256, vocab 512.
    `overrides` replace Qwen3Config fields (e.g. intermediate_size=264 for a K that breaks 16-blocks)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**_common(VOCAB_SIZE), "intermediate_size": 256, **overrides})
    return _save(Qwen3ForCausalLM(config), Path(path))


def tiny_qwen3_moe(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Random Qwen3MoeForCausalLM: as tiny_qwen3 but every MLP is 8 experts (I=64), top-2, renormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, **_common(VOCAB_SIZE))
    return _save(Qwen3MoeForCausalLM(config), Path(path))


def write_prequantized(src: str | os.PathLike, dst: str | os.PathLike, *, config=None) -> Path:
    """Copy the HF folder `src` to `dst` with every linear weight that the policy quantizes replaced by
    its NVFP4 triplet (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 [])
    and `quantization_config` = config (prequantized=True) in config.json."""
    import dataclasses
    import json

    from safetensors.torch import load_file, save_file

    from nvfp4_sampler.kernels.reference import quantize_weight
    from nvfp4_sampler.sampler_format import SamplerConfig, is_nvfp4_weight

    src, dst = Path(src), Path(dst)
    config = dataclasses.replace(config or SamplerConfig(), prequantized=True)
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            prefix = name.removesuffix(".weight")
            if is_nvfp4_weight(name, config):
                q = quantize_weight(t, recipe=config.recipe.weight)
                out.update({name: q.codes, f"{prefix}.weight_scale": q.block_scales,
                            f"{prefix}.weight_scale_2": q.global_scale})
            else:
                out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = config.to_dict()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


BUILDERS = {"tiny_qwen3": tiny_qwen3, "tiny_qwen3_moe": tiny_qwen3_moe, "smollm2": smollm2}

if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    print(BUILDERS[name](*rest))
