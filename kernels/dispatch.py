"""Backends of the NVFP4 ops used by engines, and the one chooser that picks a backend per layer.

A backend is a class with
  weight_layout                              the `format.LAYOUTS` entry its layers store weights in
                                             (chosen with the backend, at load time)
  is_supported(device) -> (ok, reason)       can it run on this device at all (libraries, hardware)
  can_implement(req) -> (ok, reason)         can it compute this layer (`Requirements`: op, scaling,
                                             activation amax override, shape)
  prepare(device, op)                        load-time set-up once chosen for `op` (compiled kernels, buffers;
                                             a quantizer-only choice compiles no GEMM)
and the ops (`quantize_weight`, `quantize_activations`, `linear`, `moe`), each taking the
quantizer's `op_order` ("vllm", the spec, or "te": `kernels.reference`); `linear` and `moe` also
take `strict` (batch-invariant sums: the reference in fp64, the GPU backends' `triton_strict`).
`choose_backend` runs once per layer when an engine creates or loads its weights: it walks PRIORITY
(or honours a forced name) and fails with every collected reason; the torch reference is always
supported and always last (for strict on a GPU only when forced). A
forced backend that cannot run raises instead of falling back. The chosen *name* is stored on the
layer; forwards call `kernels.ops` (torch custom ops) with it, which look the class up in BACKENDS:
no probing, importing or counting in a forward. Backend libraries (triton) are imported only inside
the backend that needs them.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import torch

from nvfp4_sampler.sampler_format import ACTIVATION_SCALINGS

from . import cpu_quant, reference
from .format import BLOCK, NVFP4Tensor

OPS = ("linear", "moe", "quantize_activations")


@dataclasses.dataclass(frozen=True)
class Requirements:
    """What a layer asks of a backend.

    op: one of OPS. scaling: activation scaling, "per_token" or "per_tensor". amax_override: the
    layer passes its own activation amax (tensor-parallel row-parallel layers, all-reduced over
    ranks; MoE experts split over tensor-parallel ranks: the SwiGLU rows' amax, `reference.moe` row_amax).
    k: the reduction size K of the layer (of the first GEMM for MoE), None if unknown.
    dtype: the activations' dtype, None if unknown.
    strict: batch-invariant execution (`SamplerConfig.strict`): every output summed in an order that
    depends on the weight shape only, never on M or the other rows. rows: the row count of each
    checkpoint tensor the layer stacks (fused q/k/v, gate/up; this rank's part), () if unknown.
    """

    op: str
    scaling: str = "per_token"
    amax_override: bool = False
    k: int | None = None
    dtype: torch.dtype | None = None
    strict: bool = False
    rows: tuple[int, ...] = ()

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.scaling not in ACTIVATION_SCALINGS:
            raise ValueError(f"scaling must be one of {ACTIVATION_SCALINGS}, got {self.scaling!r}")


def _common_checks(req: Requirements) -> tuple[bool, str]:
    if req.k is not None and req.k % BLOCK:
        return False, f"K={req.k} is not a multiple of {BLOCK}"
    if req.op == "moe" and req.scaling != "per_token":
        return False, "MoE experts implement per-token activation scaling only"
    if req.strict and req.scaling != "per_token":
        return False, "strict needs per-token activation scaling (a per-tensor scale depends on the batch)"
    return True, ""


class ReferenceBackend:
    """The executable spec in plain torch: any device, slow. Weights stay packed. CPU weights are
    quantized by `kernels.cpu_quant` (the same bits, chunked, ~20x faster)."""

    name = "reference"
    weight_layout = "modelopt"

    @staticmethod
    def is_supported(device: torch.device) -> tuple[bool, str]:
        return True, "plain torch runs on every device"

    @staticmethod
    def prepare(device: torch.device, op: str) -> None:
        """Load-time set-up of the chosen backend on `device` (nothing to do for the reference)."""

    @staticmethod
    def can_implement(req: Requirements) -> tuple[bool, str]:
        ok, reason = _common_checks(req)
        return (ok, reason) if not ok else (True, "the reference implements every op")

    @staticmethod
    def quantize_weight(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None = None,
                        op_order: str = "vllm") -> NVFP4Tensor:
        quantizer = cpu_quant if w.device.type == "cpu" else reference
        return quantizer.quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order)

    @staticmethod
    def quantize_weight_into(w: torch.Tensor, out: NVFP4Tensor, *, amax: torch.Tensor | None = None, share: int = 1,
                             recipe: str, op_order: str = "vllm") -> torch.Tensor:
        used = reference.weight_amax(w, share) if amax is None else amax
        if not bool(torch.isfinite(used).all()):             # NaN/Inf in w: the caller's flag says so
            return used
        per_expert = used if share == 1 else used.repeat_interleave(share)
        q = ReferenceBackend.quantize_weight(w, recipe=recipe, amax=per_expert, op_order=op_order)
        for dst, src in zip((out.codes, out.block_scales, out.global_scale), (q.codes, q.block_scales, q.global_scale)):
            dst.copy_(src.reshape(dst.shape))
        return used

    @staticmethod
    def quantize_activations(x: torch.Tensor, *, scaling: str, amax: torch.Tensor | None = None,
                             op_order: str = "vllm") -> NVFP4Tensor:
        return reference.quantize_activations(x, scaling=scaling, amax=amax, op_order=op_order)

    @staticmethod
    def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, scaling: str,
               amax: torch.Tensor | None = None, op_order: str = "vllm", strict: bool = False) -> torch.Tensor:
        x, bad = _split_nonfinite(x, per_token=scaling == "per_token")
        return _poison(reference.linear(x, w, bias=bias, scaling=scaling, amax=amax, op_order=op_order,
                                        accumulate=_accumulate(strict)), bad)

    @staticmethod
    def moe(x, w13, w2, topk_weights, topk_ids, *, op_order: str = "vllm", strict: bool = False,
            row_amax=None) -> torch.Tensor:
        x, bad = _split_nonfinite(x, per_token=True)
        return _poison(reference.moe(x, w13, w2, topk_weights, topk_ids, op_order=op_order,
                                     accumulate=_accumulate(strict), row_amax=row_amax), bad)


def _accumulate(strict: bool) -> str:
    """The reference's accumulation: fp64 (an order-free sum, batch-invariant) in strict mode."""
    return "fp64" if strict else "fp32"


def _split_nonfinite(x: torch.Tensor, *, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with non-finite values zeroed, bool [..., 1] rows to return as NaN).

    The spec raises on non-finite input; an engine forward must not: vLLM's start-up profile runs
    feed uninitialized attention outputs. As a GPU kernel would, such rows (per token) or the whole
    output (per tensor) come out NaN, and no host sync is needed to decide it."""
    bad = ~torch.isfinite(x).all(-1, keepdim=True)
    if not per_token:
        bad = bad.any().expand_as(bad)
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), bad


def _poison(out: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return out.masked_fill(bad, float("nan"))


class TritonHopperBackend:
    """Triton kernels for CUDA GPUs of compute capability >= 9.0 (written and measured on Hopper):
    fused per-token quantization, the decode GEMV (`kernels.triton_gemv`), packed W4A4 GEMM for small
    M, exact-BF16 cuBLAS path for large M (`kernels.triton_gemm.linear_path` picks), per-pair and
    grouped MoE. Quantization is bit-identical to the reference; GEMM and MoE differ only by FP32
    summation order. No native FP4 tensor cores used."""

    name = "triton_hopper"
    weight_layout = "modelopt"

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
    def can_implement(req: Requirements) -> tuple[bool, str]:
        ok, reason = _common_checks(req)
        if ok and req.op == "moe" and req.amax_override:
            return False, ("the MoE kernels quantize each SwiGLU row with its own amax; experts split over "
                           "tensor-parallel ranks need the whole row's (an all-reduce between w13 and w2)")
        if ok and req.strict and req.op == "linear":
            return False, "strict linears run on hopper_mma (the batch-invariant cuda_mma kernel at every M)"
        return (ok, reason) if not ok else (True, "the Triton kernels implement every op (amax override included)")

    @staticmethod
    def prepare(device: torch.device, op: str) -> None:
        """For linears and MoE: compile and load the CUDA decode kernels (`cuda_mma.prepare`) once per
        device, so forwards and CUDA-graph captures never compile; without them decode falls back to the
        Triton GEMV (linear) and the grouped Triton GEMM (MoE above the pairs' sizes)."""
        if op in ("linear", "moe"):
            from . import triton_gemm
            triton_gemm._mma_supported(device)

    @staticmethod
    def quantize_weight(w: torch.Tensor, *, recipe: str, amax: torch.Tensor | None = None,
                        op_order: str = "vllm") -> NVFP4Tensor:
        from . import triton_quant
        return triton_quant.quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order)

    @staticmethod
    def quantize_weight_into(w: torch.Tensor, out: NVFP4Tensor, *, amax: torch.Tensor | None = None, share: int = 1,
                             recipe: str, op_order: str = "vllm") -> torch.Tensor:
        from . import triton_quant
        return triton_quant.quantize_weight_into(w, out, recipe=recipe, amax=amax, share=share, op_order=op_order)

    @staticmethod
    def quantize_activations(x: torch.Tensor, *, scaling: str, amax: torch.Tensor | None = None,
                             op_order: str = "vllm") -> NVFP4Tensor:
        from . import triton_quant
        if scaling == "per_tensor":
            return triton_quant.quantize_per_tensor(x, amax=amax, op_order=op_order)
        return triton_quant.quantize_per_token(x, amax=amax, op_order=op_order)

    @staticmethod
    def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, scaling: str,
               amax: torch.Tensor | None = None, op_order: str = "vllm", strict: bool = False) -> torch.Tensor:
        if strict:
            raise ValueError("triton_hopper: strict linears run on hopper_mma (see can_implement)")
        from . import triton_gemm
        return triton_gemm.linear(x, w, bias=bias, scaling=scaling, amax=amax, op_order=op_order)

    @staticmethod
    def moe(x, w13, w2, topk_weights, topk_ids, *, op_order: str = "vllm", strict: bool = False) -> torch.Tensor:
        if strict:
            from . import triton_strict
            return triton_strict.moe(x, w13, w2, topk_weights, topk_ids, op_order=op_order)
        from . import triton_moe
        return triton_moe.moe(x, w13, w2, topk_weights, topk_ids, op_order=op_order)


class HopperMmaBackend(TritonHopperBackend):
    """`TritonHopperBackend` with the dense per-token linears' weights stored in the "mma_tiled" layout
    (`cuda_mma.tile_codes` / `tile_scales`, applied by the layer at every write), so every decode batch (M <= 64, M = 1
    included) runs the tensor-core kernel on its cheaper decode and contiguous weight runs, and larger M
    the exact-BF16 path over `cuda_mma.dequantize`. Needs NVRTC (`cuda_mma.supported`), K % 128 == 0
    and every stacked checkpoint tensor's rows % 16 == 0 (whole 16-row tiles per shard)."""

    name = "hopper_mma"
    weight_layout = "mma_tiled"

    @staticmethod
    def is_supported(device: torch.device) -> tuple[bool, str]:
        ok, reason = TritonHopperBackend.is_supported(device)
        if not ok:
            return ok, reason
        from . import cuda_mma
        return cuda_mma.supported(device)

    @staticmethod
    def can_implement(req: Requirements) -> tuple[bool, str]:
        if req.op == "quantize_activations":
            return True, "the Triton quantizers"
        if req.op != "linear" or req.scaling != "per_token":
            return False, f"implements per-token linears only, got {req.op} with {req.scaling} scaling"
        if req.k is None or req.k % 128 or not req.rows or any(r % 16 for r in req.rows):
            return False, f"needs K % 128 == 0 and 16-row parts, got K={req.k}, rows {req.rows}"
        if req.strict and req.dtype not in (None, torch.bfloat16, torch.float16):
            return False, f"strict runs the tensor-core kernel, which takes bf16/fp16 activations, got {req.dtype}"
        return True, "the tiled tensor-core decode kernel and the exact-BF16 path (strict: the kernel at every M)"

    @staticmethod
    def prepare(device: torch.device, op: str) -> None:
        """For linears: compile and load the CUDA kernels (both layouts, the dequantizer) once per device."""
        if op != "linear":
            return
        from . import cuda_mma
        ok, reason = cuda_mma.prepare(device)
        if not ok:
            raise RuntimeError(f"hopper_mma: {reason}")

    @staticmethod
    def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None, scaling: str,
               amax: torch.Tensor | None = None, op_order: str = "vllm", strict: bool = False) -> torch.Tensor:
        w = w.replace(layout="mma_tiled")                      # the layout this backend's layers store
        if strict:
            from . import triton_strict
            return triton_strict.linear(x, w, bias=bias, amax=amax, op_order=op_order)
        from . import triton_gemm
        return triton_gemm.linear(x, w, bias=bias, scaling=scaling, amax=amax, op_order=op_order)


