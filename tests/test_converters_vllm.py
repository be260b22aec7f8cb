"""A converted checkpoint loads in vLLM (pre-quantized path) and gives the log-probs of online
quantization of the same BF16 weights, bit for bit: tiny Qwen3-MoE and the real SmolLM2-135M.

Engines run one at a time (online, then converted) to keep memory low on the CPU machine.
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_converters_vllm.py
"""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.converters.convert import ConvertOptions, convert
from nvfp4_sampler.testing import models
from tests.vllm_helpers import greedy, make_llm, prompt_logprobs, shutdown, token_ids

pytestmark = pytest.mark.engine


def _run(path, ids, **kwargs) -> tuple[torch.Tensor, list[list[int]]]:
    llm = make_llm(path, **kwargs)
    try:
        return prompt_logprobs(llm, ids), greedy(llm, ids)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module", params=["tiny_qwen3_moe", "smollm2"])
def engines(request, tmp_path_factory):
    """(online, converted) prompt log-probs and greedy tokens of one model."""
    d = tmp_path_factory.mktemp(request.param)
    src = models.tiny_qwen3_moe(d / "bf16") if request.param == "tiny_qwen3_moe" else models.smollm2()
    summary = convert(src, d / "converted", ConvertOptions())
    ids = token_ids(src)
    online = _run(src, ids, quantization="nvfp4_sampler")
    converted = _run(d / "converted", ids)
    return request.param, summary, online, converted


def test_converted_checkpoint_matches_online_quantization(engines):
    name, summary, (lp_online, greedy_online), (lp_conv, greedy_conv) = engines
    print(f"{name}: {summary.tensors_out} tensors, {summary.bytes_in / 1e6:.1f} MB -> {summary.bytes_out / 1e6:.1f} MB, "
          f"mean log-prob {lp_conv.mean():.3f}, max |dlogp| vs online {(lp_conv - lp_online).abs().max():.2e}")
    assert lp_conv.numel() > 20 and torch.isfinite(lp_conv).all()
    assert torch.equal(lp_conv, lp_online)
    assert greedy_conv == greedy_online
    if name == "smollm2":                         # a real model stays a language model after conversion
        assert -5.0 < lp_conv.mean().item() < -1.0
