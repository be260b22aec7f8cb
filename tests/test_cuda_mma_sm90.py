"""The CUDA decode kernel (`kernels/cuda/w4a16_mma.cu`) compiled ahead of time for sm_90 / sm_90a on the CPU,
as `cuda_mma._kernel` compiles it on the H200 (`cuda_mma.compile_inputs`), through NVRTC (the test extra's
pip wheel, no GPU) and triton's ptxas and cuobjdump: every variant the host launches compiles without
spills on the instructions it is written for (ptxas would serialize the wgmma variant's MMAs where their
A registers were not safe, and warn)."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import pathlib
import re
import subprocess

import pytest
import torch

from nvfp4_sampler.kernels import cuda_mma
from tests.test_triton_sm90 import _ptxas      # (skips this module where triton is missing, as there)


@functools.lru_cache(maxsize=None)
def _nvrtc():
    spec = importlib.util.find_spec("nvidia")
    libs = [p for root in (spec.submodule_search_locations if spec else [])
            for p in pathlib.Path(root).glob("cu*/lib/libnvrtc.so.*") if "builtins" not in p.name]
    if not libs:
        pytest.skip("NVRTC is not installed (the test extra's nvidia-cuda-nvrtc)")
    return ctypes.CDLL(str(libs[0]))


@functools.lru_cache(maxsize=None)
def _ptxas_cuda13() -> str:
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
    return _ptxas(ptx.value.decode(), _ptxas_cuda13(), arch=arch, sass=True, function="w4a16_mma")


def _main_kernel_info(log: str) -> str:
    """ptxas -v's lines about `w4a16_mma` (not the dequantizer beside it)."""
    part = log[log.index("Compiling entry function 'w4a16_mma'"):]
    return part[:part.index("Used") + 80]


def _resident_warps(log: str, rw: int) -> int:
    """Warps of `rw`-warp CTAs resident per SM by `w4a16_mma`'s registers."""
    regs = int(re.search(r"Used (\d+) registers", _main_kernel_info(log)).group(1))
    return 65536 // (regs * 32 * rw) * rw


# (nt, rw, out dtype, tiled, stages, wgmma, cluster): the variants the host launches
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
VARIANTS = [
    (1, 4, _BF16, False, cuda_mma.STAGES, False, False), (2, 8, _BF16, True, cuda_mma.STAGES, False, False),
    (2, 8, _FP16, False, 8, False, False), (1, 4, _BF16, True, 2, False, False), (4, 8, _BF16, False, cuda_mma.STAGES, False, False),
    (8, 8, _BF16, True, cuda_mma.STAGES, False, False),                       # 64 tokens a CTA (tiled, as engines store)
    (4, 16, _BF16, True, cuda_mma.STAGES, False, False),                      # `throughput_options` on wide weights
    (1, 4, _FP32, False, cuda_mma.STAGES, False, False), (2, 8, _FP32, False, cuda_mma.STAGES, False, False),  # the grouped
    (4, 8, _FP32, False, cuda_mma.STAGES, False, False),                      # MoE's fp32 output (NT 1, 2, 4)
    (1, 4, _BF16, True, cuda_mma.STAGES, True, False), (2, 8, _BF16, True, cuda_mma.STAGES, True, False),  # warpgroup MMAs
    (8, 8, _BF16, True, cuda_mma.STAGES, True, False), (4, 16, _BF16, True, cuda_mma.STAGES, True, False),
    (1, 4, _FP32, False, cuda_mma.STAGES, True, False), (8, 4, _BF16, True, cuda_mma.STAGES, True, True),
    (2, 8, _BF16, True, cuda_mma.STAGES, False, True), (4, 16, _BF16, True, cuda_mma.STAGES, False, True),  # split-K
    (1, 4, _FP32, False, cuda_mma.STAGES, False, True), (2, 8, _BF16, True, cuda_mma.STAGES, True, True),  # through
    (8, 8, _BF16, True, cuda_mma.STAGES, True, True),                                                      # clusters
    (4, 16, _BF16, True, cuda_mma.STAGES, True, True), (4, 16, _FP16, False, cuda_mma.STAGES, True, True)]  # `throughput_options`


