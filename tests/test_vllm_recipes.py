"""vLLM nvfp4_sampler with TransformerEngine's recipe (`op_order: te`, `weight_recipe: 2d` in
config.json's quantization_config) on a tiny random Qwen3: one real CPU engine, online quantization.

The engine's weights equal `kernels.reference` in TE's order bit for bit (the options reach the
adapter from config.json), and against the torch forward under the same options (float32, as
tests/test_vllm_dense.py) its prompt log-probs are within TOL and each greedy token is the forward's
argmax on the engine's own sequence up to a near-tie (vllm_helpers.NEAR_TIE): two implementations'
free-running decodes are not compared token for token (docs/NUMERICS.md).
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_recipes.py
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nvfp4_sampler.kernels import reference
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig, is_nvfp4_weight
from nvfp4_sampler.testing import models
from tests.vllm_helpers import (NEAR_TIE, assert_greedy_along_own_path, greedy, make_llm, prompt_logprobs,
                                reference_logprobs, reference_model, shutdown, token_ids)

pytestmark = pytest.mark.engine
TE = SamplerConfig(recipe=Recipe(weight="2d", op_order="te"))
TOL = 1e-3          # as tests/test_vllm_dense.py (float32 engine vs float32 torch forward)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A BF16 checkpoint whose config.json asks for online quantization with TE's recipe."""
    path = models.tiny_qwen3(tmp_path_factory.mktemp("te") / "bf16", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = TE.to_dict()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    llm = make_llm(ckpt, quantization="nvfp4_sampler", dtype="float32")
    ids = token_ids(ckpt)
    path = tmp_path_factory.mktemp("te_state") / "state.safetensors"
    llm.collective_rpc("nvfp4_save_state", args=(str(path),))
    out = {"ids": ids, "logprobs": prompt_logprobs(llm, ids), "greedy": greedy(llm, ids), "state": load_file(path)}
    shutdown(llm)
    return out


def test_engine_weights_are_te_quantized_bit_for_bit(engine, ckpt):
    src = load_file(ckpt / "model.safetensors")
    state, checked, differs = engine["state"], 0, 0
    for name, t in src.items():
        if not is_nvfp4_weight(name, TE):
            continue
        prefix = name.removesuffix(".weight")
        want = reference.quantize_weight(t, recipe="2d", op_order="te")
        assert torch.equal(state[name], want.codes), name
        assert torch.equal(state[f"{prefix}.weight_scale"].view(torch.uint8), want.block_scales.view(torch.uint8)), name
        assert torch.equal(state[f"{prefix}.weight_scale_2"].reshape(()), want.global_scale), name
        other = reference.quantize_weight(t, recipe="2d")               # vLLM's op order
        differs += not (torch.equal(other.codes, want.codes) and torch.equal(other.global_scale, want.global_scale))
        checked += 1
    assert checked == 2 * 7 and differs, f"{checked} weights checked, {differs} separate the op orders"


def test_logprobs_and_greedy_match_the_torch_forward_under_the_same_recipe(engine, ckpt):
    ref = reference_model(ckpt, config=TE)
    diff = (engine["logprobs"] - reference_logprobs(ref, engine["ids"])).abs()
    print(f"TE-recipe engine vs torch forward: max |dlogp| {diff.max():.2e} over {diff.numel()} tokens")
    assert diff.max() < TOL
    worst = assert_greedy_along_own_path(ref, engine["ids"], engine["greedy"])   # not token for token
    print(f"TE-recipe greedy along the engine's own path: largest regret {worst:.2e} (near-tie {NEAR_TIE:.0e})")
