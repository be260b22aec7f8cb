"""vLLM nvfp4_sampler on a tiny random Qwen3 (dense): numerics, online vs pre-quantized, in-place reload.

Two real CPU engines per module, in float32 so that the comparison with the pure-torch forward is
not lost in BF16 rounding (a W4A4 model flips activation codes on one-ulp differences):
  online   -- BF16 checkpoint of seed 0, quantized at load
  prequant -- pre-quantized checkpoint (nvfp4_sampler.testing.models.write_prequantized) of seed 1

What is exact and what is not: the same implementation against itself (an engine after a reload vs a
fresh engine, online vs pre-quantized load, codes vs `kernels.reference`) is asserted bitwise. The
engine against the torch forward (two implementations) is asserted within tolerance: teacher-forced
log-probs within TOL, and greedy decode along the engine's own path (each engine token within
vllm_helpers.NEAR_TIE of the reference's argmax on the engine's sequence), never token for token --
free-running decodes of two implementations part at a near-tie (docs/NUMERICS.md, "What the tests
assert exactly").
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_dense.py
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4_sampler.testing import models
from tests.vllm_helpers import (NEAR_TIE, assert_greedy_along_own_path, greedy, make_llm, prompt_logprobs,
                                reference_logprobs, reference_model, seed_checkpoints, shutdown, token_ids)

pytestmark = pytest.mark.engine
# float32 engine vs float32 torch forward: same codes unless an activation sits within float32
# rounding of an E2M1/E4M3 decision point; measured max |diff| ~1e-5 on these prompts.
TOL = 1e-3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return seed_checkpoints(tmp_path_factory.mktemp("dense"), models.tiny_qwen3)


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts["bf16_0"])


SELECT = {"layer": lambda n: n.startswith("model.layers.1."),                  # every tensor of one layer
          "shard": lambda n: n.startswith("model.layers.0.self_attn.k_proj.")}   # one shard of a fused qkv


def _mixed(ckpts, take_from_1) -> tuple[dict, dict]:
    """(BF16 tensors of seed 1 selected by take_from_1, NVFP4 tensors of seed 0 for the rest)."""
    sd0, sd1 = load_file(ckpts["pq_0"] / "model.safetensors"), load_file(ckpts["bf16_1"] / "model.safetensors")
    return {n: t for n, t in sd1.items() if take_from_1(n)}, {n: t for n, t in sd0.items() if not take_from_1(n)}


@pytest.fixture(scope="module")
def prequant(ckpts, ids):
    """Everything measured on the pre-quantized engine (seed 1), before the online engine starts: two
    CPU engines alive at once split the cores differently and lose bitwise reproducibility."""
    d, out = ckpts["dir"], {}
    llm = make_llm(ckpts["pq_1"], dtype="float32")
    out["fresh"], out["state"] = prompt_logprobs(llm, ids), state(llm, d / "pq_state.safetensors")
    for what, select in SELECT.items():
        update(llm, _mixed(ckpts, select)[1], d / f"{what}_prequant.safetensors", 1)
        out[what] = prompt_logprobs(llm, ids), state(llm, d / f"{what}_pq_state.safetensors")
        update(llm, load_file(ckpts["pq_1"] / "model.safetensors"), d / "pq_back.safetensors", 2)
        assert torch.equal(prompt_logprobs(llm, ids), out["fresh"])
    update(llm, load_file(ckpts["pq_0"] / "model.safetensors"), d / "pq_to_0.safetensors", 3)
    out["to_0"] = prompt_logprobs(llm, ids)
    shutdown(llm)
    return out


@pytest.fixture(scope="module")
def online(ckpts, prequant):
    llm = make_llm(ckpts["bf16_0"], quantization="nvfp4_sampler", dtype="float32")
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def base(online, ids):
    """Log-probs of the online engine as loaded (seed 0)."""
    return prompt_logprobs(online, ids)


def rpc(llm, method, *args):
    return llm.collective_rpc(method, args=args)[0]


def state(llm, path) -> dict[str, torch.Tensor]:
    rpc(llm, "nvfp4_save_state", str(path))
    return load_file(path)


def update(llm, tensors: dict[str, torch.Tensor], path, version: int) -> dict:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return rpc(llm, "nvfp4_apply_update", str(path), version)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None):
    names = sorted(a) if names is None else names
    for n in names:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn else a[n],
                           b[n].view(torch.uint8) if b[n].dtype == torch.float8_e4m3fn else b[n]), n


def quantized_names(sd: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in sd.items() if t.dtype in (torch.uint8, torch.float8_e4m3fn) or n.endswith("_scale_2"))


def test_logprobs_and_greedy_match_torch_reference(online, ckpts, ids, base):
    ref = reference_model(ckpts["bf16_0"])
    diff = (base - reference_logprobs(ref, ids)).abs()
    print(f"online vs torch reference: max |dlogp| {diff.max():.2e}, mean {diff.mean():.2e} over {diff.numel()} tokens")
    assert diff.max() < TOL
    # greedy: each engine token is the reference's argmax on the engine's own sequence, up to a near-tie
    # (not token for token: two implementations' free-running decodes part at the first near-tie)
    gen = greedy(online, ids)
    worst = assert_greedy_along_own_path(ref, ids, gen)
    # Teacher-forced beyond the prompts the two implementations agree until a W4A4 code flips: on the
    # sixteenth session's machine the third prompt's continuation parts at its fourth generated token (0.09
    # nats, then up to 0.22), three tokens before the 278/223 near-tie, which it moves (earlier CI machines
    # had no flip there). That is the execution gap issue 21 is about, not a guarantee, so it is printed; the
    # guarantees are asserted: the prompts within TOL (above), each greedy token within NEAR_TIE of the
    # reference's argmax along the engine's own path, and in strict mode decode == recompute bitwise
    # (tests/test_vllm_strict.py).
    seqs = [i + g for i, g in zip(ids, gen)]
    path = (prompt_logprobs(online, seqs) - reference_logprobs(ref, seqs)).abs()
    print(f"greedy along the engine's own path: largest regret under the reference {worst:.2e} "
          f"(near-tie {NEAR_TIE:.0e}); teacher-forced on those sequences max |dlogp| {path.max():.2e}, "
          f"{int((path > TOL).sum())} of {path.numel()} tokens above TOL")
    # and the quantization is real: the BF16 model is far away
    bf16 = reference_logprobs_unquantized(ckpts["bf16_0"], ids)
    assert (base - bf16).abs().mean() > 10 * TOL


def reference_logprobs_unquantized(path, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return torch.cat([m(torch.tensor([i])).logits.double().log_softmax(-1)[0, :-1]
                          .gather(-1, torch.tensor(i)[1:, None]).squeeze(-1) for i in ids])


def test_memory_at_load_is_under_030x(online):
    mem = rpc(online, "nvfp4_memory")
    print(f"quantized layers: {mem['bytes']} B vs BF16 {mem['bf16_bytes']} B = {mem['ratio']:.3f}x")
    assert mem["layers"] == 2 * 4 and mem["ratio"] <= 0.30


def test_online_and_prequantized_codes_are_bit_identical(online, prequant, ckpts):
    for engine, pq in ((state(online, ckpts["dir"] / "state_0.safetensors"), "pq_0"), (prequant["state"], "pq_1")):
        written = load_file(ckpts[pq] / "model.safetensors")
        names = quantized_names(written)
        assert len(names) == 2 * 7 * 3
        assert_same_tensors(engine, written, names)


def test_reload_full_bf16_and_nvfp4_equal_fresh_engine_and_restore(online, prequant, ckpts, ids, base):
    d = ckpts["dir"]
    assert torch.equal(prequant["to_0"], base)       # pre-quantized engine reloaded to seed 0 == online load
    for i, src in enumerate(("bf16_1", "pq_1")):      # BF16 payload, then NVFP4 payload
        info = update(online, load_file(ckpts[src] / "model.safetensors"), d / f"full_{src}.safetensors", 10 + i)
        assert info["version"] == 10 + i and rpc(online, "nvfp4_weight_version") == 10 + i
        assert torch.equal(prompt_logprobs(online, ids), prequant["fresh"])
        update(online, load_file(ckpts["bf16_0"] / "model.safetensors"), d / "restore.safetensors", 20 + i)
        assert torch.equal(prompt_logprobs(online, ids), base)


@pytest.mark.parametrize("what", list(SELECT))
def test_partial_reload_equals_the_same_mixed_model_from_the_other_side(online, prequant, ckpts, ids, base, what):
    """Per layer (all of model.layers.1) or a single shard of a fused layer (layers.0 k_proj, BF16):
    online(seed 0) + part of seed 1 == prequant(seed 1) + the rest of seed 0, bit for bit, and
    equals the torch forward of that mixed model; the unsent q/v rows of the fused qkv stay intact."""
    d, select = ckpts["dir"], SELECT[what]
    before = state(online, d / "before.safetensors")
    update(online, _mixed(ckpts, select)[0], d / f"{what}_online.safetensors", 100)
    a, sa = prompt_logprobs(online, ids), state(online, d / "a.safetensors")
    b, sb = prequant[what]
    assert torch.equal(a, b) and not torch.equal(a, base)
    assert_same_tensors(sa, sb)
    untouched = [n for n in quantized_names(sa) if not select(n)]
    assert_same_tensors(sa, before, untouched)
    mixed_state = {n: t for n, t in load_file(ckpts["bf16_1"] / "model.safetensors").items() if select(n)}
    diff = (a - reference_logprobs(reference_model(ckpts["bf16_0"], state=mixed_state), ids)).abs()
    assert diff.max() < TOL
    update(online, load_file(ckpts["bf16_0"] / "model.safetensors"), d / "r0.safetensors", 101)
    assert torch.equal(prompt_logprobs(online, ids), base)


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 64)}, "model.layers.0.self_attn.q_proj.weight: shape"),
    ({"model.layers.0.self_attn.k_proj.weight": torch.zeros(128, 64, dtype=torch.uint8)},
     "model.layers.0.self_attn.k_proj.weight_scale"),
    ({"model.layers.0.mlp.up_proj.weight_scale": torch.zeros(256, 8, dtype=torch.float32)},
     "model.layers.0.mlp.up_proj.weight_scale: dtype"),
    ({"model.layers.0.mlp.nope_proj.weight": torch.zeros(4, 4)}, "model.layers.0.mlp.nope_proj.weight: no such"),
    ({"model.norm.weight": torch.zeros(64)}, "model.norm.weight: shape"),
])
def test_bad_update_names_the_tensor_and_writes_nothing(online, ckpts, ids, base, tensors, message):
    d = ckpts["dir"]
    good = {"model.layers.1.mlp.down_proj.weight": torch.ones(128, 256)}     # would change the output
    with pytest.raises(Exception, match=message.replace(".", r"\.")):
        update(online, {**good, **tensors}, d / "bad.safetensors", 999)
    assert rpc(online, "nvfp4_weight_version") != 999
    assert torch.equal(prompt_logprobs(online, ids), base)
