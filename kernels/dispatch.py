"""Backend dispatch for the NVFP4 ops used by engines: probe-and-reason backends, one chooser.

A backend is a class with `is_supported(device) -> (ok, reason)` and the ops. `choose_backend`
walks the priority list (or honours a forced name) and fails with every collected reason; the
torch reference is always supported and always last. A forced backend that cannot run raises.
Backend libraries (triton) are imported only inside the backend that needs them.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from . import cpu_quant, reference
from .format import NVFP4Tensor


class ReferenceBackend:
    """The executable spec in plain torch: any device, slow. Weights stay packed. CPU weights are
    quantized by `kernels.cpu_quant` (the same bits, chunked, ~20x faster)."""

    name = "reference"

    @staticmethod
    def is_supported(device: torch.device) -> tuple[bool, str]:
        return True, "plain torch runs on every device"

    @staticmethod
    def quantize_weight(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None = None) -> NVFP4Tensor:
        quantizer = cpu_quant if w.device.type == "cpu" else reference
        return quantizer.quantize_weight(w, recipe=recipe, amax=amax)

    @staticmethod
    def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, scaling: str,
               amax: torch.Tensor | None = None) -> torch.Tensor:
        return reference.linear(x, w, bias=bias, scaling=scaling, amax=amax)

    @staticmethod
    def moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        return reference.moe(x, w13, w2, topk_weights, topk_ids)


class TritonHopperBackend:
    """Triton kernels for CUDA GPUs of compute capability >= 9.0 (written and measured on Hopper):
    fused per-token quantization, packed W4A4 GEMM for small M, exact-BF16 cuBLAS path for large M
    (`kernels.triton_gemm.linear_path`), grouped MoE. Quantization is bit-identical to the
    reference; GEMM and MoE differ only by FP32 summation order. No native FP4 tensor cores used."""

    name = "triton_hopper"

    @staticmethod
    def is_supported(device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"needs a CUDA device, got {device.type}"
        if not torch.cuda.is_available():
            return False, "torch.cuda is not available"
        cap = torch.cuda.get_device_capability(device)
        if cap < (9, 0):
            return False, f"needs compute capability >= 9.0 (hardware E4M3 rounding), got {cap[0]}.{cap[1]}"
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        return True, f"CUDA capability {cap[0]}.{cap[1]} with triton"

    @staticmethod
    def quantize_weight(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None = None) -> NVFP4Tensor:
        from . import triton_quant
        return triton_quant.quantize_weight(w, recipe=recipe, amax=amax)

    @staticmethod
    def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, scaling: str,
               amax: torch.Tensor | None = None) -> torch.Tensor:
        if amax is not None:
            raise NotImplementedError("triton_hopper: an activation amax override (tensor-parallel "
                                      "row-parallel layers) is not implemented; use backend='reference'")
        from . import triton_gemm
        return triton_gemm.linear(x, w, bias=bias, scaling=scaling)

    @staticmethod
    def moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        from . import triton_moe
        return triton_moe.moe(x, w13, w2, topk_weights, topk_ids)


BACKENDS: dict[str, type] = {"triton_hopper": TritonHopperBackend, "reference": ReferenceBackend}
PRIORITY: list[str] = ["triton_hopper", "reference"]   # GPU backends first; the reference always runs


@functools.lru_cache(maxsize=None)
def choose_backend(device: torch.device, backend: str = "auto"):
    """The backend class for `device`: `backend="auto"` walks PRIORITY, a name forces one.

    Raises ValueError for an unknown name and RuntimeError (with every reason) if none can run.
    """
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown NVFP4 backend {backend!r}; known: {sorted(BACKENDS)}")
        ok, reason = BACKENDS[backend].is_supported(device)
        if not ok:
            raise RuntimeError(f"NVFP4 backend {backend!r} cannot run on {device}: {reason}")
        return BACKENDS[backend]
    reasons = []
    for name in PRIORITY:
        ok, reason = BACKENDS[name].is_supported(device)
        if ok:
            return BACKENDS[name]
        reasons.append(f"{name}: {reason}")
    raise RuntimeError(f"no NVFP4 backend can run on {device}: " + "; ".join(reasons))


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None,
           scaling: str = "per_token", amax: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """W4A4 linear. x [..., K] bf16/fp16/fp32; w [N, K] NVFP4 (global_scale [] or [N]) -> [..., N] x.dtype.

    amax: optional activation amax override, fp32 [...] per token or [] per tensor (see
    `reference.quantize_activations`); None lets the backend reduce x itself.
    """
    return choose_backend(x.device, backend).linear(x, w, bias=bias, scaling=scaling, amax=amax)


def moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """W4A4 SwiGLU MoE (routing done by the caller); shapes as `reference.moe`."""
    return choose_backend(x.device, backend).moe(x, w13, w2, topk_weights, topk_ids)


def quantize_weight_on(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                       backend: str = "auto") -> NVFP4Tensor:
    """quantize_weight on w's device through the chosen backend (bit-identical to the reference)."""
    return choose_backend(w.device, backend).quantize_weight(w, recipe=recipe, amax=amax)
