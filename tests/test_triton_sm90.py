"""The MoE path's Triton kernels compiled ahead of time for sm_90a on the CPU (no GPU needed): no register
spills, and the exact GEMM (dense and grouped) on the tensor-core instructions it is written for (wgmma) with its
operand loads pipelined (cp.async), as the H200 will compile them for the shapes engines pass (pointer
and size arguments divisible by 16, which Triton specializes at launch)."""
from __future__ import annotations

import re
import subprocess

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], **options) -> tuple[str, str]:
    """(PTX, ptxas -v output) of fn for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    names = list(signature)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    return ptx, _ptxas(ptx, get_ptxas(90).path)


def _ptxas(ptx: str, ptxas: str) -> str:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], capture_output=True,
                             text=True)
    assert res.returncode == 0, res.stderr
    return res.stderr


@pytest.mark.parametrize("w_codes", [False, True], ids=["fp16-weights", "codes"])
@pytest.mark.parametrize("grouped,swiglu", [(True, True), (True, False), (False, False)],
                         ids=["moe-w13", "moe-w2", "dense"])
def test_exact_gemm_uses_wgmma_with_pipelined_loads_and_no_spills(grouped, swiglu, w_codes):
    from nvfp4_sampler.kernels import triton_gemm
    cfg = dict(triton_gemm.EXACT_GROUPED if grouped else triton_gemm.EXACT_DENSE, W_CODES=w_codes)
    consts = {k: cfg.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "W_CODES", "SPLIT_K")}
    consts.update(GROUPED=grouped, SWIGLU=swiglu, HAS_BIAS=not grouped, USE_ASM=True)
    if not w_codes:
        consts["w_scales"] = None
    sig = {"a": "*fp16", "a_gs": "*fp32", "w": "*u8" if w_codes else "*fp16", "w_scales": "*fp8e4nv",
           "w_gs": "*fp32", "stride_gs_e": "i32", "stride_gs_n": "i32", "bias": "*bf16",
           "out": "*fp32" if grouped and not swiglu else "*bf16", "ws": "*fp32", "counters": "*i32", "sched": "*i32", "Z": "i32", "M": "i32", "N": "i32", "K": "i32",
           **{k: "constexpr" for k in consts}}
    ptx, log = _compile(triton_gemm._exact_gemm_kernel, sig, consts,
                        ("a", "a_gs", "w", "w_gs", "bias", "out", "sched", "N", "K")
                        + ("w_scales",) * w_codes, **cfg)
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async" in ptx                              # the activation tiles (and fp16 weights) pipelined
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
