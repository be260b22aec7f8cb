"""Operator layer of diagnostics.operators: alignment by (sequence, position) and (token, expert id)
on constructed cases, and on a real (tiny, random) Qwen3-MoE learner vs its decode path."""
import copy

import pytest
import torch

from nvfp4_sampler.diagnostics import operators as ops
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig
from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model


def _quantized(seed=0, t=6, k=64):
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return ops.Quantized.of(x, scaling="per_token")


def test_a_planted_code_flip_is_found_at_its_position():
    a = _quantized()
    b = copy.deepcopy(a)
    b.codes[4, 17] = (b.codes[4, 17] + 1) % 8          # one element, one position
    r = ops.compare_acts(a, b)
    assert r["positions"] == [4] and r["act_code_mismatch"] == pytest.approx(1 / a.codes.numel())
    assert r["act_scale_mismatch"] == 0 and r["act_global_mismatch"] == 0
    assert ops.compare_acts(a, copy.deepcopy(a))["positions"] == []


def test_permuted_routing_is_not_a_flip():
    ids = torch.tensor([[0, 3], [2, 5], [7, 1]])
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
    learner = ops.MoeCall(ids, w)
    permuted = ops.MoeCall(ids.flip(-1), w.flip(-1))   # same experts, other slot order
    r = ops.compare_routing(learner, permuted)
    assert r["routing_flip_rate"] == 0 and r["routing_flip_tokens"] == [] and r["routing_weight_max_diff"] == 0
    assert r["pairs"][0].numel() == 6
    changed = ops.MoeCall(torch.tensor([[3, 0], [2, 6], [1, 7]]), w)
    r = ops.compare_routing(learner, changed)
    assert r["routing_flip_rate"] == pytest.approx(1 / 6) and r["routing_flip_tokens"] == [1]


def _tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.08)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def moe_models():
    base = _tiny_moe()
    per_token = copy.deepcopy(base)
    quantize_model(per_token, SamplerConfig())
    per_tensor = copy.deepcopy(base)
    experts = tuple(f"model.layers.{i}.mlp.experts" for i in range(2))     # MoE kernels are per-token only
    quantize_model(per_tensor, SamplerConfig(recipe=Recipe(activation_scaling="per_tensor"), keep_bf16=experts))
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    return per_token, per_tensor, tokens


def test_planted_flip_in_a_model_is_found_at_its_layer_and_position(moe_models):
    """Two teacher-forced runs, the second with one input element of layer 1's o_proj negated at
    position 13: the first operator (in model order) that differs is that one, at (0, 13) only."""
    model, _, tokens = moe_models
    clean = ops.teacher_forced(model, tokens)
    target = "model.layers.1.self_attn.o_proj"

    def plant(module, args):
        x = args[0].clone()
        j = x[0, 13].abs().argmax()
        x[0, 13, j] = -x[0, 13, j]
        return (x,)

    h = model.get_submodule(target).register_forward_pre_hook(plant)
    try:
        dirty = ops.teacher_forced(model, tokens)
    finally:
        h.remove()
    report = ops.compare(model, clean, dirty)
    first = next(name for name, r in report.items() if r["positions"])
    assert first == target and report[target]["positions"] == [(0, 13)]
    assert all(not report[n]["positions"] for n in list(report)[:list(report).index(target)])


def test_decode_vs_teacher_forced_per_token_vs_per_tensor(moe_models):
    """The sampler's token-by-token decode against the learner's whole-sequence forward, both W4A4:
    per-token scaling keeps codes (nearly) equal; per-tensor scaling rescales every token by its
    neighbours, so codes and scales differ widely. Routing is compared as expert sets."""
    per_token, per_tensor, tokens = moe_models
    rt = ops.compare(per_token, ops.teacher_forced(per_token, tokens), ops.decode(per_token, tokens))
    rp = ops.compare(per_tensor, ops.teacher_forced(per_tensor, tokens), ops.decode(per_tensor, tokens))
    first = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]       # same input on both paths (embeddings)
    assert all(rt[n]["input_rel_err"] == 0 and rt[n]["act_code_mismatch"] == 0 for n in first)
    assert all(rp[n]["input_rel_err"] == 0 and rp[n]["act_code_mismatch"] > 0.02 and rp[n]["act_scale_mismatch"] > 0.5
               for n in first)
    assert rp[first[0]]["act_global_mismatch"] > 0.9        # per-tensor scale = max over all 24 tokens vs one
    code_t = sum(r["act_code_mismatch"] for r in rt.values()) / len(rt)
    code_p = sum(r["act_code_mismatch"] for r in rp.values()) / len(rp)
    assert code_t < code_p
    moe = rt["model.layers.0.mlp.experts"]
    assert set(moe) >= {"routing_flip_rate", "expert_out_rel_err", "expert_out_exact", "shared_pairs"}
    assert moe["shared_pairs"] == round(24 * 2 * (1 - moe["routing_flip_rate"]))


