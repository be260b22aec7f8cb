"""The MoE path's Triton kernels compiled ahead of time for sm_90a on the CPU (no GPU needed): no register
spills, and the exact GEMM (dense and grouped) on the tensor-core instructions it is written for (wgmma) with its
operand loads pipelined (cp.async), as the H200 will compile them for the shapes engines pass (pointer
and size arguments divisible by 16, which Triton specializes at launch)."""
from __future__ import annotations

import re
import subprocess

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], *, sass: bool = False,
             **options) -> tuple[str, str]:
    """(PTX, ptxas -v output) of fn for sm_90a; sass: (PTX, the cubin's SASS)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    names = list(signature)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    log, code = _ptxas(ptx, get_ptxas(90).path, sass=sass)
    return ptx, code if sass else log


def _ptxas(ptx: str, ptxas: str, *, arch: str = "90a", sass: bool = False, function: str | None = None
           ) -> tuple[str, str | None]:
    """(ptxas -v output, the cubin's SASS if asked: of `function` only if given) of PTX for sm_{arch}
    (also tests/test_cuda_mma_sm90.py's, for the CUDA kernel's NVRTC output)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        if not sass:
            return res.stderr, None
        only = ["-fun", function] if function else []
        return res.stderr, subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", *only, f"{d}/k.cubin"],
                                          capture_output=True, text=True, check=True).stdout


def _body_ops(sass: str) -> list[str]:
    """The opcodes of a kernel's SASS up to the first subroutine (the IEEE division's slow path, which
    Triton appends after the body and the body calls only for denormal or huge operands)."""
    lines = re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    calls = [int(t, 16) for t in re.findall(r"CALL\.REL\.NOINC\s+0x([0-9a-f]+)", sass)]
    return [op for addr, op in lines if int(addr, 16) < min(calls, default=1 << 62)]


# SASS instructions a thread issues per element (bf16 rows of K = 4096, the launch's 4 warps), measured
# here with Triton 3.6 and 3.9: per-token codes 22.0 / 21.8, exact rows 20.8 / 20.7, weights 22.0 / 21.3
# (26.6 / 29.1 while each thread loaded and inverted the expert's amax once per row it held and held half
# blocks, whose amax a shuffle completed and whose scales both threads computed; before the E2M1 and E4M3
# roundings without comparisons and float-to-int conversions: 27.5, 36.9, 34.4 with Triton 3.9). An H200
# issues 132 SMs x 4 x 32 lanes' instructions a clock: at copy bandwidth (4.2 TB/s) that is ~20 an element
# for the codes (2.56 bytes moved an element), ~31 for exact rows (4), so the quantizers were issue-bound
# before memory-bound (the last H200 measurement: 50-57% of copy)
_OPS_PER_ELEMENT = {"codes": 22.5, "exact": 21.5, "weight": 23.0}


@pytest.mark.parametrize("kind", ["codes", "exact", "weight"])
def test_quantizers_issue_few_instructions_per_element(kind):
    from nvfp4_sampler.kernels import triton_quant
    if kind == "weight":
        consts = dict(BLOCK_KB=triton_quant.WEIGHT_CONFIG["block_kb"], TWO_D=False, SWIZZLE=False, PERSIST_STAGES=0,
                      TE=False)
        sig = {"w_ptr": "*bf16", "amax_ptr": "*fp32", "stride_amax": "i32", "codes_ptr": "*u8",
               "scales_ptr": "*fp8e4nv", "gs_ptr": "*fp32", "N": "i32", "K": "i32", "n_row_tiles": "i32",
               "n_k_tiles": "i32", "n_tiles": "i32", **{k: "constexpr" for k in consts}}
        fn, divisible, elements = triton_quant._weight_quant_kernel, ("w_ptr", "codes_ptr", "scales_ptr", "N", "K"), \
            16 * 16 * consts["BLOCK_KB"]
    else:
        k = 4096
        consts = dict(ROWS=triton_quant.ACT_CONFIG["elements"] // k, NB_PAD=k // 16, AMAX_MODE=0, SWIZZLE=False,
                      WRITE_CODES=kind == "codes", WRITE_DEQ=kind == "exact", PERSIST_STAGES=0, TE=False, PDL=True,
                      GATHER=False, SWIGLU=False, ACT_BF16=False)
        sig = {"x_ptr": "*bf16", "stride_xm": "i32", "index_ptr": "*i32", "amax_ptr": "*fp32", "codes_ptr": "*u8",
               "scales_ptr": "*fp8e4nv", "gs_ptr": "*fp32", "deq_ptr": "*fp16", "M": "i32", "K": "i32",
               "n_tiles": "i32", **{k: "constexpr" for k in consts}}
        fn, divisible, elements = triton_quant._act_quant_kernel, ("x_ptr", "stride_xm", "codes_ptr", "scales_ptr",
                                                                    "gs_ptr", "deq_ptr", "K"), triton_quant.ACT_CONFIG["elements"]
    warps = triton_quant.ACT_CONFIG["num_warps"] if kind != "weight" else triton_quant.WEIGHT_CONFIG["num_warps"]
    _, sass = _compile(fn, sig, consts, divisible, sass=True, num_warps=warps)
    ops = _body_ops(sass)
    per_element = len(ops) / (elements / (32 * warps))
    # float-to-int conversions run on a quarter-rate pipe: none per element (the weight kernel's three
    # divide its tile index by runtime sizes)
    assert sum(op.startswith("F2I") for op in ops) <= (3 if kind == "weight" else 0), "F2I per element is back"
    assert per_element <= _OPS_PER_ELEMENT[kind], f"{kind}: {per_element:.1f} SASS instructions per element"


