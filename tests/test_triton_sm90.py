"""The MoE path's Triton kernels compiled ahead of time for sm_90a on the CPU (no GPU needed): no register
spills, and the grouped exact GEMM on the tensor-core instructions it is written for (wgmma) with its
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


def test_grouped_exact_gemm_uses_wgmma_with_pipelined_loads_and_no_spills():
    from nvfp4_sampler.kernels import triton_moe
    cfg = dict(triton_moe.EXACT_BLOCK)
    sig = {"a": "*fp16", "a_gs": "*fp32", "w": "*fp16", "w_gs": "*fp32", "stride_gs_e": "i32", "stride_gs_n": "i32",
           "out": "*fp32", "sched": "*i32", "Z": "i32", "N": "i32", "K": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    ptx, log = _compile(triton_moe._grouped_exact_kernel, sig, {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")},
                        ("a", "a_gs", "w", "w_gs", "out", "sched", "N", "K"),
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async" in ptx
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