def test_weight_recipe_mismatch_is_reported():
    from nvfp4_sampler.kernels import reference as R

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    same = ops.compare_weights(R.quantize_weight(w), R.quantize_weight(w))
    assert same["weight_code_mismatch"] == 0 and same["weight_rel_err"] == 0
    conv = ops.compare_weights(R.quantize_weight(w, recipe="2d", op_order="te"), R.quantize_weight(w))
    assert conv["weight_scale_mismatch"] > 0.5 and conv["weight_code_mismatch"] > 0.01


def test_diagnose_learner_takes_the_recipe(tmp_path):
    """`diagnose --recipe 2d --op-order te`: the learner-side recompute holds TE-quantized weights and
    its operator capture quantizes activations in TE's order (what a TE-recipe sampler runs)."""
    from nvfp4_sampler.diagnostics.cli import load_learner
    from nvfp4_sampler.kernels import reference
    from nvfp4_sampler.testing import models

    path = models.tiny_qwen3(tmp_path / "m", seed=3)
    learner = load_learner(path, Recipe(weight="2d", op_order="te"))
    plain = load_learner(path, None)
    name = "model.layers.0.mlp.down_proj"
    layer, w = learner.get_submodule(name), plain.get_submodule(name).weight
    assert layer.config.recipe == Recipe(weight="2d", op_order="te")
    want = reference.quantize_weight(w, recipe="2d", op_order="te")
    assert torch.equal(layer.codes, want.codes) and torch.equal(layer.global_scale, want.global_scale.expand(w.shape[0]))
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with ops.Recorder(learner) as rec:                     # the capture hook on the learner's layer
        layer(x)
    got = rec.calls[name][0]
    te, vllm = (reference.quantize_per_token(x, op_order=o).global_scale for o in ("te", "vllm"))
    assert not torch.equal(te, vllm)                       # the two orders part on some of these rows
    assert torch.equal(got.global_scale, te)


@pytest.mark.gpu
def test_learner_and_operator_layer_on_the_gpu(tmp_path, moe_models):
    """`diagnose --device cuda`: the learner loads on the GPU with the CPU learner's weight bits, and the
    operator layer runs there (first layer's q/k/v see the same embeddings on both paths: no flip)."""
    from nvfp4_sampler.diagnostics.cli import learner_logprobs, load_learner
    from nvfp4_sampler.testing import models

    path = models.tiny_qwen3(tmp_path / "m", seed=3)
    cpu, gpu = load_learner(path, Recipe()), load_learner(path, Recipe(), "cuda")
    name = "model.layers.0.mlp.down_proj"
    assert gpu.get_submodule(name).codes.is_cuda
    assert torch.equal(gpu.get_submodule(name).codes.cpu(), cpu.get_submodule(name).codes)
    seq = list(range(3, 30))
    lp = learner_logprobs(gpu, [seq], [5])[0]
    assert len(lp) == len(seq) - 5 and all(v <= 0 for v in lp)
    model, _, tokens = moe_models
    model = copy.deepcopy(model).cuda()
    rt = ops.compare(model, ops.teacher_forced(model, tokens), ops.decode(model, tokens))
    first = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert all(rt[n]["input_rel_err"] == 0 and rt[n]["act_code_mismatch"] == 0 for n in first)
    moe = rt["model.layers.0.mlp.experts"]
    assert moe["shared_pairs"] == round(24 * 2 * (1 - moe["routing_flip_rate"]))