@pytest.mark.parametrize("w_codes", [False, True], ids=["fp16-weights", "codes"])
@pytest.mark.parametrize("grouped,swiglu,rows", [(True, True, 64), (True, True, 128), (True, False, 64),
                                                 (True, False, 128), (False, False, 0)],
                         ids=["moe-w13", "moe-w13-tall", "moe-w2", "moe-w2-tall", "dense"])
def test_exact_gemm_uses_wgmma_with_pipelined_loads_and_no_spills(grouped, swiglu, rows, w_codes):
    """The exact GEMM in the forms `triton_moe.exact_config` gives each MoE weight (64-row tiles; 128-row tiles in
    EXACT_FORMS; the 256-row forms: `test_exact_moe_wide_and_candidate_forms_compile_without_spills`) and the dense
    default: wgmma, pipelined loads, no spills."""
    from nvfp4_sampler.kernels import triton_gemm, triton_moe
    if grouped:
        cfg = (dict(triton_moe.exact_form("w13" if swiglu else "w2", rows), W_CODES=w_codes) if rows == 128
               else dict(triton_gemm.EXACT_GROUPED, GROUP_M=4, W_CODES=w_codes))
    else:
        cfg = dict(triton_gemm.EXACT_DENSE, W_CODES=w_codes)
    consts = {k: cfg.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "W_CODES", "SPLIT_K", "INTERLEAVE")}
    consts.update(GROUPED=grouped, SWIGLU=swiglu, HAS_BIAS=not grouped, USE_ASM=True,
                  A_INDEX=swiglu)            # the MoE's w13 reads each pair's token row through an index
    if not w_codes:
        consts["w_scales"] = None
    if not swiglu:
        consts["a_index"] = None
    sig = {"a": "*fp16", "a_gs": "*fp32", "a_index": "*i32", "w": "*u8" if w_codes else "*fp16", "w_scales": "*fp8e4nv",
           "w_gs": "*fp32", "stride_gs_e": "i32", "stride_gs_n": "i32", "bias": "*bf16",
           "out": "*fp32" if grouped and not swiglu else "*bf16", "ws": "*fp32", "counters": "*i32", "sched": "*i32", "Z": "i32", "M": "i32", "N": "i32", "K": "i32",
           **{k: "constexpr" for k in consts}}
    ptx, log = _compile(triton_gemm._exact_gemm_kernel, sig, consts,
                        ("a", "a_gs", "w", "w_gs", "bias", "out", "sched", "N", "K")
                        + ("w_scales",) * w_codes, **cfg)
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async" in ptx                              # the activation tiles (and fp16 weights) pipelined
    assert "0 bytes spill stores" in log, log


