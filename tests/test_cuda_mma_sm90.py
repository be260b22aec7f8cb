"""The CUDA decode kernel (`kernels/cuda/w4a16_mma.cu`) compiled ahead of time for sm_90 on the CPU: the
variants `cuda_mma.prepare` loads on the H200 and the wgmma ones, through NVRTC (the pip wheel, no GPU)
and triton's ptxas: they compile, spill nothing, and the wgmma variant keeps one word's warpgroup MMAs in
flight while the next word decodes (ptxas would serialize them where the A registers were not safe)."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import pathlib
import re
import subprocess
import tempfile

import pytest
import torch

from nvfp4_sampler.kernels import cuda_mma

triton = pytest.importorskip("triton")


@functools.lru_cache(maxsize=None)
def _nvrtc():
    spec = importlib.util.find_spec("nvidia")
    libs = [p for root in (spec.submodule_search_locations if spec else [])
            for p in pathlib.Path(root).glob("cu*/lib/libnvrtc.so.*") if "builtins" not in p.name]
    if not libs:
        pytest.skip("NVRTC is not installed (the test extra's nvidia-cuda-nvrtc)")
    return ctypes.CDLL(str(libs[0]))


@functools.lru_cache(maxsize=None)
def _ptxas() -> str:
    """Triton's bundled ptxas of CUDA >= 13, the NVRTC wheel's PTX version."""
    bin_dir = pathlib.Path(importlib.util.find_spec("triton.backends.nvidia").submodule_search_locations[0]) / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        exe = bin_dir / name
        if exe.exists() and re.search(r"cuda_1[3-9]\.", subprocess.run([exe, "--version"], capture_output=True,
                                                                        text=True).stdout):
            return str(exe)
    pytest.skip(f"no ptxas of CUDA >= 13 in {bin_dir}")


def _compile(arch: str, **variant) -> tuple[str, str]:
    """(ptxas -v output, SASS) of `w4a16_mma` for sm_{arch}, compiled as `cuda_mma._kernel` compiles it."""
    source, options = cuda_mma.compile_inputs(**variant)
    lib, prog = _nvrtc(), ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"w4a16_mma.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture=compute_{arch}", *options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    with tempfile.TemporaryDirectory() as d:
        pathlib.Path(f"{d}/k.ptx").write_bytes(ptx.value)
        res = subprocess.run([_ptxas(), f"-arch=sm_{arch}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", "-fun", "w4a16_mma", f"{d}/k.cubin"],
                              capture_output=True, text=True, check=True).stdout
    return res.stderr, sass


def _main_kernel_info(log: str) -> str:
    """ptxas -v's lines about `w4a16_mma` (not the dequantizer beside it)."""
    part = log[log.index("Compiling entry function 'w4a16_mma'"):]
    return part[:part.index("Used") + 80]


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("nt,rw", cuda_mma.VARIANTS)
def test_mma_sync_variants_compile_without_spills(nt, rw, cluster):
    log, sass = _compile("90", nt=nt, rw=rw, out_dtype=torch.bfloat16, tiled=True, stages=cuda_mma.STAGES,
                         cluster=cluster)
    info = _main_kernel_info(log)
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    assert sass.count("HMMA.16816.F32") >= 8 * nt, "mma.sync m16n8k16 expected for each k16 step and token tile"


@pytest.mark.parametrize("nt,rw", [(1, 4), (2, 8), (4, 8), (4, 16), (8, 4), (8, 8)])
def test_wgmma_variant_overlaps_decode_with_the_mmas(nt, rw):
    """Each word's two warpgroup MMAs stay in flight (wait until <= 1 group is pending) while the next word
    decodes; every MMA completes before the accumulators are read; no spills, no serialization warning."""
    log, sass = _compile("90a", nt=nt, rw=rw, out_dtype=torch.bfloat16, tiled=True, stages=cuda_mma.STAGES,
                         wgmma=True, cluster=True)
    info = _main_kernel_info(log)
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    assert "serializ" not in log.lower(), log
    assert sass.count(f"HGMMA.64x{8 * nt}x16.F32") >= 8, "one warpgroup MMA per k16 step"
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert "0x1" in waits and "0x0" in waits, waits
