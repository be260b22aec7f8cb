"""bench/bench_kernels.py's tables on records of the shapes the H200 run writes, candidates that could not
run (NaN) included: a formatting error there would cost a device run its printed tables."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")

from bench import bench_kernels as bk  # noqa: E402 - after the importorskip

LINEAR_DECODE = dict(kind="linear", shape="8B gate_up", m=16, n=24576, k=4096, cublas_ms=0.0494, mma_ms=0.0312,
                     gemv_ms=0.141, packed_ms=0.0753, bf16_ms=0.09, auto_path="mma", ours_ms=0.0312,
                     speedup_vs_cublas=1.58, weight_gbps=1800.0, weight_frac_copy=0.42, mma_kernel_ms=0.0303,
                     mma_tiled_kernel_ms=0.0301, mma_tiled_linear_ms=0.0322, wgmma_tiled_kernel_ms=0.0221,
                     cluster_tiled_kernel_ms=0.0262, push_tiled_kernel_ms=0.0251, global_tiled_kernel_ms=0.0301,
                     codes_tiled_kernel_ms=0.0281, rows_tiled_linear_ms=0.0302,
                     act_quant_ms=0.0023, mma_stages_cps_ms={"3,8": 0.0301},
                     small_rw_cps_ms={"mma 8,8": 0.0301, "wgmma 16,16": math.nan}, persist_stages_ms={2: 0.0290, 8: math.nan},
                     prefetch_ms={"one-tile": 0.0295, "persistent": 0.0280},
                     persist_nt_rw_ms={"mma 4,8,8": 0.030, "wgmma 8,16,8": math.nan},
                     same_bits={"cluster": True, "global": True, "persist s2": False, "persist s8": None},
                     exact_codes_kernel_ms={"64x128 s4 w4 split 1": 0.025, "128x128 s3 w8 split 1": math.nan})
LINEAR_WIDE = dict(kind="linear", shape="8B gate_up", m=4096, n=24576, k=4096, cublas_ms=1.2, bf16_ms=1.45,
                   exact_ms=1.3, exact_codes_ms=math.nan, auto_path="bf16", ours_ms=1.45, speedup_vs_cublas=0.83,
                   weight_gbps=39.0, weight_frac_copy=0.01, best_exact_speedup_vs_cublas=0.92,
                   exact_tiles_ms={"128x256 s3 w8": 1.21, "256x128 s3 w8 codes": math.nan},
                   bf16_blocks_ms={"8 MiB": 1.3, "32 MiB": math.nan})
ACT = dict(kind="act_quant", m=16384, k=4096, bytes=1, ours_ms=0.0713, tuned_ms=0.07, copy_same_bytes_ms=0.04,
           ref_ms=None, gbps=2413.0, frac_peak_copy=0.569, tuned_frac_peak_copy=0.57, frac_same_size_copy=0.587,
           exact_ms=0.06, exact_frac_peak_copy=0.88)
MOE = dict(kind="moe", tokens=64, ours_ms=0.3077, path="mma", pairs_ms=0.6216, grouped_ms=0.4601, mma_ms=0.3077,
           exact_ms=0.52, bf16_grouped_ms=0.4947, speedup_vs_bf16_grouped=1.61, vllm_bf16_ms=0.4, speedup_vs_vllm_bf16=1.3, mma_wgmma_ms={"NT 1": 0.21},
           mma_cluster_ms={"NT 1": 0.25}, mma_global_ms={"NT 1": 0.27}, mma_push_ms={"NT 1": 0.24},
           mma_cps_ms={4: 0.3077, 8: 0.29, 16: math.nan}, exact_codes_ms={"16-row": 0.4},
           kernels_us={"pairs": {"_w4a4_gemv_kernel": 25.5, "_combine_kernel": 2.25}})


def test_tables_print_every_column_and_candidate():
    lines: list[str] = []
    bk.print_tables([ACT, LINEAR_DECODE, LINEAR_WIDE, MOE], "test device", print=lambda *a: lines.append(" ".join(map(str, a))))
    text = "\n".join(lines)
    assert " 16384   4096     71.30   2413      56.9   57.0          58.7        -     60.00      88.0" in text
    assert ("wgmma variant alone 22.1 us, split-K pulled through clusters 26.2 us, pushed to their owners 25.1 us, through "
            "global planes 30.1 us vs the default 30.1") in text
    assert "64 tokens, mma, split-K through clusters: NT 1: 250.0 us" in text
    moe = next(x for x in lines if x.strip().startswith("64 ") and " mma " in x)
    assert moe.split()[-4:] == ["494.7", "1.61x", "400.0", "1.30x"], moe       # BF16 grouped, then vLLM's BF16 MoE
    assert "64 tokens, mma, split-K through global planes: NT 1: 270.0 us" in text
    assert "64 tokens, mma, split-K pushed to the owners: NT 1: 240.0 us" in text
    assert "64x128 s4 w4 split 1: 25.0, 128x128 s3 w8 split 1: nan us" in text
    assert "128x256 s3 w8: 1210.0, 256x128 s3 w8 codes: nan us" in text
    assert ("bf16 8B gate_up    M=4096: the path by column blocks of its FP32 product (one block 1450.0 us, cuBLAS "
            "1200.0) 8 MiB: 1300.0 (0.92x), 32 MiB: nan (nanx) us") in text
    wide = next(x for x in lines if x.strip().startswith("8B gate_up") and " 4096 " in x)
    assert "1450.0   1300.0    nan" in wide                        # bf16, exact, codes columns
    assert "tiled by stages,cps 3,8: 30.1; tiled by rw,cps mma 8,8: 30.1, wgmma 16,16: nan" in text
    assert "64 tokens, mma, warpgroup-MMA variant: NT 1: 210.0 us" in text
    assert "64 tokens, mma by split-K slice (chunks): 4: 307.7, 8: 290.0, 16: nan us" in text
    assert "64 tokens, exact, codes decoded in the GEMM, by expert tile: 16-row: 400.0 us" in text
    assert "64 tokens, pairs by kernel (profiler, eager): _w4a4_gemv_kernel: 25.5, _combine_kernel: 2.2 us" in text
    forms = next(x for x in lines if x.strip().startswith("8B gate_up") and "M=16: default" in x)
    assert "on exact rows (X_CODES=0): linear 30.2 us (1.64x cuBLAS); activation codes: kernel 28.1 us" in text
    assert ("default 30.1, *wgmma 22.1, push 25.1, pulled 26.2, codes 28.1, persist s2 29.0, persist s8 nan, prefetch 29.5, persist+prefetch 28.0, "
            "persist mma 4,8,8 30.0, persist wgmma 8,16,8 nan  (2.24x cuBLAS, 1.36x the default)") in forms
    assert lines[lines.index(forms) + 1].strip() == "bits of the default: DIFFER in persist s2 (3 forms checked)"


def test_a_failing_candidate_is_nan_not_an_error(capsys):
    """(Here it fails before the candidate runs: no CUDA stream on the CPU; on the GPU in the candidate.)"""
    assert math.isnan(bk.tried_ms(lambda: 1 / 0))
    assert "candidate failed:" in capsys.readouterr().out
