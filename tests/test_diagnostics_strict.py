"""Strict mode (diagnostics.strict): decode and teacher-forced log-probs of the same W4A4 weights are
bit-identical; the fp64-accumulated reference GEMM is batch-invariant."""
import copy

import torch

from nvfp4_sampler.diagnostics import operators as ops
from nvfp4_sampler.diagnostics.strict import strict
from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.sampler_format import SamplerConfig
from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model


def test_fp64_accumulation_is_batch_invariant_and_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1536, generator=g).to(torch.bfloat16) * torch.exp(torch.randn(48, 1, generator=g))
    w = R.quantize_weight(torch.randn(576, 1536, generator=g))
    full = R.linear(x, w, accumulate="fp64")
    assert torch.equal(full, torch.cat([R.linear(x[i:i + 1], w, accumulate="fp64") for i in range(48)]))
    torch.testing.assert_close(full.float(), R.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_strict_decode_equals_teacher_forced_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.08)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    quantize_model(model, SamplerConfig())
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    default_tf = ops.teacher_forced(model, tokens)
    with strict(model):
        tf = ops.teacher_forced(model, tokens)
        dc = ops.decode(model, tokens, prefill=6)
    assert torch.equal(tf.logprobs, dc.logprobs)                         # goal: 0 gap, met exactly
    assert all(not r["positions"] for r in ops.compare(model, tf, dc).values())
    assert model.config._attn_implementation != "nvfp4_strict"            # restored on exit
    assert (tf.logprobs - default_tf.logprobs).abs().mean() < 0.5          # same model, other rounding
    after = ops.teacher_forced(model, tokens)
    assert torch.equal(after.logprobs, default_tf.logprobs)               # forwards restored
