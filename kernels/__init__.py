"""nvfp4-sampler kernels: the NVFP4 per-token format, its executable spec and GPU backends.

Imports torch only; triton is imported lazily by the GPU backends. Importing it registers the
custom ops `torch.ops.nvfp4_sampler.*` (`kernels.ops`).
"""
from . import dispatch, ops
from .format import BLOCK, E2M1_MAX, E4M3_MAX, GLOBAL_ENCODE_NUMERATOR, NVFP4Tensor
from .reference import (decode_scale_from_amax, dequantize, encode_scale_from_amax, nvfp4_gemm,
                        quantize_activations, quantize_per_tensor, quantize_per_token, quantize_weight,
                        swizzle_scales_128x4, unswizzle_scales_128x4)

__all__ = [
    "dispatch", "ops", "BLOCK", "E2M1_MAX", "E4M3_MAX", "GLOBAL_ENCODE_NUMERATOR", "NVFP4Tensor",
    "decode_scale_from_amax", "dequantize", "encode_scale_from_amax", "nvfp4_gemm",
    "quantize_activations", "quantize_per_tensor", "quantize_per_token", "quantize_weight",
    "swizzle_scales_128x4", "unswizzle_scales_128x4",
]
