"""vLLM nvfp4_sampler on a tiny random Qwen3-MoE: routed NVFP4 experts, pre-quantized load, expert reload,
updates from a trainer through a weight group (`server.broadcast.BroadcastWorkerExtension`, gloo).

Engines (float32, one at a time): the pre-quantized checkpoint of seed 0, then the online (BF16)
checkpoint of seed 0. Reloads and loads of the same weights are asserted bitwise; the engine against
the torch forward within tolerance: teacher-forced log-probs within TOL, greedy tokens along the
engine's own path (vllm_helpers.NEAR_TIE; see test_vllm_dense.py and docs/NUMERICS.md).
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_moe.py
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4_sampler.testing import models
from tests.vllm_helpers import (NEAR_TIE, assert_greedy_along_own_path, greedy, group_trainer, make_llm,
                                prompt_logprobs, reference_logprobs, reference_model, shutdown, token_ids)

pytestmark = pytest.mark.engine
TOL = 1e-3          # float32 engine vs float32 torch forward (see test_vllm_dense.py)
EXPERT = "model.layers.1.mlp.experts.5"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    paths = {"bf16_0": models.tiny_qwen3_moe(d / "bf16_0", seed=0), "bf16_1": models.tiny_qwen3_moe(d / "bf16_1", seed=1)}
    paths["pq_0"] = models.write_prequantized(paths["bf16_0"], d / "pq_0")
    paths["dir"] = d
    return paths


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts["bf16_0"])


def rpc(llm, method, *args):
    return llm.collective_rpc(method, args=args)[0]


def state(llm, path) -> dict[str, torch.Tensor]:
    rpc(llm, "nvfp4_save_state", str(path))
    return load_file(path)


def update(llm, tensors, path, version):
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return rpc(llm, "nvfp4_apply_update", str(path), version)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def prequant(ckpts, ids):
    llm = make_llm(ckpts["pq_0"], dtype="float32")
    out = {"logprobs": prompt_logprobs(llm, ids), "state": state(llm, ckpts["dir"] / "pq_state.safetensors")}
    shutdown(llm)
    return out


@pytest.fixture(scope="module")
def online(ckpts, prequant):
    llm = make_llm(ckpts["bf16_0"], quantization="nvfp4_sampler", dtype="float32",
                   worker_extension_cls="nvfp4_sampler.server.broadcast.BroadcastWorkerExtension")
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def base(online, ids):
    return prompt_logprobs(online, ids)


def test_moe_logprobs_and_greedy_match_torch_reference(online, ckpts, ids, base):
    ref = reference_model(ckpts["bf16_0"])
    diff = (base - reference_logprobs(ref, ids)).abs()
    print(f"MoE online vs torch reference: max |dlogp| {diff.max():.2e} over {diff.numel()} tokens")
    assert diff.max() < TOL
    worst = assert_greedy_along_own_path(ref, ids, greedy(online, ids))     # not token for token (test_vllm_dense.py)
    print(f"MoE greedy along the engine's own path: largest regret {worst:.2e} (near-tie {NEAR_TIE:.0e})")
    mem = rpc(online, "nvfp4_memory")
    print(f"MoE quantized layers: {mem['ratio']:.3f}x of BF16")
    assert mem["layers"] == 2 * 3 and mem["ratio"] <= 0.30       # qkv, o_proj, experts per layer


def test_moe_online_and_prequantized_loads_are_bit_identical(online, prequant, ckpts, ids, base):
    engine = state(online, ckpts["dir"] / "online_state.safetensors")
    written = load_file(ckpts["pq_0"] / "model.safetensors")
    names = [n for n, t in written.items() if t.dtype in (torch.uint8, torch.float8_e4m3fn) or n.endswith("_scale_2")]
    assert len(names) == 2 * (4 + 8 * 3) * 3 and f"{EXPERT}.up_proj.weight_scale_2" in names
    for n in names:
        assert torch.equal(as_bytes(engine[n]), as_bytes(written[n])), n
        assert torch.equal(as_bytes(prequant["state"][n]), as_bytes(written[n])), n
    assert torch.equal(prequant["logprobs"], base)


def _reference_with(ckpts, ids, expert_up: torch.Tensor | None = None, router: torch.Tensor | None = None):
    """Torch reference of seed 0 with one expert's up_proj and/or layer 1's router replaced."""
    from transformers import AutoModelForCausalLM

    from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

    m = AutoModelForCausalLM.from_pretrained(str(ckpts["bf16_0"]), dtype=torch.float32)
    mlp = m.model.layers[1].mlp
    with torch.no_grad():
        if expert_up is not None:
            inter = mlp.experts.gate_up_proj.shape[1] // 2
            mlp.experts.gate_up_proj[5, inter:] = expert_up.float()
        if router is not None:
            mlp.gate.weight.copy_(router.float())
    quantize_model(m)
    return reference_logprobs(m, ids)


@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
def test_single_expert_shard_reload(online, ckpts, ids, base, payload):
    """Replace only expert 5's up_proj of layer 1: its gate rows and every other expert stay bit-identical,
    log-probs equal the torch forward of that model, and restoring gives the old log-probs exactly."""
    d = ckpts["dir"]
    new_up = load_file(ckpts["bf16_1"] / "model.safetensors")[f"{EXPERT}.up_proj.weight"]
    if payload == "bf16":
        tensors = {f"{EXPERT}.up_proj.weight": new_up}
    else:
        from nvfp4_sampler.kernels.reference import quantize_weight
        q = quantize_weight(new_up)
        tensors = {f"{EXPERT}.up_proj.weight": q.codes, f"{EXPERT}.up_proj.weight_scale": q.block_scales,
                   f"{EXPERT}.up_proj.weight_scale_2": q.global_scale}
    before = state(online, d / "before.safetensors")
    update(online, tensors, d / f"expert_{payload}.safetensors", 7)
    after = state(online, d / "after.safetensors")
    changed = sorted(n for n in before if not torch.equal(as_bytes(before[n]), as_bytes(after[n])))
    assert changed and all(n.startswith(f"{EXPERT}.up_proj.") for n in changed)
    lp = prompt_logprobs(online, ids)
    assert not torch.equal(lp, base)
    assert (lp - _reference_with(ckpts, ids, expert_up=new_up)).abs().max() < TOL
    update(online, {k: before[k] for k in before if k.startswith(f"{EXPERT}.up_proj.")}, d / "back.safetensors", 8)
    assert torch.equal(prompt_logprobs(online, ids), base)


def test_router_reload_stays_bf16(online, ckpts, ids, base):
    d = ckpts["dir"]
    name = "model.layers.1.mlp.gate.weight"
    new = load_file(ckpts["bf16_1"] / "model.safetensors")[name]
    old = load_file(ckpts["bf16_0"] / "model.safetensors")[name]
    update(online, {name: new}, d / "router.safetensors", 9)
    lp = prompt_logprobs(online, ids)
    assert not torch.equal(lp, base)
    assert (lp - _reference_with(ckpts, ids, router=new)).abs().max() < TOL
    update(online, {name: old}, d / "router_back.safetensors", 10)
    assert torch.equal(prompt_logprobs(online, ids), base)


def test_per_rank_update_through_a_weight_group(online, ckpts, ids, base):
    """Layer 1's experts of seed 1 (NVFP4 triplets) sent by a trainer thread through a weight group: the
    worker's state holds exactly those tensors after, a corrupted update is refused by the worker and the
    trainer alike with nothing written, and sending seed 0's back restores the log-probs bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from nvfp4_sampler.kernels.reference import quantize_weight
    from nvfp4_sampler.server.process import free_port

    d = ckpts["dir"]
    new = {}
    for name, w in load_file(ckpts["bf16_1"] / "model.safetensors").items():
        if name.startswith("model.layers.1.mlp.experts."):
            q, p = quantize_weight(w), name.removesuffix(".weight")
            new |= {name: q.codes, f"{p}.weight_scale": q.block_scales, f"{p}.weight_scale_2": q.global_scale}
    before = state(online, d / "group_before.safetensors")
    bad = dict(new)
    bad[f"{EXPERT}.down_proj.weight_scale"] = new[f"{EXPERT}.down_proj.weight_scale"].clone()
    bad[f"{EXPERT}.down_proj.weight_scale"].view(torch.uint8)[3, 1] = 0x7F
    old = {n: before[n] for n in new}
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(group_trainer, port, 2, [new, bad, old])
        assert rpc(online, "nvfp4_join_weight_group", "127.0.0.1", port, 1, 2, "gloo", 120) == 1
        plan = rpc(online, "nvfp4_share_rank_plans")
        assert plan["entries"] == 2 and plan["rank"] == 1             # w13 and w2 of layer 1, fused
        report = rpc(online, "nvfp4_receive_rank_update", 21)
        after = state(online, d / "group_after.safetensors")
        lp = prompt_logprobs(online, ids)
        with pytest.raises(Exception, match=f"{EXPERT}.down_proj.weight_scale"):
            rpc(online, "nvfp4_receive_rank_update", 22)
        refused = state(online, d / "group_refused.safetensors")
        rpc(online, "nvfp4_receive_rank_update", 23)
        assert sent.result(timeout=120)[1] == [True, False, True]
    assert report["version"] == 21 and report["tensors"] == len(new) and report["bytes"] == plan["bytes"]
    for n, t in after.items():
        assert torch.equal(as_bytes(t), as_bytes(new[n] if n in new else before[n])), n
        assert torch.equal(as_bytes(refused[n]), as_bytes(t)), n
    assert not torch.equal(lp, base)
    assert rpc(online, "nvfp4_weight_version") == 23 and torch.equal(prompt_logprobs(online, ids), base)
