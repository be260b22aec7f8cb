"""vLLM's OpenAI server with `--quantization nvfp4_sampler` on the real SmolLM2-135M-Instruct.

One server process on 127.0.0.1 (dev mode, reload extension), queried with the official `openai`
client: greedy answer, prompt log-probs against the pure-torch W4A4 forward, in-place reload over
HTTP `/collective_rpc`. Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_server.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4_sampler.server.process import free_port
from nvfp4_sampler.testing import models
from tests.vllm_helpers import EXTENSION, reference_logprobs, reference_model

pytestmark = pytest.mark.engine
TEXT = ("The quick brown fox jumps over the lazy dog. Reinforcement learning trains a policy on samples "
        "drawn from the policy itself, so the sampler and the learner must agree on every token.")
LAYER = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_dir():
    return models.smollm2()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--quantization",
           "nvfp4_sampler", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
           "--max-model-len", "512", "--enforce-eager", "--worker-extension-cls", EXTENSION]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM server exited with {proc.returncode}; see {log.name}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(2)
    else:
        proc.terminate()
        pytest.fail(f"vLLM server did not become healthy in 300 s; see {log.name}")
    yield url, log.name
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="none")


@pytest.fixture(scope="module")
def ids(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(TEXT).input_ids


def prompt_logprobs(client, ids) -> torch.Tensor:
    """float64 [len(ids) - 1] via /v1/completions echo (the first token has no log-prob)."""
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=1, echo=True, logprobs=0, temperature=0)
    lps = r.choices[0].logprobs.token_logprobs[:len(ids)]
    assert lps[0] is None
    return torch.tensor(lps[1:], dtype=torch.float64)


def rpc(server, method, *args) -> httpx.Response:
    return httpx.post(f"{server[0]}/collective_rpc", json={"method": method, "args": [str(a) for a in args]},
                      timeout=120)


def apply_update(server, staged, version) -> httpx.Response:
    """The documented reload: the update, then a prefix-cache reset (cached KV holds old-weight values)."""
    r = rpc(server, "nvfp4_apply_update", staged, version)
    assert httpx.post(f"{server[0]}/reset_prefix_cache", timeout=60).json()["success"]
    return r


@pytest.fixture(scope="module")
def base(client, ids):
    return prompt_logprobs(client, ids)


def test_chat_and_memory(client, server):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content":
                                       "What is the capital of France? Answer in one sentence."}],
                                       max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    print("W4A4 SmolLM2-135M answers:", repr(answer))
    assert answer.strip() and r.usage.completion_tokens > 0
    mem = rpc(server, "nvfp4_memory").json()["results"][0]
    print(f"SmolLM2 quantized layers: {mem['layers']}, {mem['bytes'] / 2**20:.1f} MiB = {mem['ratio']:.3f}x BF16")
    assert mem["layers"] == 30 * 4 and mem["ratio"] <= 0.30
    with open(server[1]) as f:
        assert "nvfp4_sampler: 120 quantized layers hold" in f.read()


def test_greedy_tokens_are_the_argmax_of_their_own_logprobs(client, ids):
    """Generation and teacher-forced scoring agree: every greedy token is the top-1 of its scored position."""
    gen = client.completions.create(model="smollm2", prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    out = list(gen.choices[0].token_ids)
    r = client.completions.create(model="smollm2", prompt=ids + out, max_tokens=1, echo=True, logprobs=1,
                                  temperature=0)
    lp = r.choices[0].logprobs
    for pos in range(len(ids), len(ids) + len(out)):
        assert lp.token_logprobs[pos] == pytest.approx(max(lp.top_logprobs[pos].values()), abs=1e-4), pos


def test_prompt_logprobs_match_torch_reference_statistically(base, model_dir, ids):
    ref = reference_logprobs(reference_model(model_dir, dtype=torch.bfloat16), [ids])
    diff = (base - ref).abs()
    print(f"SmolLM2 BF16 server vs torch W4A4 forward: mean |dlogp| {diff.mean():.3f}, max {diff.max():.3f}; "
          f"mean logp {base.mean():.2f} vs {ref.mean():.2f} over {diff.numel()} tokens")
    # W4A4 with per-token activations is discontinuous: one-ulp differences between two correct
    # implementations flip activation codes, and on this 30-layer model that moves log-probs by
    # ~0.3 on average even in float32 (transformers' sdpa vs eager attention: mean 0.29, max 1.25); this
    # BF16 server against the BF16 torch forward measured mean 0.871, max 2.92 over its 35 tokens (2026-12-07).
    # Exact agreement is checked on the tiny float32 models (test_vllm_dense / test_vllm_moe: < 1e-3).
    assert abs(base.mean() - ref.mean()) < 0.5
    assert diff.mean() < 1.5


def test_reload_over_http_and_restore_exactly(server, client, model_dir, ids, base, tmp_path):
    original = load_file(model_dir / "model.safetensors")[LAYER]
    staged = tmp_path / "update.safetensors"
    save_file({LAYER: (original.float() * -1.0).to(torch.bfloat16).contiguous()}, staged)
    r = apply_update(server, staged, 5)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["version"] == 5
    assert rpc(server, "nvfp4_weight_version").json()["results"] == ["5"]     # the endpoint str()s scalars
    changed = prompt_logprobs(client, ids)
    assert (changed - base).abs().max() > 0.01
    save_file({LAYER: original.contiguous()}, staged)
    assert apply_update(server, staged, 6).status_code == 200
    assert torch.equal(prompt_logprobs(client, ids), base)


def test_bad_reload_over_http_is_refused_with_the_tensor_name(server, client, ids, base, tmp_path):
    staged = tmp_path / "bad.safetensors"
    save_file({LAYER: torch.zeros(576, 100, dtype=torch.bfloat16)}, staged)
    r = apply_update(server, staged, 7)
    assert r.status_code >= 400 or "error" in r.text.lower()
    assert LAYER in r.text
    assert rpc(server, "nvfp4_weight_version").json()["results"] == ["6"]
    assert torch.equal(prompt_logprobs(client, ids), base)
