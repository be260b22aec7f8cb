"""bench/bench_vllm_e2e.py's kernel categories (the per-step profile breakdown), on kernel names seen in
vLLM 0.26 / torch 2.11 / triton 3.6 profiles; the benchmark itself runs on the H200."""
from __future__ import annotations

import pytest

from bench import bench_vllm_e2e as e2e

_GLUE = "MoE routing glue (ours: schedule, combine; vLLM: gating, align, sum)"


@pytest.mark.parametrize("kernel,category", [
    ("w4a16_mma", "nvfp4 GEMMs (linears, MoE experts)"),
    ("_w4a4_gemv_kernel", "nvfp4 GEMVs (Triton: the MoE's per-pair decode)"),
    ("_exact_gemm_kernel", "nvfp4 GEMMs (linears, MoE experts)"),      # not cuBLAS's "gemm": first match wins
    ("w4_dequant", "nvfp4 GEMMs (linears, MoE experts)"),
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


def test_trace_timeline_splits_idle_into_launch_gaps_and_host_waits(tmp_path):
    """Busy spans of all streams merged (a PDL overlap is no gap); gaps under GAP_SPLIT_US are launch gaps,
    longer ones waits for the host; CPU events do not count."""
    import gzip
    import json
    kernel = lambda name, ts, dur, tid=7: {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}
    events = [kernel("_act_quant_kernel", 0, 3), kernel("w4a16_mma", 2, 20, tid=8),   # overlapping (PDL)
              kernel("w4a16_mma", 24, 10),                                            # 2 us launch gap
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 134, "dur": 1},      # 100 us host wait
              {"cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 50},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 4},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30, "dur": 90},
              {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 125, "dur": 5}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    us, line, where = e2e.trace_device(e2e.load_trace(path))
    assert us == {"_act_quant_kernel": 3.0, "w4a16_mma": 30.0, "Memcpy DtoD": 1.0}
    assert line == {"kernels": 4.0, "busy_us": 33.0, "idle_short_us": 2.0, "short_gaps": 1.0, "idle_long_us": 100.0,
                    "graph_launches": 1.0, "kernel_launches": 1.0, "cpu_ops": 1.0}
    assert where == {"host_calls": {"cudaGraphLaunch": 4.0, "cudaStreamSynchronize": 90.0, "cuLaunchKernelEx": 5.0},
                     "gaps_before": {"Memcpy DtoD": 100.0}}


def test_decode_steps_are_the_intervals_between_forwards():
    """A prefill forward then three decode forwards (each starts with the embedding kernel): two whole decode
    steps, the prefill's interval dropped; medians of their period, busy time, kernels and categories."""
    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    emb = "triton_red_fused__to_copy_embedding_rms_norm_0"
    trace = [kernel(emb, 0, 5), kernel("w4a16_mma", 5, 400),                              # prefill
             kernel(emb, 1000, 2), kernel("_act_quant_kernel", 1002, 3), kernel("w4a16_mma", 1005, 50),
             kernel(emb, 1100, 2), kernel("_act_quant_kernel", 1102, 3), kernel("w4a16_mma", 1104, 60),
             kernel("w4a16_mma", 1150, 20),                                                # overlaps: busy once
             kernel("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", 1180, 1),   # not a forward's start
             kernel(emb, 1300, 2), kernel("w4a16_mma", 1302, 40),                          # the last forward
             {"cat": "cpu_op", "name": "aten::embedding", "ts": 1200, "dur": 5}]           # host: no marker
    steps = e2e.decode_steps(trace)
    assert steps["steps"] == 2 and steps["period_us_range"] == [100.0, 200.0]
    assert steps["period_us"] == 150.0                             # median of 100 and 200
    assert steps["busy_us"] == (55.0 + 71.0) / 2                   # 1000..1055; 1100..1170 (overlaps once), 1180..1181
    assert steps["kernels"] == 4.0                                 # 3 and 5
    assert steps["gpu_us"]["nvfp4 GEMMs (linears, MoE experts)"] == (50.0 + 80.0) / 2
    assert steps["gpu_us"]["nvfp4 activation quantization"] == 3.0
    assert e2e.decode_steps(trace[:5]) == {}                       # two forwards: no whole decode step


def test_jit_compiles_by_phase():
    """Kernel compilations vLLM's JIT monitor logs while serving, counted in the worker's phase (lines as
    vLLM 0.26 writes them, H100 twenty-second session)."""
    warn = ("(EngineCore pid=1886) WARNING 12-06 19:28:5{} [jit_monitor.py:135] Triton kernel JIT compilation during "
            "inference: {}. This causes a latency spike; consider extending warmup to cover this shape/config.")
    log = "\n".join([warn.format(1, "kernel_unified_attention"), f"{e2e.PHASE} batch 1 warm-up",
                     warn.format(2, "_act_quant_kernel"), warn.format(6, "_schedule_kernel"),
                     f"{e2e.PHASE} batch 1 timed", "INFO other line", f"{e2e.PHASE} batch 16 warm-up",
                     f"{e2e.PHASE} batch 16 timed", warn.format(7, "_exact_gemm_kernel")])
    assert e2e.jit_compiles(log) == {"start": ["kernel_unified_attention"],
                                     "batch 1 warm-up": ["_act_quant_kernel", "_schedule_kernel"],
                                     "batch 16 timed": ["_exact_gemm_kernel"]}
    assert e2e.jit_compiles("INFO nothing compiled") == {}
    warmed = "(EngineCore pid=7) INFO 12-06 [core.py:1] nvfp4_sampler: m.experts: kernels warmed at 38 token counts in 12.5 s"
    assert [float(x) for x in e2e.WARM_UP_LINE.findall(warmed + "\n" + warmed.replace("12.5", "0.5"))] == [12.5, 0.5]
