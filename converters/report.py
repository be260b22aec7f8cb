"""The conversion report: per-tensor errors and the summary of one conversion.

    TensorReport                       errors of one quantized linear weight [N, K]
    ConvertSummary                     counts, bytes, seconds, tracked peak and the TensorReports; `table()`
    quantization_report(name, w, q)    deq(q) vs the float source w [N, K] or [E, N, K]
    te_conversion_report(name, te, q)  the written NVFP4 vs TransformerEngine's storage, bit by bit
"""
from __future__ import annotations

import dataclasses

import torch

from nvfp4_sampler.kernels import cpu_quant, reference
from nvfp4_sampler.kernels.format import BLOCK, NVFP4Tensor

from .sources import TENVFP4Weight


@dataclasses.dataclass(frozen=True)
class TensorReport:
    """Errors of one quantized linear weight [N, K].

    quant_*: dequantized NVFP4 vs the float source (relative Frobenius norm, max abs); None when the
      source holds no float weight (TE / NVFP4 sources).
    conv_*: conversion error for NVFP4 sources (TE, NVFP4Tensor): max |decoded before - decoded
      after| and the number of bits that differ in codes, block scales and global scale; None for
      float sources. Both are 0 by construction; the report proves it per tensor.
    """

    name: str
    shape: tuple[int, ...]
    source: str
    quant_rel_fro: float | None = None
    quant_max_abs: float | None = None
    conv_max_abs: float | None = None
    conv_bits_changed: int | None = None


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did; `table()` renders the worst tensors."""

    tensors_in: int = 0
    tensors_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_tracked_bytes: int = 0
    reports: list[TensorReport] = dataclasses.field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds else 0.0

    def table(self, *, top: int = 10) -> str:
        """The `top` tensors by conversion error, then quantization error, as a text table."""
        def key(r: TensorReport):
            return (r.conv_bits_changed or 0, r.conv_max_abs or 0.0, r.quant_rel_fro or 0.0)
        rows = sorted(self.reports, key=key, reverse=True)[:top]
        fmt = "{:<56} {:>14} {:>5} {:>10} {:>10} {:>10} {:>6}"
        lines = [fmt.format("tensor", "shape", "src", "q_relfro", "q_maxabs", "c_maxabs", "c_bits")]
        for r in rows:
            num = [("-" if v is None else f"{v:.3e}") for v in (r.quant_rel_fro, r.quant_max_abs, r.conv_max_abs)]
            lines.append(fmt.format(r.name[-56:], "x".join(map(str, r.shape)), r.source, *num,
                                    "-" if r.conv_bits_changed is None else r.conv_bits_changed))
        return "\n".join(lines)


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def _popcount_xor(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of differing bits between two tensors of equal shape and byte size."""
    x = a.reshape(-1).contiguous().view(torch.uint8) ^ b.reshape(-1).contiguous().view(torch.uint8)
    return int(_POPCOUNT[x.long()].sum())


def quantization_report(name: str, w: torch.Tensor, q: NVFP4Tensor, err: cpu_quant.QuantizationError | None,
                        *, chunk: int = 1 << 16) -> TensorReport:
    """Relative Frobenius and max abs error of deq(q) against w: `err` when the quantizer gave it,
    else computed over cache-sized row chunks (no whole-tensor fp32 temporaries; sums in fp32
    within a chunk, fp64 across chunks)."""
    if err is None:
        w2, gs = w.reshape(-1, w.shape[-1]), q.row_global_scale().reshape(-1)
        codes, scales = q.codes.reshape(-1, q.codes.shape[-1]), q.block_scales.reshape(-1, q.block_scales.shape[-1])
        err2 = ref2 = emax = torch.zeros((), dtype=torch.float64, device=w.device)
        rows = max(1, chunk // w2.shape[-1])
        for r in range(0, w2.shape[0], rows):
            part = NVFP4Tensor(codes[r:r + rows], scales[r:r + rows], gs[r:r + rows])
            wf = w2[r:r + rows].float()
            diff = reference.dequantize(part).sub_(wf)
            err2 = err2 + diff.square().sum().double()
            ref2 = ref2 + wf.square().sum().double()
            emax = torch.maximum(emax, diff.abs().max())
        err = cpu_quant.QuantizationError(err2, ref2, emax)
    norm, enorm, emax = err.ref_sq.sqrt().item(), err.err_sq.sqrt().item(), err.max_abs.item()
    rel = enorm / norm if norm else float(emax > 0)
    return TensorReport(name, tuple(w.shape), str(w.dtype).removeprefix("torch."), rel, emax)


def te_conversion_report(name: str, te: TENVFP4Weight, q: NVFP4Tensor) -> TensorReport:
    """Compare the written NVFP4 with TE's own storage: codes bitwise, scales bitwise at the
    valid positions of TE's padded (compact or swizzled) buffer, global scale vs TE's amax."""
    m, k = te.shape
    ksf = k // BLOCK
    scales = q.block_scales.cpu()
    stored = te.scale_inv.cpu().view(torch.float8_e4m3fn)
    if te.with_gemm_swizzled_scales:
        valid = reference.swizzle_scales_128x4(torch.ones(m, ksf).to(torch.float8_e4m3fn)).view(torch.uint8) != 0
        scale_bits = _popcount_xor(reference.swizzle_scales_128x4(scales).view(torch.uint8)[valid],
                                   stored.view(torch.uint8)[valid])
        te_scales = reference.unswizzle_scales_128x4(stored, m, ksf)
    else:
        te_scales = stored[:m, :ksf]
        scale_bits = _popcount_xor(scales, te_scales)
    gs = reference.decode_scale_from_amax(te.amax.reshape(()).cpu())
    bits = _popcount_xor(q.codes.cpu(), te.data.cpu()) + scale_bits + _popcount_xor(q.global_scale.cpu(), gs)
    diff = 0.0                   # identical bytes decode identically; decode only when they differ
    if bits:
        before = NVFP4Tensor(te.data.cpu(), te_scales.contiguous(), gs)
        diff = (reference.dequantize(before) - reference.dequantize(q.to("cpu"))).abs().max().item()
    return TensorReport(name, (m, k), "te", conv_max_abs=diff, conv_bits_changed=bits)
