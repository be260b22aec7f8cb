"""Strict mode for plain-torch NVFP4 models: every quantized op made batch-invariant, so the sampler's
decode (one token per step through the KV cache) and the learner's teacher-forced forward give
bit-identical log-probs.

What it changes, together (and nothing else):
  1. the NVFP4 GEMMs of every `NVFP4Linear` / `NVFP4Experts` run `kernels.reference` with
     `accumulate="fp64"` (an order-free, exact sum rounded once to fp32) instead of the backend
     chosen at load;
  2. attention runs `strict_attention`: one query row at a time over exactly the keys it may see
     (causal, batch 1, no padding), in float64, cast back to the activation dtype, so a row computes
     the same way in a whole-sequence forward as in a decode step.
The rest of the model must already be row-invariant: per-row RMSNorm, RoPE (no reductions), the
elementwise ops and, on this CPU, the BF16 lm_head GEMM. On a GPU every non-quantized GEMM would need
a batch-invariant kernel too (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic mode).
"""
from __future__ import annotations

import contextlib
import types

import torch

from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_plugin.torch_modules import NVFP4Experts, NVFP4Linear


STRICT_ATTENTION = "nvfp4_strict"


def strict_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float, dropout: float = 0.0, **kwargs):
    """transformers attention interface: query [1, H, Tq, D], key/value [1, Hkv, Tk, D] (the last Tq
    keys are the queries' own positions) -> ([1, Tq, H, D] in query.dtype, None). The mask is not read:
    causal by position, batch 1 without padding (as diagnostics.operators runs)."""
    if query.shape[0] != 1:
        raise ValueError(f"strict_attention runs batch 1 only, got query {tuple(query.shape)}")
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)                              # [1, H, Tk, D]
    v = value.double().repeat_interleave(groups, 1)
    tq, tk = query.shape[2], key.shape[2]
    rows = []
    for i in range(tq):
        n = tk - tq + i + 1                                                     # keys visible to row i
        s = (query[:, :, i:i + 1].double() @ k[:, :, :n].transpose(2, 3)) * scaling   # [1, H, 1, n]
        rows.append(torch.softmax(s, -1) @ v[:, :, :n])                         # [1, H, 1, D]
    return torch.cat(rows, 2).to(query.dtype).transpose(1, 2).contiguous(), None


def _strict_linear(self: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    return R.linear(x, NVFP4Tensor(self.codes, self.block_scales, self.global_scale), bias=self.bias,
                    scaling=self.config.recipe.activation_scaling, accumulate="fp64", op_order=self.config.recipe.op_order)


def _strict_experts(self: NVFP4Experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    return R.moe(hidden_states, NVFP4Tensor(*self.w13), NVFP4Tensor(*self.w2), top_k_weights, top_k_index,
                 accumulate="fp64", op_order=self.config.recipe.op_order)


@contextlib.contextmanager
def strict(model: torch.nn.Module):
    """Within the context, every NVFP4 module of `model` runs its strict forward and attention runs
    `strict_attention` (model.config._attn_implementation is restored on exit)."""
    from transformers import AttentionInterface

    AttentionInterface.register(STRICT_ATTENTION, strict_attention)
    previous = model.config._attn_implementation
    model.config._attn_implementation = STRICT_ATTENTION
    patched = []
    for m in model.modules():
        fn = _strict_linear if isinstance(m, NVFP4Linear) else _strict_experts if isinstance(m, NVFP4Experts) else None
        if fn is not None:
            m.forward = types.MethodType(fn, m)
            patched.append(m)
    try:
        yield model
    finally:
        model.config._attn_implementation = previous
        for m in patched:
            del m.forward
