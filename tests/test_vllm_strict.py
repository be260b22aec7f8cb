"""vLLM nvfp4_sampler with `strict: true` on the CPU engine: one real engine (tiny random Qwen3-MoE,
BF16, online quantization), strict asked for through `hf_overrides` as `nvfp4-sampler serve --strict`
does. Every NVFP4 layer (attention linears, MLP experts) runs the reference backend with fp64 sums
(batch-invariant), and the log-probs the engine returns while decoding, greedy and sampled, batch 1
and a mixed batch of prompts of different lengths, equal bitwise the prompt log-probs of the same
sequences recomputed in one prefill batch; the same after an in-place weight update.
On CUDA the same switch runs the Triton/CUDA strict paths (tests/test_gpu_vllm_strict.py, H200).
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_strict.py
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4_sampler.sampler_format import SamplerConfig
from nvfp4_sampler.testing import models
from tests.vllm_helpers import decode_and_recompute, make_llm, shutdown, token_ids

pytestmark = pytest.mark.engine
STRICT = {"quantization_config": SamplerConfig(strict=True).to_dict()}
NEW = 12


def _params(kind: str):
    from vllm import SamplingParams

    if kind == "greedy":
        return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    return SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """{"layers": nvfp4_layers(), (phase, kind, batch): (decoded, recomputed)} of one strict engine;
    phase "start", then "updated" (seed-1 weights through nvfp4_apply_update)."""
    d = tmp_path_factory.mktemp("strict")
    model = models.tiny_qwen3_moe(d / "bf16_0", seed=0)
    new = load_file(models.tiny_qwen3_moe(d / "bf16_1", seed=1) / "model.safetensors")
    ids = token_ids(model)
    llm = make_llm(model, quantization="nvfp4_sampler", dtype="bfloat16", hf_overrides=STRICT)
    out = {"layers": llm.collective_rpc("nvfp4_layers")[0]}
    for phase in ("start", "updated"):
        if phase == "updated":
            save_file(new, d / "update.safetensors")
            llm.collective_rpc("nvfp4_apply_update", args=(str(d / "update.safetensors"), 1))
        for kind in ("greedy", "sampled"):
            for batch, prompts in (("batch1", ids[:1]), ("mixed", ids)):
                out[phase, kind, batch] = decode_and_recompute(llm, prompts, _params(kind))
    shutdown(llm)
    return out


def test_every_nvfp4_layer_runs_strict(engine):
    layers = engine["layers"]
    assert {v["op"] for v in layers.values()} == {"linear", "moe"}
    assert all(v["strict"] and v["backend"] == "reference" for v in layers.values()), layers
    assert "model.layers.1.mlp.experts" in layers and "model.layers.0.self_attn.qkv_proj" in layers


@pytest.mark.parametrize("phase", ["start", "updated"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("batch", ["batch1", "mixed"])
def test_decode_logprobs_equal_the_recomputed_ones_bitwise(engine, phase, kind, batch):
    decoded, recomputed = engine[phase, kind, batch]
    assert [len(d) for d in decoded] == [NEW] * len(decoded)
    a, b = torch.tensor(sum(decoded, [])), torch.tensor(sum(recomputed, []))
    assert torch.equal(a, b), f"max |d| {(a - b).abs().max():.3e} over {a.numel()} tokens"


def test_updated_weights_change_the_logprobs(engine):
    assert engine["start", "greedy", "mixed"] != engine["updated", "greedy", "mixed"]


def test_serve_strict_builds_the_engine_with_the_switch(tmp_path):
    """`nvfp4-sampler serve --strict`: the vLLM server gets strict through --hf-overrides (a converter's
    options kept) and, on CUDA, VLLM_BATCH_INVARIANT=1; other engines refuse it."""
    import json

    from nvfp4_sampler.server.cli import build_parser
    from nvfp4_sampler.server.engines.vllm import vllm_server
    from nvfp4_sampler.server.settings import Settings

    model = models.write_prequantized(models.tiny_qwen3(tmp_path / "bf16"), tmp_path / "pq")
    assert build_parser().parse_args(["serve", str(model), "--strict"]).strict
    child = vllm_server(model, port=1, log=tmp_path / "log", strict=True, device="cuda")
    overrides = json.loads(child.cmd[child.cmd.index("--hf-overrides") + 1])["quantization_config"]
    assert SamplerConfig.from_dict(overrides) == SamplerConfig(prequantized=True, strict=True)
    assert child.env["VLLM_BATCH_INVARIANT"] == "1"
    assert "--hf-overrides" not in vllm_server(model, port=1, log=tmp_path / "log").cmd
    with pytest.raises(ValueError, match="strict is a mode of the vllm engine"):
        Settings(model=str(model), engine="embedded", strict=True)
