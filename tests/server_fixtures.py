"""Shared by the sidecar tests: tiny models A and B (B also as a sampler checkpoint), sequences."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from converters.convert import ConvertOptions, convert
from server.client import SamplerClient
from tests.models import tiny_qwen3

TOKEN = "s3cret-token"
SEQS = [[5, 17, 99, 3, 250, 41, 7, 8], [300, 12, 12, 64, 1]]
PROMPT_LENS = [3, 2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_models(root: Path) -> dict[str, Path]:
    """a, b: random tiny Qwen3 (seeds 0, 1; A with a ChatML template); b_nvfp4: B converted."""
    from transformers import AutoTokenizer

    a, b = tiny_qwen3(root / "a", seed=0), tiny_qwen3(root / "b", seed=1)
    tok = AutoTokenizer.from_pretrained(a)
    tok.chat_template = CHATML
    tok.save_pretrained(a)
    convert(b, root / "b_nvfp4", ConvertOptions(report=False))
    return {"a": a, "b": b, "b_nvfp4": root / "b_nvfp4"}


def lp(c: SamplerClient) -> tuple[int, list[list[float]]]:
    """(weight version, log-probs of SEQS) from one /v1/logprobs call."""
    r = c.logprobs(SEQS, PROMPT_LENS)
    return r.weight_version, [x.logprobs for x in r.results]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
