"""The NVFP4 operations engines call, as torch custom ops (`torch.ops.nvfp4_sampler.*`).

Registered with `torch.library.custom_op` and a fake (meta) implementation each, so torch.compile
(dynamo + inductor, vLLM's default mode) sees them as opaque nodes with known output shapes and
CUDA graphs capture the kernels they launch. Each op takes the backend *name* chosen when the
layer's weights were created or loaded (`kernels.dispatch.choose_backend`) and calls it through a
dict lookup: nothing in an op probes, imports, reads the environment or counts.

Tensors are positional (custom ops take no keyword-only tensors; pass None for an absent optional
one); flags are keyword-only. Weights are passed as their three storage tensors (see `kernels.format.NVFP4Tensor`):
  codes         uint8 [..., N, K/2]          E2M1 pairs, even element in the low nibble
  block_scales  float8_e4m3fn [..., N, K/16] linear layout
  global_scale  float32, decode direction; [] (per tensor), [N] (per row), [E] or [E, N] (experts)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import dispatch
from .format import BLOCK, NVFP4Tensor

Tensor = torch.Tensor


@torch.library.custom_op("nvfp4_sampler::linear", mutates_args=())
def linear(x: Tensor, codes: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Optional[Tensor],
           amax: Optional[Tensor], *, scaling: str, op_order: str, backend: str, strict: bool = False) -> Tensor:
    """W4A4 linear: quantize x per `scaling`, multiply by the NVFP4 weight, add bias.

    Parameters
    ----------
    x : Tensor
        Activations [..., K], bfloat16 / float16 / float32.
    codes, block_scales, global_scale : Tensor
        The weight [N, K]: uint8 [N, K/2], float8_e4m3fn [N, K/16], float32 [] or [N] (decode).
    bias : Optional[Tensor]
        [N] in x.dtype, or None.
    amax : Optional[Tensor]
        Activation amax override, float32 [...] (= x.shape[:-1]) per token or [] per tensor (the
        tensor-parallel all-reduced amax of a row-parallel layer); None: the backend reduces x.
    scaling : str
        "per_token" or "per_tensor".
    op_order : str
        The activation quantizer's float-op order: "vllm" (the spec) or "te" (TransformerEngine).
    backend : str
        A `kernels.dispatch.BACKENDS` name, chosen at load.
    strict : bool
        Batch-invariant sums (`SamplerConfig.strict`): a row's output does not depend on the other rows.

    Returns
    -------
    Tensor
        [..., N] in x.dtype.
    """
    w = NVFP4Tensor(codes, block_scales, global_scale)
    return dispatch.BACKENDS[backend].linear(x, w, bias=bias, scaling=scaling, amax=amax, op_order=op_order,
                                             strict=strict)


@linear.register_fake
def _linear_fake(x, codes, block_scales, global_scale, bias, amax, *, scaling, op_order, backend, strict=False):
    return x.new_empty((*x.shape[:-1], codes.shape[-2]))


@torch.library.custom_op("nvfp4_sampler::moe", mutates_args=())
def moe(x: Tensor, w13_codes: Tensor, w13_block_scales: Tensor, w13_global_scale: Tensor, w2_codes: Tensor,
        w2_block_scales: Tensor, w2_global_scale: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
        op_order: str, backend: str, strict: bool = False, amax_group: Optional[str] = None) -> Tensor:
    """W4A4 SwiGLU experts with per-token activations; routing already done by the caller.

    Parameters
    ----------
    x : Tensor
        Tokens [T, H], bfloat16 / float16 / float32.
    w13_codes, w13_block_scales, w13_global_scale : Tensor
        Gate rows then up rows [E, 2I, H]: uint8 [E, 2I, H/2], float8_e4m3fn [E, 2I, H/16],
        float32 [E] or [E, 2I].
    w2_codes, w2_block_scales, w2_global_scale : Tensor
        Down projection [E, H, I]: uint8 [E, H, I/2], float8_e4m3fn [E, H, I/16], float32 [E] or [E, H].
    topk_weights : Tensor
        [T, k] float, the router weights of each token's experts.
    topk_ids : Tensor
        [T, k] int, expert ids.
    op_order : str
        The per-token activation quantizer's float-op order: "vllm" or "te".
    backend : str
        A `kernels.dispatch.BACKENDS` name, chosen at load.
    strict : bool
        Batch-invariant sums (`SamplerConfig.strict`): a token's output does not depend on the other tokens.
    amax_group : str, optional
        On a tensor-parallel rank holding a slice of the intermediate size I (I here is this rank's): the
        name of the ranks' process group, over which each SwiGLU row's amax is all-reduced (MAX) before
        its quantization for w2, so every rank quantizes with the whole row's scale (a backend whose
        `can_implement` takes an amax override for MoE; chosen at load).

    Returns
    -------
    Tensor
        [T, H] in x.dtype: sum over k of topk_weights * down(silu(gate(x)) * up(x)); under amax_group this
        rank's partial sum (over its slice of I), which the engine all-reduces.
    """
    w13 = NVFP4Tensor(w13_codes, w13_block_scales, w13_global_scale)
    w2 = NVFP4Tensor(w2_codes, w2_block_scales, w2_global_scale)
    extra = {} if amax_group is None else {"row_amax": functools.partial(_all_reduce_max, group=amax_group)}
    return dispatch.BACKENDS[backend].moe(x, w13, w2, topk_weights, topk_ids, op_order=op_order, strict=strict,
                                          **extra)


def _all_reduce_max(t: Tensor, *, group: str) -> Tensor:
    """t all-reduced (MAX) in place over the process group named `group`."""
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                 group=torch.distributed.distributed_c10d._resolve_process_group(group))
    return t


@moe.register_fake
def _moe_fake(x, w13_codes, w13_block_scales, w13_global_scale, w2_codes, w2_block_scales, w2_global_scale,
              topk_weights, topk_ids, *, op_order, backend, strict=False, amax_group=None):
    return torch.empty_like(x)


@torch.library.custom_op("nvfp4_sampler::quantize_activations", mutates_args=())
def quantize_activations(x: Tensor, amax: Optional[Tensor], *, scaling: str, op_order: str,
                         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4 activation quantization (per token: every row its own second-level scale).

    Parameters
    ----------
    x : Tensor
        [..., K] bfloat16 / float16 / float32, K a multiple of 16.
    amax : Optional[Tensor]
        Second-level amax override: float32 [...] per token or [] per tensor; None: max|x|.
    scaling : str
        "per_token" or "per_tensor".
    op_order : str
        "vllm" (the spec) or "te" (TransformerEngine's float-op order).
    backend : str
        A `kernels.dispatch.BACKENDS` name.

    Returns
    -------
    codes : Tensor
        uint8 [..., K/2].
    block_scales : Tensor
        float8_e4m3fn [..., K/16], linear layout.
    global_scale : Tensor
        float32 [...] per token, [] per tensor (decode direction, amax / 2688).
    """
    q = dispatch.BACKENDS[backend].quantize_activations(x, scaling=scaling, amax=amax, op_order=op_order)
    return q.codes, q.block_scales, q.global_scale


@quantize_activations.register_fake
def _quantize_activations_fake(x, amax, *, scaling, op_order, backend):
    lead = x.shape[:-1]
    k = x.shape[-1]
    return (x.new_empty((*lead, k // 2), dtype=torch.uint8),
            x.new_empty((*lead, k // BLOCK), dtype=torch.float8_e4m3fn),
            x.new_empty(lead if scaling == "per_token" else (), dtype=torch.float32))
