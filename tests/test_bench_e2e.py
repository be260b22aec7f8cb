"""bench/bench_vllm_e2e.py's kernel categories (the per-step profile breakdown), on kernel names seen in
vLLM 0.26 / torch 2.11 / triton 3.6 profiles; the benchmark itself runs on the H200."""
from __future__ import annotations

import pytest

from bench import bench_vllm_e2e as e2e

_GLUE = "MoE routing glue (ours: schedule, combine; vLLM: gating, align, sum)"


@pytest.mark.parametrize("kernel,category", [
    ("w4a16_mma", "nvfp4 GEMMs (linears, MoE experts)"),
    ("_w4a4_gemv_kernel", "nvfp4 GEMMs (linears, MoE experts)"),
    ("_act_quant_kernel", "nvfp4 activation quantization"),
    ("kernel_unified_attention_2d", "attention"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "bf16 gemm (cuBLAS / lm_head / router)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "bf16 gemm (cuBLAS / lm_head / router)"),
    ("matmul_kernel_persistent", "bf16 gemm (cuBLAS / lm_head / router)"),          # VLLM_BATCH_INVARIANT=1
    ("_rms_norm_kernel", "norms, rotary, activations, elementwise (compiled)"),
    ("void at::native::radixSortKVInPlace<...>", "sort, top-k, softmax (sampling, MoE routing)"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms, rotary, activations, elementwise (compiled)"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "norms, rotary, activations, elementwise (compiled)"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("fused_moe_kernel", "bf16 gemm (cuBLAS / lm_head / router)"),
    ("void vllm::moe::topkGating<8, 128, 4, 16, 32, int, __nv_bfloat16, (vllm::moe::Sc", _GLUE),
    ("void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*, int*, int*, i", _GLUE),
    ("_schedule_kernel", _GLUE),
    ("_combine_kernel", _GLUE),
])
def test_kernel_categories(kernel, category):
    assert e2e._category(kernel) == category