BACKENDS: dict[str, type] = {"hopper_mma": HopperMmaBackend, "triton_hopper": TritonHopperBackend,
                             "reference": ReferenceBackend}
PRIORITY: list[str] = ["hopper_mma", "triton_hopper", "reference"]   # GPU backends first; the reference always runs


def choose_backend(device: torch.device | str, backend: str = "auto", *, req: Requirements | None = None) -> type:
    """The backend class that runs `req` (default: a per-token linear) on `device`; engines store
    its `.name` on the layer.

    backend="auto" walks PRIORITY; a name forces that backend. Raises ValueError for an unknown
    name and RuntimeError naming every backend's reason if none can run it (or the forced one cannot).
    Call it once per layer, when weights are created or loaded, never in a forward.
    """
    device = torch.device(device)
    req = req or Requirements("linear")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown NVFP4 backend {backend!r}; known: {sorted(BACKENDS)} or 'auto'")
    reasons = []
    # what only the plain-torch reference runs off the CPU, orders of magnitude slower: 'auto' does not pick it
    slow = ("strict (fp64 matmuls in plain torch)" if req.strict else "MoE experts split over tensor-parallel ranks "
            "(plain torch)" if req.op == "moe" and req.amax_override else None)
    for name in ([backend] if backend != "auto" else PRIORITY):
        ok, reason = BACKENDS[name].is_supported(device)
        if ok and slow and backend == "auto" and name == "reference" and device.type != "cpu":
            ok, reason = False, (f"not chosen for {slow} on {device.type} by 'auto', orders of magnitude slower; "
                                 f"force backend 'reference' to run it anyway")
        if ok:
            ok, reason = BACKENDS[name].can_implement(req)
        if ok:
            BACKENDS[name].prepare(device, req.op)
            return BACKENDS[name]
        reasons.append(f"{name}: {reason}")
    what = f"backend {backend!r} cannot run" if backend != "auto" else "no NVFP4 backend can run"
    raise RuntimeError(f"{what} {req.op} (scaling={req.scaling}, amax_override={req.amax_override}, K={req.k}, "
                       f"rows={req.rows}{', strict' if req.strict else ''}) "
                       f"on {device}: " + "; ".join(reasons))


