"""Shared by the sidecar tests: tiny models A and B (B also as a sampler checkpoint), sequences."""
from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from nvfp4_sampler.converters.convert import ConvertOptions, convert
from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.testing.models import tiny_qwen3

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


def reads_during_pushes(pusher: SamplerClient, url: str, models: dict[str, Path], *,
                        readers: int) -> list[tuple[int, list[list[float]]]]:
    """`readers` threads hammer /v1/logprobs at `url` while `pusher` commits models b then a as NVFP4.

    Asserts no read failed and every answer equals the log-probs of the version it reports (read
    once each version is committed); returns the (version, log-probs) answers seen.
    """
    v, before = lp(pusher)
    expected = {v: before}
    seen, errors, stop = [], [], threading.Event()

    def reader():
        with SamplerClient(url) as c:
            while not stop.is_set():
                try:
                    seen.append(lp(c))
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    try:
        for src in ("b", "a"):
            res = pusher.push(models[src], layout="nvfp4", progress=False)
            expected[res.weight_version] = lp(pusher)[1]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    for ver, got in seen:
        assert got == expected[ver], ver
    return seen