def _loop_ops(sass: str) -> list[str]:
    """The opcodes of a kernel's longest loop (from a backward branch's target to the branch)."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass)
             if int(t, 16) < int(a, 16)]
    lo, hi = max(loops, key=lambda b: b[1] - b[0])
    return [op for a, op in ins if lo <= a <= hi]


def test_exact_moe_codes_decode_issues_few_instructions_per_mma():
    """w13's codes form over 128-row tiles (`exact_form`): the K loop issues at most 62 instructions a
    HGMMA (its 4 decoded FP16x2 registers a thread, their scales, the loads and the loop). Measured: 60.2 with
    Triton 3.9, 56.6 with 3.6; the two-table decode before the pair decode 66.9 / 64.6."""
    from nvfp4_sampler.kernels import triton_gemm, triton_moe
    cfg = triton_moe.exact_form("w13", 128)
    consts = {k: cfg.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "W_CODES", "SPLIT_K", "INTERLEAVE")}
    consts.update(GROUPED=True, SWIGLU=True, HAS_BIAS=False, USE_ASM=True, A_INDEX=True, W_CODES=1)
    sig = {"a": "*fp16", "a_gs": "*fp32", "a_index": "*i32", "w": "*u8", "w_scales": "*fp8e4nv", "w_gs": "*fp32",
           "stride_gs_e": "i32", "stride_gs_n": "i32", "bias": "*bf16", "out": "*bf16", "ws": "*fp32",
           "counters": "*i32", "sched": "*i32", "Z": "i32", "M": "i32", "N": "i32", "K": "i32",
           **{k: "constexpr" for k in consts}}
    _, sass = _compile(triton_gemm._exact_gemm_kernel, sig, consts,
                       ("a", "a_gs", "w", "w_scales", "w_gs", "out", "sched", "N", "K"), sass=True, **cfg)
    ops = _loop_ops(sass)
    mmas = sum(op.startswith("HGMMA") for op in ops)
    assert mmas == 2 * consts["BLOCK_K"] // 16                       # gate and up, one a 16-element K step
    assert len(ops) / mmas <= 62, f"{len(ops) / mmas:.1f} instructions a HGMMA"


@pytest.mark.parametrize("name", ["w13 256-row", "w2 256-row", "w13 codes interleaved"])
def test_exact_moe_wide_and_candidate_forms_compile_without_spills(name):
    """The exact MoE's 256-row codes forms (`triton_moe.EXACT_FORMS`; w13's gate and up rows interleaved) and
    bench_kernels' candidate (128-row tiles interleaved): wgmma with the tokens as its N (256 for the 256-row
    tiles), at most four words spilled (Triton 3.6, the device's: none; 3.9: 4 and 16 bytes at 256 rows)."""
    from bench import bench_kernels
    from nvfp4_sampler.kernels import triton_gemm, triton_moe
    weight = name.split()[0]
    swiglu = weight == "w13"
    cfg = (triton_moe.exact_form(weight, 256) if "256" in name
           else dict(triton_moe.exact_form(weight, 128), **bench_kernels.EXACT_CODES_CANDIDATES[name]))
    consts = {k: cfg.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "W_CODES", "SPLIT_K", "INTERLEAVE")}
    consts.update(GROUPED=True, SWIGLU=swiglu, HAS_BIAS=False, USE_ASM=True, A_INDEX=swiglu, W_CODES=1)
    if not swiglu:
        consts["a_index"] = None
    sig = {"a": "*fp16", "a_gs": "*fp32", "a_index": "*i32", "w": "*u8", "w_scales": "*fp8e4nv", "w_gs": "*fp32",
           "stride_gs_e": "i32", "stride_gs_n": "i32", "bias": "*bf16", "out": "*bf16" if swiglu else "*fp32",
           "ws": "*fp32", "counters": "*i32", "sched": "*i32", "Z": "i32", "M": "i32", "N": "i32", "K": "i32",
           **{k: "constexpr" for k in consts}}
    ptx, log = _compile(triton_gemm._exact_gemm_kernel, sig, consts,
                        ("a", "a_gs", "w", "w_scales", "w_gs", "out", "sched", "N", "K"), **cfg)
    assert f"wgmma.mma_async.sync.aligned.m64n{consts['BLOCK_M']}k16" in ptx
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= 16, log


@pytest.mark.parametrize("m", [16, 64])
def test_exact_gemm_on_tiled_codes_uses_wgmma_without_spills(m):
    """The decode-size configuration (`exact_small_config`) on a dense "mma_tiled" weight (W_CODES 2), as
    engines would launch it at M = 16-64: wgmma, no spills (8 warps for the 64-token tile)."""
    from nvfp4_sampler.kernels import triton_gemm
    cfg = dict(triton_gemm.exact_small_config(m, 4096, 4096), W_CODES=2)
    consts = {k: cfg.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "W_CODES", "SPLIT_K", "INTERLEAVE")}
    consts.update(GROUPED=False, SWIGLU=False, HAS_BIAS=True, USE_ASM=True, A_INDEX=False)
    sig = {"a": "*fp16", "a_gs": "*fp32", "a_index": "*i32", "w": "*u8", "w_scales": "*fp8e4nv", "w_gs": "*fp32", "stride_gs_e": "i32",
           "stride_gs_n": "i32", "bias": "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32", "sched": "*i32",
           "Z": "i32", "M": "i32", "N": "i32", "K": "i32", **{k: "constexpr" for k in consts}}
    ptx, log = _compile(triton_gemm._exact_gemm_kernel, sig, consts,
                        ("a", "a_gs", "w", "w_scales", "w_gs", "bias", "out", "sched", "N", "K"), **cfg)
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "0 bytes spill stores" in log, log