def linear(x: torch.Tensor, w: NVFP4Tensor, *, bias: torch.Tensor | None = None,
           scaling: str = "per_token", amax: torch.Tensor | None = None, op_order: str = "vllm",
           backend: str = "auto", strict: bool = False) -> torch.Tensor:
    """W4A4 linear outside engines (tests, tools). x [..., K] bf16/fp16/fp32; w [N, K] NVFP4
    (global_scale [] or [N]) -> [..., N] x.dtype. backend "auto" probes here; engines call
    `kernels.ops` with the name chosen at load instead.

    amax: optional activation amax override, fp32 [...] per token or [] per tensor (see
    `reference.quantize_activations`); None lets the backend reduce x itself. op_order: the
    activation quantizer's, "vllm" or "te". strict: batch-invariant (`Requirements.strict`).
    """
    req = Requirements("linear", scaling=scaling, amax_override=amax is not None, k=x.shape[-1], dtype=x.dtype,
                       strict=strict)
    return choose_backend(x.device, backend, req=req).linear(x, w, bias=bias, scaling=scaling, amax=amax,
                                                             op_order=op_order, strict=strict)


def moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, *, op_order: str = "vllm", backend: str = "auto", strict: bool = False) -> torch.Tensor:
    """W4A4 SwiGLU MoE outside engines (routing done by the caller); shapes as `reference.moe`.
    strict: batch-invariant (`Requirements.strict`)."""
    req = Requirements("moe", k=x.shape[-1], strict=strict)
    return choose_backend(x.device, backend, req=req).moe(x, w13, w2, topk_weights, topk_ids, op_order=op_order,
                                                          strict=strict)