@pytest.mark.parametrize("nt,rw,out_dtype,tiled,stages,wgmma,cluster", VARIANTS)
def test_compiles_for_sm90_without_spills(nt, rw, out_dtype, tiled, stages, wgmma, cluster):
    """Every variant compiles without spills, on the MMA it is written for; the decode tiles engines launch
    (`cuda_mma.VARIANTS` on mma.sync) keep >= 12 warps per SM by registers; clusters arrive and wait on the cluster barrier;
    the wgmma variant keeps a word's warpgroup MMAs in flight while the next word decodes (wait until <= 1
    group is pending; every one completed before the accumulators are read; no serialization warning)."""
    log, sass = _compile("90a" if wgmma else "90", nt=nt, rw=rw, out_dtype=out_dtype, tiled=tiled, stages=stages,
                         wgmma=wgmma, cluster=cluster)
    info = _main_kernel_info(log)
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    if not wgmma and (nt, rw) in cuda_mma.VARIANTS:
        assert _resident_warps(log, rw) >= 12, f"{info}: {_resident_warps(log, rw)} warps of {rw}-warp CTAs per SM"
    if cluster:
        assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass
    if wgmma:
        assert "serializ" not in log.lower(), log
        assert sass.count(f"HGMMA.64x{8 * nt}x16.F32") >= 8, "one warpgroup MMA per k16 step"
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
        assert "0x1" in waits and "0x0" in waits, waits
    else:
        assert sass.count("HMMA.16816.F32") >= 8 * nt, "mma.sync m16n8k16 for each k16 step and token tile"


@pytest.mark.parametrize("nt,rw,out_dtype,tiled,wgmma", [(2, 8, _BF16, True, False), (1, 4, _FP32, False, False),
                                                         (2, 8, _BF16, True, True), (4, 16, _BF16, True, True),
                                                         (8, 8, _BF16, True, True)])
def test_pushed_split_k_has_one_cluster_barrier_and_no_release_fence(nt, rw, out_dtype, tiled, wgmma):
    """The pushed split-K (`CLUSTER_PUSH`): no spills and at most 4 registers more than the pulled form; one
    cluster barrier (arrived in the prologue, waited for before the pushes) instead of two, the partial sums
    sent as st.async (STAS) and counted on an mbarrier (SYNCS), and no GPU-scope fence (the pulled form's
    release puts a MEMBAR.GPU before each of its barriers)."""
    variant = dict(nt=nt, rw=rw, out_dtype=out_dtype, tiled=tiled, stages=cuda_mma.STAGES, wgmma=wgmma, cluster=True)
    arch = "90a" if wgmma else "90"
    pull_log, pull = _compile(arch, **variant)
    log, sass = _compile(arch, **variant, push=True)
    info = _main_kernel_info(log)
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    regs = [int(re.search(r"Used (\d+) registers", _main_kernel_info(x)).group(1)) for x in (pull_log, log)]
    assert regs[1] <= regs[0] + 4, regs
    assert pull.count("UCGABAR_ARV") == 2 and sass.count("UCGABAR_ARV") == 1 and sass.count("UCGABAR_WAIT") == 1
    assert sass.count("STAS.128") >= nt and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass and "SYNCS.ARRIVE.TRANS64" in sass
    assert "MEMBAR.ALL.GPU" in pull and "MEMBAR.ALL.GPU" not in sass and "ERRBAR" not in sass