@pytest.mark.parametrize("p_pad,e_pad", [(16, 128), (2048, 128), (4096, 256)])
def test_schedule_kernel_compiles_without_spills(p_pad, e_pad):
    from nvfp4_sampler.kernels import triton_moe
    sig = {"ids_ptr": "*i64", "order_ptr": "*i32", "pos_ptr": "*i32", "sched_ptr": "*i32", "P": "i32", "Z": "i32",
           "E": "i32", "P_PAD": "constexpr", "E_PAD": "constexpr", "Z_BLOCK": "constexpr", "BLOCK_M": "constexpr"}
    _, log = _compile(triton_moe._schedule_kernel, sig, dict(P_PAD=p_pad, E_PAD=e_pad, Z_BLOCK=64, BLOCK_M=8),
                      ("ids_ptr", "order_ptr", "pos_ptr", "sched_ptr"), num_warps=8)
    assert "0 bytes spill stores" in log, log
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 255


@pytest.mark.parametrize("weighted", [True, False])
def test_combine_kernel_compiles_without_spills(weighted):
    """`combine` as the grouped paths call it (gathered rows, times router weights or carrying them)."""
    from nvfp4_sampler.kernels import triton_moe
    sig = {"y_ptr": "*fp32", "pos_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16", "H": "i32",
           "K_TOP": "constexpr", "BLOCK_H": "constexpr", "WEIGHTED": "constexpr"}
    _, log = _compile(triton_moe._combine_kernel, sig, dict(K_TOP=8, BLOCK_H=1024, WEIGHTED=weighted),
                      ("y_ptr", "pos_ptr", "w_ptr", "out_ptr", "H"), num_warps=8)
    assert "0 bytes spill stores" in log, log


@pytest.mark.parametrize("swiglu", [True, False], ids=["w13-signals", "w2-waits"])
def test_pairs_gemv_waits_for_the_launch_before_only_after_its_weight_prefetch(swiglu):
    """The per-pair MoE GEMVs as `triton_moe._moe_pairs` launches them with programmatic dependent launch: w13
    lets w2 start (launch_dependents, before any memory access), w2 (each token's pairs combined in the launch)
    issues its weight prefetch, then waits (griddepcontrol.wait) before its first read of the activations and
    before any store or atomic; no spills."""
    from nvfp4_sampler.kernels import triton_gemv, triton_moe
    hidden, inter, pairs = 2048, 768, 8
    n, k = (inter, hidden) if swiglu else (hidden, inter)
    cfg = triton_gemv.gemv_config(1, n * pairs, k, block_b=8, min_programs=triton_moe.PAIRS_MIN_PROGRAMS)
    warps = cfg.pop("num_warps")
    consts = dict(cfg, FUSED=True, GIVEN_AMAX=False, PER_TENSOR=False, PAIRED=True, SWIGLU=swiglu,
                  ROW_WEIGHT=not swiglu, HAS_BIAS=False, USE_ASM=True, TE=False, GDC_SIGNAL=swiglu, GDC_WAIT=not swiglu,
                  COMBINE=not swiglu, amax=None, a_codes64=None, a_scales=None, a_gs=None, bias=None)
    if swiglu:
        consts.update(row_weight=None, combined=None, GROUP=1)
    sig = {"x": "*bf16", "stride_xm": "i32", "amax": "constexpr", "stride_amax": "i32", "a_codes64": "constexpr",
           "a_scales": "constexpr", "a_gs": "constexpr", "stride_a_gs": "i32", "w_codes64": "*i64",
           "w_scales": "*fp8e4nv", "w_gs": "*fp32", "stride_gs_e": "i32", "stride_gs_n": "i32", "W_ROWS": "i32",
           "pair_expert": "*i32", "TOPK": "i32", "out": "*bf16" if swiglu else "*fp32",
           "row_weight": "constexpr" if swiglu else "*fp32", "bias": "constexpr", "ws": "*fp32", "counters": "*i32",
           "combined": "constexpr" if swiglu else "*bf16", "GROUP": "constexpr" if swiglu else "i32",
           "M": "i32", "N": "i32", "K": "i32"}
    sig.update({name: "constexpr" for name in consts if name not in sig})
    ptx, log = _compile(triton_gemv._w4a4_gemv_kernel, sig, consts,
                        ("x", "stride_xm", "w_codes64", "w_scales", "w_gs", "pair_expert", "out", "ws", "counters",
                         "N", "K"), num_warps=warps)
    assert "0 bytes spill stores" in log, log
    body = ptx[ptx.index(".entry"):]
    if swiglu:
        assert "griddepcontrol.launch_dependents" in body and "griddepcontrol.wait" not in body
        first_access = min(body.index(op) for op in ("ld.global", "st.global") if op in body)
        assert body.index("griddepcontrol.launch_dependents") < first_access
    else:
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" not in body
        before, after = body.split("griddepcontrol.wait", 1)
        assert before.count("ld.global") >= 4                    # the weight prefetch: codes and scales, 2 steps
        assert "st.global" not in before and "atom." not in before and "red." not in before
        assert "ld.global" in after                              # the activations