def quantize_weight_on(w: torch.Tensor, *, recipe: str = "1d", amax: torch.Tensor | None = None,
                       op_order: str = "vllm", backend: str = "auto") -> NVFP4Tensor:
    """quantize_weight on w's device through the chosen backend (bit-identical to the reference).
    A load-time operation (it probes the backend)."""
    return quantizer(w.device, backend).quantize_weight(w, recipe=recipe, amax=amax, op_order=op_order)


def quantize_weight_into(w: torch.Tensor, out: NVFP4Tensor, *, amax: torch.Tensor | None = None, share: int = 1,
                         recipe: str = "1d", op_order: str = "vllm", backend: str = "auto") -> torch.Tensor:
    """quantize_weight of w [N, K] or [E, N, K] written into `out` (contiguous codes uint8, linear block
    scales e4m3 and decode scales fp32 of the result's sizes, e.g. views of a send buffer), with the given
    amax (fp32 [] or [E]) or, without one, max|w| per `share` consecutive experts (their global scales
    alike); returns the amax used ([E / share] or [] when computed). The Triton backend writes there directly
    (the amax reduced first) and neither checks w's values nor syncs the host: NaN/Inf in w show in the
    returned amax, which the caller checks on the device. The reference backend quantizes and copies (one
    host sync; a non-finite amax leaves out unwritten)."""
    return quantizer(w.device, backend).quantize_weight_into(w, out, amax=amax, share=share, recipe=recipe,
                                                             op_order=op_order)


def quantizer(device: torch.device | str, backend: str = "auto") -> type:
    """The backend class whose quantizers (weights and activations) run on `device`: chosen as for
    `quantize_activations`, so a quantizer-only choice (converters, a trainer's sender) compiles no GEMM
    kernels. Call once per device, not per tensor, where tensors are many."""
    return choose_backend(device, backend, req=Requirements("quantize_activations"))