@pytest.mark.parametrize("nt,rw", cuda_mma.VARIANTS)
@pytest.mark.parametrize("cluster", [False, True])
def test_persistent_form_compiles_without_spills_or_fewer_resident_warps(nt, rw, cluster):
    """The persistent form (PERSIST) of the decode tiles engines launch, tiled bf16 and the MoE's fp32: no
    spills, and as many resident warps per SM by registers as the one-tile form (the tile loop keeps no
    epilogue values live through the main loop: `asm volatile("" : "+r"(m0), "+r"(m_end))`). With the L2
    prefetch (PREFETCH, tiled): bulk prefetches (one per slice at the start, persistent: one per next tile
    too), no spills, >= 12 resident warps."""
    for out_dtype, tiled in ((_BF16, True), (_FP32, False)):
        variant = dict(nt=nt, rw=rw, out_dtype=out_dtype, tiled=tiled, stages=cuda_mma.STAGES, cluster=cluster)
        log, sass = _compile("90", **variant, persist=True)
        assert "0 bytes spill stores, 0 bytes spill loads" in _main_kernel_info(log), _main_kernel_info(log)
        assert _resident_warps(log, rw) >= _resident_warps(_compile("90", **variant)[0], rw)
        assert sass.count("HMMA.16816.F32") >= 8 * nt
        assert ("UCGABAR_ARV" in sass) == cluster
        if rw == 16:                                  # `throughput_options`' 16 warps run warpgroup MMAs
            log, sass = _compile("90a", **variant, persist=True, wgmma=True)
            assert "0 bytes spill stores, 0 bytes spill loads" in _main_kernel_info(log), _main_kernel_info(log)
            assert "serializ" not in log.lower(), log
            assert sass.count(f"HGMMA.64x{8 * nt}x16.F32") >= 8
    for persist in (False, True):
        log, sass = _compile("90", nt=nt, rw=rw, out_dtype=_BF16, tiled=True, stages=cuda_mma.STAGES, cluster=cluster,
                             persist=persist, prefetch=True)
        assert "0 bytes spill stores, 0 bytes spill loads" in _main_kernel_info(log), _main_kernel_info(log)
        assert _resident_warps(log, rw) >= 12
        assert len(re.findall(r"\bUBLKPF\.L2\b", sass)) == (4 if persist else 2)      # codes and scales
    if rw % 4 == 0:                                # the wgmma variant persistent: its MMAs still pipelined
        log, sass = _compile("90a", nt=nt, rw=rw, out_dtype=_BF16, tiled=True, stages=cuda_mma.STAGES, wgmma=True,
                             cluster=cluster, persist=True, prefetch=True)
        assert "0 bytes spill stores, 0 bytes spill loads" in _main_kernel_info(log), _main_kernel_info(log)
        assert "serializ" not in log.lower(), log
        assert {"0x0", "0x1"} <= set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))


def _main_loop(sass: str, mark: str) -> list[str]:
    """The opcodes of the innermost loop (a backward branch) whose body holds `mark`, e.g. an MMA."""
    lines = [l for l in sass.split("\n") if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", l).group(1), 16) for l in lines]
    best = None
    for k, line in enumerate(lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addr[k]:
            body = [x for x, a in zip(lines, addr) if int(m.group(1), 16) <= a <= addr[k]]
            if any(mark in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    assert best, f"no loop around {mark}"
    return [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", x).split()[0] for x in best]


@pytest.mark.parametrize("nt,rw", [(1, 4), (2, 8), (4, 16)])
def test_wgmma_main_loop_steps_its_descriptors(nt, rw):
    """The wgmma variant's main loop builds each k16 step's B descriptor by one add to the slice's first
    (`b_desc_step`): at most ~4 uniform instructions a step (8 steps a chunk), not the ~6 of a descriptor
    rebuilt from its address (Nsight by instruction, H100 sixteenth session: 50 a chunk at NT 4 x 16 warps,
    27 now), and about 190-200 instructions a chunk in all (217 before)."""
    _, sass = _compile("90a", nt=nt, rw=rw, out_dtype=_BF16, tiled=True, stages=cuda_mma.STAGES, wgmma=True,
                       cluster=nt > 1)
    ops = _main_loop(sass, "HGMMA")
    uniform = sum(op.startswith("U") for op in ops)
    assert uniform <= 32, (uniform, len(ops))
    assert len(ops) <= 200, len(ops)


@pytest.mark.parametrize("nt,rw,wgmma,persist", [(1, 4, False, False), (2, 8, False, False), (2, 8, True, False),
                                                 (4, 8, False, True), (4, 16, True, True), (4, 16, True, False)])
def test_activation_codes_form_compiles_without_spills(nt, rw, wgmma, persist):
    """X_CODES (the activation's codes and block scales, decoded as the CTA stages them): no spills, at most 12
    registers more than the exact-rows form of the same launch (measured: -28 to +9), and the epilogue's
    power of two is 2^28 (0x4d800000) instead of 2^14 (0x46800000)."""
    variant = dict(nt=nt, rw=rw, out_dtype=_BF16, tiled=True, stages=cuda_mma.STAGES, wgmma=wgmma, cluster=True,
                   persist=persist, push=not persist)
    arch = "90a" if wgmma else "90"
    rows_log, rows = _compile(arch, **variant)
    log, sass = _compile(arch, **variant, x_codes=True)
    assert "0 bytes spill stores, 0 bytes spill loads" in _main_kernel_info(log), _main_kernel_info(log)
    regs = [int(re.search(r"Used (\d+) registers", _main_kernel_info(x)).group(1)) for x in (rows_log, log)]
    assert regs[1] <= regs[0] + 12, regs
    assert "0x4d800000" in sass and "0x4d800000" not in rows and "0x46800000" in rows
