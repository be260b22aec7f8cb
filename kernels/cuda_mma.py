"""Small-M exact W4A4 linear on FP16 tensor cores (CUDA C++ `cuda/w4a16_mma.cu`, compiled by NVRTC).

The decode path of the Triton backend for M <= MMA_MAX_M: weights stay in the ModelOpt layout (no
repacking), the activation is quantized per token into exact FP16 values plus an FP32 S_dec per
token (`triton_quant.quantize_per_token_exact`), and one launch multiplies them with the weight as
the MMA's register operand (the .cu file's header says how). Results differ from
`reference.nvfp4_gemm` only by the order of the FP32 additions; that order depends on (N, K) alone,
so every token's output is bitwise the same at any M and in any batch (batch-invariant). The same
launch runs grouped (MoE): a tile schedule assigns each CTA's rows to one expert of a stacked weight
(`launch(..., schedule=)`, `triton_moe.moe(path="mma")`), with an fp32 output for the SwiGLU.

Compilation: NVRTC through torch (`torch.cuda._utils`, torch >= 2.8 built with CUDA); PTX is cached on
disk under $NVFP4_SAMPLER_CACHE (default ~/.cache/nvfp4_sampler) keyed by source, options and device,
so only the first process on a machine pays the compile (a few seconds per variant).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import math
import os
import pathlib

import torch

from . import switches
from .format import NVFP4Tensor

MMA_MAX_M = 64            # the default path's upper end (`triton_gemm.linear_path`); any M runs, in token tiles.
                          # At M = 32-64 it beat the packed path on an 8B layer's four GEMMs by 9-11% (H200)
MMA_MIN_M = 2             # the default path's lower end: at M = 1 the Triton GEMV measured faster on the H200
CHUNK = 128               # K elements per chunk (one 16-byte load per row and thread)
_CPS_ROWS = 64            # rows per CTA assumed when choosing the split-K slice (so that it depends on N, K only)
_MAX_CPS = 16             # the largest slice a launch may take (dynamic shared memory: 128 KiB at 32 tokens)
# (tokens per CTA tile, 16-row warp tiles per CTA) by M: wider CTAs at more tokens, so that the
# activation slice each CTA stages in shared memory is read by more weight rows (at 16 tokens and 4
# warps its L2 reads equalled the weight's); (nt, rw) never change the summation order
TILES = ((8, 1, 4), (16, 2, 8), (None, 4, 8))
# The default (not batch-invariant) path above M = 16 (`throughput_options`): the first of THROUGHPUT_TILES'
# (RW, CPS) whose launch has at least THROUGHPUT_MIN_CTAS CTAs, 16 warps on warpgroup MMAs. On the H200
# (2026-12-05, eleventh session, persistent launches, 8B shapes at M = 32 and 64) it picks the fastest form at
# 7 of 8 points and is within 3% at the eighth (qkv M = 32: 15.9 vs 15.4 us); the fifth session's NT x RW x CPS
# sweep (mma.sync, 1.7B and 8B shapes) agrees at all 9 of its points. Fewer CTAs leave SMs idle; more run
# shorter slices or narrower CTAs that stage the same activations more often (8B o at M = 64: 15.8 us with
# 128 CTAs, 24.9 with 256; 8B down at M = 64: 38.2 with 16 warps on wgmma, 50.5 with 8 on mma.sync)
THROUGHPUT_MIN_M = 17
# The default path at M = SMALL_MIN_M-16 (`TILES`' second row, 8 warps): about SMALL_SLICES split-K slices
# (at most _MAX_CPS chunks each) where that is longer than `config`'s slice and the launch still has
# SMALL_MIN_CTAS CTAs (one wave of a 132-SM H100 / H200), else `config`'s. H100 (tenth, twelfth and thirteenth
# sessions, kernel alone on tiled weights at M = 16, us with 4 / 8 / 16 chunks a slice): 8B qkv 15.2 / 11.7 /
# 12.6 (it takes 8), o 10.7 / 11.2 / 12.1 (8 would leave 128 CTAs: `config`'s 4), gate_up 39.7 / 33.7 / 36.7
# (`config`'s 8), down 29.1 / 21.6 / 18.5 against `config`'s 12: 20.2 (it takes 16); at M = 1 the slices tie
# (qkv 9.7 / 9.8), so M <= 8 keeps `config`'s. The 1.7B and 30B-A3B attention shapes keep `config`'s.
# SMALL_SLICES_BY_DEVICE: slice counts tried in turn (the first that is longer than `config`'s and keeps
# SMALL_MIN_CTAS) on devices whose name holds the key. H200 (fourteenth session, the same measurement, us with
# 4 / 8 / 16 chunks a slice): 8B gate_up 37.3 / 31.6 / 28.3, qkv 14.5 / 11.5 / 12.0 (16 would leave 96 CTAs),
# o 10.5 / 11.0 / 11.8, down - / 20.2 / 18.2: two slices where they keep a wave (gate_up, down), else four,
# the fastest of the three on all four shapes (on the 1.7B shapes it changes gate_up: 8 chunks, not 4)
SMALL_MIN_M = 9
SMALL_SLICES = 4
SMALL_SLICES_BY_DEVICE = {"H200": (2, 4)}
SMALL_MIN_CTAS = 132
THROUGHPUT_TILES = ((16, 16), (8, 16), (8, 8))   # (RW, CPS), fewest CTAs first
THROUGHPUT_MIN_CTAS = 96                         # about 3/4 of an H200's 132 SMs
STAGES = 3                # chunks in each warp's cp.async ring: on the H200 3 beat 4 and 6 at M = 16-64, and
                          # registers in flight (56 -> 128 registers) at M = 16-64; they tied at M <= 4
_SLOT_BYTES = 1152        # one chunk of a warp's ring: 16 rows x (64 code bytes + 8 scale bytes)
_SMEM_LIMIT = 227 * 1024 - 64   # dynamic shared memory a CTA may take on sm_90 (beside its static 16 bytes)
# Where `tile_weight` puts each code of a 32-bit word (sign bit, lowest magnitude bit) for the low half's
# elements e0..e3 (e4..e7: the same + 16): e3 at the bits of its FP16 pair, e2 three bits lower, e1 and e0
# with sign and magnitude 5 and 7 bits apart (the .cu file's `pairs` decodes them)
_TILED_BITS = ((13, 0), (14, 3), (12, 6), (15, 9))
_SOURCE = pathlib.Path(__file__).with_name("cuda") / "w4a16_mma.cu"
_MIN_CTAS = 1024          # about 8 CTAs per SM of an H200 before the split-K slice is halved


# The MMA every launch uses unless told: "mma" (mma.sync) or "wgmma" (the warpgroup-MMA variant, sm_90a)
WGMMA = switches.choice("NVFP4_SAMPLER_MMA", ("mma", "wgmma")) == "wgmma"
# Split-K through thread-block clusters (the .cu file's CLUSTER: partial sums added through distributed
# shared memory, no FP32 planes in global memory, the same bits) for launches of S <= CLUSTER_MAX_S
# slices, or through global FP32 planes. H200 (2026-12-05, kernel alone, tiled weights, us global / cluster):
# 8B down M = 1 17.7 / 14.2, M = 16 28.3 / 19.7; the four 8B linears summed: M = 1 59.5 / 52.9, M = 16
# 83.6 / 75.5, M = 32 124.4 / 113.1, M = 64 194.5 / 194.5
# "push" (the default; dense launches of one tile a CTA, rw >= S, where its landing space fits): each warp
# pushes its partial sums into the owner CTA's shared memory (st.async on the owner's mbarrier) instead of
# every CTA pulling them behind two cluster barriers (the .cu file's CLUSTER_PUSH; the same bits); "cluster"
# pulls them. H100 (2026-12-06, bench_decode_8b, kernel alone on tiled weights, us pulled / pushed) 8B qkv, o,
# gate_up, down at M = 16: 11.6 / 10.9, 10.7 / 9.4, 30.8 / 29.1, 17.9 / 17.1; at M = 1 ties to 4% faster
_SPLIT_K = switches.choice("NVFP4_SAMPLER_SPLIT_K", ("push", "cluster", "global"))
CLUSTER, PUSH = _SPLIT_K != "global", _SPLIT_K == "push"
CLUSTER_MAX_S = 8         # the portable cluster size
# Dense linears hand the kernel the activation's 4-bit codes and block scales (`triton_quant.quantize_per_token`)
# instead of its exact FP16 rows (the .cu file's X_CODES): each CTA stages 3.5x fewer bytes from L2 (at M = 16
# the 8B gate_up launch's CTAs read 12.7 MB of activations against 56.6 MB of weights) and decodes them as it
# stages. The same bits. The default ("1"; "0": the rows): H100 (2026-12-06, bench_decode_8b, linear = quantizer +
# kernel, us rows / codes) 8B qkv, o, gate_up, down at M = 16: 13.2 / 12.2, 11.6 / 11.4, 32.1 / 30.3, 21.0 / 19.5;
# faster or tied at all 16 points of M = 1, 16, 32, 64
X_CODES = switches.choice("NVFP4_SAMPLER_X_CODES", ("1", "0")) == "1"
# Persistent CTAs (the .cu file's PERSIST; mma.sync or wgmma): about one wave of CTAs, each computing every
# gridDim.x-th row tile with its activations staged once and its weight rings streaming across tiles (the
# fourth session's Nsight run found each one-tile CTA's life one round trip, with no steady state). The same
# bits as one tile per CTA. The default for dense launches of PERSIST_MIN_M tokens or more: H100 (2026-12-05,
# bench_decode_8b, kernel alone on tiled weights, us one tile / persistent at the default tiles) 8B qkv, o,
# gate_up, down at M = 64: 29.1 / 25.1, 23.7 / 24.9, 79.3 / 57.0, 66.4 / 52.5 (summed 198.5 / 159.5); at
# M = 1 and 16 no gain (summed 59.3 / 60.5, 79.7 / 81.5). Only where the one-tile launch is more than one wave
# of resident CTAs: with less, each persistent CTA gets one tile and the one-tile form (with the pushed split-K)
# was as fast or faster: H100 (2026-12-06, the same bench, us persistent / one tile pushed) M = 32 qkv 17.0 /
# 15.2, o 15.6 / 14.3, down 22.4 / 19.7 (one wave each), gate_up 34.9 / 38.6 (more than one); M = 64 qkv 19.2 /
# 18.9, o 16.5 / 15.1 (one wave), gate_up 48.1 / 60.0 (more). NVFP4_SAMPLER_PERSIST: "auto" (that), "1" every
# launch (the MoE's grouped ones too), "0" none
_PERSIST = switches.choice("NVFP4_SAMPLER_PERSIST", ("auto", "0", "1"))
PERSIST = _PERSIST == "1"
PERSIST_MIN_M = 17
# L2 prefetch of each warp's slice (the .cu file's PREFETCH, tiled weights): the later chunks' DRAM round trips
# overlap the first ones'; the same bits; off: slower at 23 of 24 points of the H100 run above (8B shapes at
# M = 1, 16, 64, one tile a CTA +1% to +13%, persistent +7% to +24%; faster only at qkv M = 16 one tile, -8.5%)
PREFETCH = switches.choice("NVFP4_SAMPLER_PREFETCH", ("0", "1")) == "1"
# Programmatic dependent launch: the decode kernel's CTAs start (and load weights) while the activation
# quantizer before it still runs; its griddepcontrol.wait orders the activation reads after the quantizer's
# writes, so an ordinary launch (the wait then a no-op) gives the same bits. NVFP4_SAMPLER_PDL: "auto" (the
# default) programmatic at M <= PDL_MAX_M tokens only, "1" every launch, "0" none. In vLLM (H100, thirteenth
# session, qwen3-8b x 36 compiled, one run, medians of 5) launches without it decoded 1.14x / 1.11x the
# tokens/s at batch 16 / 64 for the same GPU time in the GEMMs (2898 vs 2907, 4607 vs 4682 us a step), and
# 0.96x at batch 1 (268 vs 279 tokens/s, spreads of 5 apart); as one CUDA graph of the 8B linears x 36 layers
# (`bench/bench_graph_launch.py`) programmatic launches cost the host's cudaGraphLaunch 254 vs 153 us
# (M = 16) and 220 vs 163 (M = 64) for the GPU's 3362 vs 3310 and 5017 vs 5224 us. Since then PDL at every
# size beat the default at batch 16 in three runs of four (1.09x H200, 1.04x and 1.22x H100) and lost at 64 in
# all four: NVFP4_SAMPLER_PDL_MAX_M (the e2e bench's --pdl engine: 16) moves the "auto" bound to measure it
PDL = switches.choice("NVFP4_SAMPLER_PDL", ("auto", "0", "1"))
PDL_MAX_M = switches.count("NVFP4_SAMPLER_PDL_MAX_M", 1, MMA_MAX_M)


def pdl_default(m: int, mode: str | None = None) -> bool:
    """Whether a launch of m tokens is a programmatic dependent of the quantizer before it (mode:
    NVFP4_SAMPLER_PDL's value; None: `PDL`, read at each launch so that a benchmark can set it)."""
    mode = PDL if mode is None else mode
    return mode == "1" or (mode == "auto" and m <= PDL_MAX_M)


def persist_default(m: int | float, grouped: bool, mode: str = _PERSIST, waves: float = math.inf) -> bool:
    """Whether a launch of m tokens (grouped: a MoE launch over expert tiles) takes persistent CTAs when
    `launch` is not told (mode: NVFP4_SAMPLER_PERSIST's value; waves: its one-tile CTAs over those resident at
    once, unknown: inf)."""
    return mode == "1" or (mode == "auto" and not grouped and m >= PERSIST_MIN_M and waves > 1)


def supported(device: torch.device) -> tuple[bool, str]:
    """Can this kernel run on `device` at all (load-time probe)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "needs a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"needs compute capability >= 8.9 (cvt.e4m3x2), got {cap[0]}.{cap[1]}"
    try:
        from torch.cuda import _utils
        _utils._get_gpu_rtc_library()
    except Exception as e:  # noqa: BLE001 - any failure to find NVRTC means "not supported", with its reason
        return False, f"NVRTC unavailable through torch: {e}"
    return True, f"NVRTC, compute capability {cap[0]}.{cap[1]}"


def prepare(device: torch.device) -> tuple[bool, str]:
    """Load-time set-up on `device`: the probe, every kernel variant a forward may launch compiled and
    loaded (dense: bf16/fp16 out, both layouts; grouped MoE: fp32 out, ModelOpt; with CLUSTER both
    split-K forms, since S = 1 or S > CLUSTER_MAX_S keep the planes, and with PUSH the pushed and pulled
    one-tile forms; one tile a CTA and the persistent forms `persist_default` may choose), the split-K
    tickets allocated, so
    that no forward (and no CUDA-graph capture) compiles or allocates them. (ok, reason)."""
    ok, reason = supported(device)
    if not ok:
        return ok, reason
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        for cluster in sorted({False, CLUSTER}):
            for nt, rw in VARIANTS:           # one tile a CTA (also where a persistent form does not fit), and
                # the persistent form where `persist_default` gives it to the most tokens these tiles serve;
                # `throughput_options`' 16 warps on warpgroup MMAs where the device has them
                most = next(top for top, t, _ in TILES if t == nt) or math.inf
                wgmma = WGMMA or throughput_wgmma(rw, has_wgmma(device))
                for persist in sorted({False, persist_default(most, False)}):
                    # one tile a CTA through a cluster: pushed, and pulled where S > rw or the landing space
                    # does not fit (a slice of `config`'s CPS decides, which this loop does not know)
                    for push in sorted({False, PUSH and cluster and not persist}):
                        for out_dtype, tiled in itertools.product((torch.bfloat16, torch.float16), (False, True)):
                            _kernel(nt, rw, out_dtype, tiled, STAGES, index, wgmma, cluster, persist,
                                    PREFETCH and tiled, push, X_CODES)
            for nt in (GROUPED_NT, GROUPED_NT_WIDE):
                for persist in sorted({False, PERSIST}):
                    _kernel(*tiles(8 * nt, nt=nt), torch.float32, False, STAGES, index, WGMMA, cluster, persist)
    except Exception as e:  # noqa: BLE001 - a failed compile means this path is unavailable, with its reason
        return False, f"NVRTC compilation failed: {e}"
    tickets(index)
    return True, reason


def throughput_options(m: int, n: int, k: int, *, warpgroup: bool = False,
                       slices: tuple[int, ...] = (SMALL_SLICES,)) -> dict:
    """`launch` overrides (rw, cps, wgmma) for M tokens on an [N, K] weight where batch invariance is not
    asked for: none below SMALL_MIN_M (`config` and `tiles`); to THROUGHPUT_MIN_M - 1 the split-K slice of
    the first count of `slices` (the device's: `small_slices`) whose slice is longer than `config`'s and
    keeps SMALL_MIN_CTAS CTAs; above, the first of THROUGHPUT_TILES whose launch has THROUGHPUT_MIN_CTAS CTAs
    (else the last), 16 warps as warpgroup MMAs where the device has them (warpgroup: `has_wgmma`). The
    split-K slice then depends on M, so a row's bits may differ between M < SMALL_MIN_M and larger batches
    (strict mode takes `config`'s at every M)."""
    if m < SMALL_MIN_M:
        return {}
    chunks, (nt, rw) = k // CHUNK, tiles(m)

    def ctas(rw: int, cps: int) -> int:        # CTAs of a launch of rw warps and cps-chunk slices
        return -(-n // (16 * rw)) * -(-chunks // cps) * -(-m // (8 * nt))

    if m < THROUGHPUT_MIN_M:
        for cps in (min(_MAX_CPS, -(-chunks // s)) for s in slices):
            if cps > config(n, k)["CPS"] and ctas(rw, cps) >= SMALL_MIN_CTAS:
                return dict(cps=cps)
        return {}
    for rw, cps in THROUGHPUT_TILES:
        cps = min(cps, chunks)
        if ctas(rw, cps) >= THROUGHPUT_MIN_CTAS:
            break
    return dict(rw=rw, cps=cps) | ({"wgmma": True} if throughput_wgmma(rw, warpgroup) else {})


def throughput_wgmma(rw: int, warpgroup: bool) -> bool:
    """Whether `throughput_options`' launch of rw warps runs warpgroup MMAs (16 warps, where the device has
    them: warpgroup); `prepare` compiles the same."""
    return warpgroup and rw == 16


@functools.lru_cache(maxsize=None)
def small_slices(device: torch.device) -> tuple[int, ...]:
    """`throughput_options`' slice counts at 9-16 tokens on `device`: SMALL_SLICES_BY_DEVICE's by its name,
    else (SMALL_SLICES,)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for key, v in SMALL_SLICES_BY_DEVICE.items() if key in name), (SMALL_SLICES,))


@functools.lru_cache(maxsize=None)
def has_wgmma(device: torch.device) -> bool:
    """Whether `device` runs the warpgroup-MMA variant (sm_90a: Hopper only)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


GROUPED_NT = 1            # token tiles of 8 per expert tile of the grouped (MoE) launch, `triton_moe._moe_tiled`:
                          # decode batches give an expert a few rows
GROUPED_NT_WIDE = 2       # ... from `triton_moe.MMA_WIDE_PAIRS` pairs on (H200, 30B-A3B, us NT 1 / 2: 128 tokens
                          # 276 / 237, 256 tokens 466 / 336)
GROUPED_CPS = 8           # the grouped launch's split-K slice, every batch size alike (the summation order: strict
                          # mode's batch invariance): H200, 30B-A3B, 16-256 tokens, us with 4 / 8 / 16 chunks: 16
                          # tokens 137 / 123 / 127, 64: 202 / 179 / 181, 256: 464 / 399 / 395
VARIANTS = sorted({(nt, rw) for _, nt, rw in TILES} | {(TILES[-1][1], 16)})   # (NT, RW) that `prepare` compiles


def shape_ok(n: int, k: int) -> bool:
    """The kernel's shape contract: N a multiple of 16, K of 128."""
    return n % 16 == 0 and k % CHUNK == 0 and k > 0


def config(n: int, k: int, *, cps: int | None = None, cluster: bool | None = None) -> dict:
    """Launch constants from the weight shape alone (never M: the reduction order must not depend
    on the batch): CPS chunks of 128 per split-K slice, S slices, CLUSTER: whether the slices add up
    through a thread-block cluster. CPS is 8 where that still gives _MIN_CTAS CTAs of _CPS_ROWS rows,
    else 4: on the H200 more, shorter slices ran faster with the global planes (bench_kernels, M = 1
    and 16: 8B gate_up best at 8, 8B down and o best at 4); cluster: at least chunks / CLUSTER_MAX_S
    (K = 12288: 12), so that the slices fit a cluster (a summation order of its own for such shapes).
    cps: an override (benchmarks; 1.._MAX_CPS), which changes the summation order; cluster: None for
    `CLUSTER` (what `launch` does by default)."""
    cluster = CLUSTER if cluster is None else cluster
    chunks = k // CHUNK
    if cps is None:
        cps = min(chunks, 8 if -(-n // _CPS_ROWS) * -(-chunks // 8) >= _MIN_CTAS else 4)
        if cluster:
            cps = max(cps, min(_MAX_CPS, -(-chunks // CLUSTER_MAX_S)))
    elif not 1 <= cps <= _MAX_CPS:
        raise ValueError(f"cps must be in [1, {_MAX_CPS}], got {cps}")
    slices = -(-chunks // cps)
    return dict(CPS=cps, S=slices, CLUSTER=cluster and 1 < slices <= CLUSTER_MAX_S)


def tiles(m: int, *, rw: int | None = None, nt: int | None = None) -> tuple[int, int]:
    """(NT token tiles of 8 per CTA, RW warps of 16 rows per CTA) for M tokens (`TILES`); rw, nt:
    overrides (benchmarks; rw 1..16, nt 1..8). Neither changes what a token's output is."""
    default_nt, default_rw = next((t, r) for top, t, r in TILES if top is None or m <= top)
    nt, rw = default_nt if nt is None else nt, default_rw if rw is None else rw
    if not 1 <= rw <= 16:
        raise ValueError(f"rw must be in [1, 16], got {rw}")
    if not 1 <= nt <= 8:
        raise ValueError(f"nt must be in [1, 8], got {nt}")
    return nt, rw


def _tile_order(n: int, k: int, unit: int, *, inverse: bool = False) -> tuple[list[int], list[int]]:
    """(shape, permutation) taking a row-major [N, K * unit / 128] byte array (unit bytes per thread
    and chunk: 16 for codes, 2 for scales) to the tiled order [N/16][K/128][half][g][t][unit] (inverse:
    the tiled array back)."""
    shape, perm = [n // 16, 2, 8, k // CHUNK, 4, unit], [0, 3, 1, 2, 4, 5]
    if inverse:
        shape, perm = [shape[i] for i in perm], [perm.index(i) for i in range(len(perm))]
    return shape, perm


@functools.cache
def _half_word_table(inverse: bool, device: torch.device) -> torch.Tensor:
    """int16 [65536]: every 16-bit half of a 32-bit word of codes (four E2M1 codes, element i at bits
    4i..4i+3 in ModelOpt) re-encoded to `_TILED_BITS` (inverse: back). The halves of a word move alone."""
    v = torch.arange(1 << 16, dtype=torch.int32)
    out = torch.zeros_like(v)
    for i, (sign, mag) in enumerate(_TILED_BITS):
        src, dst = ((4 * i + 3, 4 * i), (sign, mag))[::-1 if inverse else 1]
        out |= ((v >> src[0]) & 1) << dst[0] | ((v >> src[1]) & 7) << dst[1]
    return torch.where(out >= 1 << 15, out - (1 << 16), out).to(torch.int16).to(device)


def _encode_words(codes: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Codes uint8 [..., 4j] (a strided view whose last dimension is contiguous is read in place) with
    every 32-bit word's eight E2M1 codes moved from ModelOpt's nibbles (element i at bits 4i..4i+3) to
    `_TILED_BITS` (inverse: back): one table lookup per 16-bit half; a new contiguous tensor."""
    halves = codes.view(torch.int16).to(torch.int32, memory_format=torch.contiguous_format) & 0xFFFF
    return _half_word_table(inverse, codes.device)[halves].view(torch.uint8)


def _check_rows(t: torch.Tensor, per: int, what: str) -> int:
    r, k = t.shape[0], t.shape[-1] * per
    if t.dim() != 2 or not shape_ok(r, k):
        raise ValueError(f"{what} needs [R, K/{per}] with R % 16 == 0 and K % {CHUNK} == 0, got {tuple(t.shape)}")
    return k


def tile_codes(codes: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Codes uint8 [R, K/2] of R rows of a weight, ModelOpt -> "mma_tiled" (inverse: back); a new
    tensor of the same shape. R % 16 == 0, K % 128 == 0. Rows [r0, r1) of a tiled [N, K] weight (r0, r1
    multiples of 16) are the tiled form of those rows alone, in the same byte range: shards of a fused
    layer are written and read by rows."""
    k = _check_rows(codes, 2, "tile_codes")
    shape, perm = _tile_order(codes.shape[0], k, 16, inverse=inverse)
    # the permutation moves whole 16-byte runs and the encoding acts inside 16-bit halves: one pass does both
    return _encode_words(codes.reshape(shape).permute(perm), inverse=inverse).reshape(codes.shape)


def tile_scales(scales: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Block scales [R, K/16] (e4m3 or a uint8 view) of R rows, ModelOpt -> "mma_tiled" order (inverse:
    back), as `tile_codes`."""
    k = _check_rows(scales, 16, "tile_scales")
    shape, perm = _tile_order(scales.shape[0], k, 2, inverse=inverse)
    return scales.view(torch.uint8).reshape(shape).permute(perm).contiguous().reshape(scales.shape).view(scales.dtype)


def tile_weight(w: NVFP4Tensor) -> NVFP4Tensor:
    """w [N, K] (ModelOpt) in the "mma_tiled" layout (`tile_codes`, `tile_scales`: each warp of the
    kernel reads contiguous 512-byte runs; each 32-bit word of codes re-encoded for the cheaper decode,
    `_TILED_BITS`); a tiled w back to ModelOpt. Any device."""
    inverse = w.layout == "mma_tiled"
    return w.replace(codes=tile_codes(w.codes, inverse=inverse), block_scales=tile_scales(w.block_scales, inverse=inverse),
                     layout="modelopt" if inverse else "mma_tiled")


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("NVFP4_SAMPLER_CACHE", pathlib.Path.home() / ".cache" / "nvfp4_sampler"))


def _wgmma_source(nt: int) -> str:
    """CUDA for NT token tiles (the .cu file's WGMMA variant): `wgmma_k32`, the two k16 steps of a word of
    codes, each one warpgroup MMA m64n{8 NT}k16 (A: a[0..3], a[4..7] from registers; B: the shared-memory
    descriptors b0, b1), left in flight: it returns once the previous word's MMAs completed, so the decode
    of the next word overlaps this one's MMAs (ptxas keeps the A registers of the group in flight; it
    warns where it has to serialize instead); `wgmma_drain`, every MMA completed (before acc is read)."""
    n = 4 * nt
    acc = ", ".join(f"%{i}" for i in range(n))

    def mma(first_a: int, desc: int) -> str:
        regs = ", ".join(f"%{first_a + i}" for i in range(4))
        return f'"wgmma.mma_async.sync.aligned.m64n{8 * nt}k16.f32.f16.f16 {{{acc}}}, {{{regs}}}, %{desc}, p, 1, 1, 0;\\n"'

    outs = ", ".join(f'"+f"(acc[{j}][{v}])' for j in range(nt) for v in range(4))
    ins = ", ".join(f'"r"(a[{i}])' for i in range(8))
    return ("__device__ __forceinline__ void wgmma_k32(float (&acc)[NT][4], const unsigned (&a)[8],\n"
            "                                          unsigned long long b0, unsigned long long b1) {\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 10}, 0;\\nwgmma.fence.sync.aligned;\\n"\n'
            f"               {mma(n, n + 8)}\n               {mma(n + 4, n + 9)}\n"
            '               "wgmma.commit_group.sync.aligned;\\nwgmma.wait_group.sync.aligned 1;\\n}"\n'
            f'               : {outs}\n               : {ins}, "l"(b0), "l"(b1), "r"(1)\n'
            '               : "memory");\n}\n'
            "__device__ __forceinline__ void wgmma_drain(float (&acc)[NT][4]) {\n"
            f'  asm volatile("wgmma.wait_group.sync.aligned 0;" : {outs} : : "memory");\n}}\n')


def compile_inputs(nt: int, rw: int, out_dtype: torch.dtype, tiled: bool, stages: int, wgmma: bool = False,
                   cluster: bool = False, persist: bool = False, prefetch: bool = False,
                   push: bool = False, x_codes: bool = False) -> tuple[str, list[str]]:
    """(CUDA source, NVRTC options) of a kernel variant, as `_kernel` compiles it (and the CPU compile
    check, tests/test_cuda_mma_sm90.py); the architecture is the device's (sm_90a with wgmma)."""
    defines = [f"-DNT={nt}", f"-DRW={rw}", f"-DOUT_BF16={int(out_dtype == torch.bfloat16)}",
               f"-DOUT_F32={int(out_dtype == torch.float32)}", f"-DTILED={int(tiled)}", f"-DSTAGES={stages}",
               f"-DWGMMA={int(wgmma)}", f"-DCLUSTER={int(cluster)}", f"-DPERSIST={int(persist)}",
               f"-DPREFETCH={int(prefetch)}", f"-DCLUSTER_PUSH={int(push)}", f"-DX_CODES={int(x_codes)}"]
    return (_wgmma_source(nt) if wgmma else "") + _SOURCE.read_text(), ["-std=c++17", *defines]


@functools.lru_cache(maxsize=None)
def _kernel(nt: int, rw: int, out_dtype: torch.dtype, tiled: bool, stages: int, device_index: int,
            wgmma: bool = False, cluster: bool = False, persist: bool = False, prefetch: bool = False,
            push: bool = False, x_codes: bool = False):
    """The compiled kernel for these constants on this device (PTX cached on disk), allowed the
    dynamic shared memory of the largest slice (or the device's limit); out_dtype: bf16, fp16 or fp32;
    wgmma: the warpgroup-MMA variant (sm_90a, `_wgmma_source`); cluster: split-K through clusters;
    persist: persistent CTAs (`PERSIST`); prefetch: L2 prefetch of the slices (`PREFETCH`, tiled only); push:
    the cluster's split-K pushed to its owners (`CLUSTER_PUSH`, with cluster, one tile a CTA); x_codes: the
    activation as codes and block scales (`X_CODES`, dense)."""
    from torch.cuda import _utils
    cap = "".join(map(str, torch.cuda.get_device_capability(device_index))) + ("a" if wgmma else "")
    source, options = compile_inputs(nt, rw, out_dtype, tiled, stages, wgmma, cluster, persist, prefetch, push,
                                     x_codes)
    key = hashlib.sha256("\0".join([source, cap, torch.version.cuda or "", *options]).encode()).hexdigest()[:24]
    path = _cache_dir() / f"w4a16_mma-{key}.ptx"
    if path.exists():
        ptx = path.read_bytes()
    else:
        ptx, _ = _utils._nvrtc_compile(source, "w4a16_mma", cap, nvcc_options=options)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(ptx)
        tmp.replace(path)
    names = ["w4a16_mma", "w4_dequant"] if tiled else ["w4a16_mma"]
    with torch.cuda.device(device_index):
        kernels = _utils._cuda_load_module(ptx, names)
        smem = _smem_bytes(nt, _MAX_CPS, rw, stages, rw if persist and cluster else 2 * rw if push else 0)
        kernels["w4a16_mma"].set_shared_memory_config(min(smem, _SMEM_LIMIT))
    return kernels


def _smem_bytes(nt: int, cps: int, rw: int, stages: int, red_slots: int = 0) -> int:
    """Dynamic shared memory of a CTA: its activation slice, fp16 [nt * 8, cps * 128], then each warp's
    ring of `stages` chunks, then `red_slots` slots of split-K partial sums, fp32 [nt][4][32] each (the
    persistent cluster form's: rw; the pushed form's landing space: ceil(rw / S) * S; the pulled one-tile
    form reuses the activations' space)."""
    return nt * 8 * cps * CHUNK * 2 + rw * stages * _SLOT_BYTES + red_slots * nt * 512


def launch_form(cfg: dict, nt: int, rw: int, stages: int, persist: bool | None, push: bool | None, m: int,
                grouped: bool, ctas: int, resident) -> tuple[bool, bool, int]:
    """(persist, push, dynamic shared memory bytes) of a launch of `config` cfg, these tiles and ring depth for
    m tokens (grouped: a MoE launch) over `ctas` one-tile CTAs (row tiles x S x token tiles). persist / push
    None: the defaults' speed choices (`persist_default`, over resident(push, smem): the one-tile form's CTAs
    resident at once, `_resident_ctas`; `PUSH` on dense launches), each dropped where its shared memory does not
    fit; the push applies to one tile a CTA through a cluster with rw >= S > 1 only. Raises where the form
    asked for does not fit."""
    cluster, slices, cps = cfg["CLUSTER"], cfg["S"], cfg["CPS"]

    def smem(persist: bool, push: bool) -> int:
        if persist:                                  # with the split-K partial sums' slots through a cluster
            return _smem_bytes(nt, cps, rw, stages, rw if cluster else 0)
        if push:                                     # with the landing space of the pushed partial sums
            return _smem_bytes(nt, cps, rw, stages, -(-rw // slices) * slices)
        # one tile a CTA: the pulled partial sums reuse the space, [rw][nt][4][32] fp32
        return max(_smem_bytes(nt, cps, rw, stages), rw * nt * 512 if cluster else 0)

    def pushed(persist: bool) -> bool:
        if not (cluster and not persist and rw >= slices > 1):
            return False
        return PUSH and not grouped and smem(False, True) <= _SMEM_LIMIT if push is None else push

    if persist is None:
        persist = persist_default(m, grouped) and smem(True, False) <= _SMEM_LIMIT
        if persist:                                  # over more than a wave of the one-tile form only
            one = pushed(False)
            persist = persist_default(m, grouped, waves=ctas / resident(one, smem(False, one)))
    push = pushed(persist)
    need = smem(persist, push)
    if need > _SMEM_LIMIT:
        raise ValueError(f"{need} B of shared memory for nt={nt}, cps={cps}, rw={rw}, stages={stages}"
                         + (" (persistent: with the split-K partial sums' space)" if persist and cluster else "")
                         + (" (with the pushed partial sums' landing space)" if push else ""))
    return persist, push, need


@functools.lru_cache(maxsize=None)
def _resident_ctas(kernel, threads: int, smem: int, device_index: int, cluster: int = 1) -> int:
    """CTAs of `kernel` (threads and dynamic shared memory each; `cluster` CTAs along y a cluster) resident on
    the whole device at once, as the driver computes it: clusters that fit at once times their CTAs, or
    CTAs per SM times the SMs."""
    from torch.cuda import _utils
    lib, n = _utils._get_gpu_runtime_library(), ctypes.c_int()
    if cluster > 1:
        cfg, _attrs = _launch_config((1, cluster, 1), threads, smem, None, pdl=False, cluster=cluster)
        _utils._check_cuda(lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), kernel.func, ctypes.byref(cfg)))
        return max(1, n.value) * cluster
    _utils._check_cuda(lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), kernel.func, ctypes.c_int(threads), ctypes.c_size_t(smem)))
    return max(1, n.value) * torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_ctas(row_tiles: int, others: int, resident: int) -> int:
    """gridDim.x of a persistent launch: row tiles spread evenly over the fewest waves of `resident` CTAs
    (`others` = gridDim.y * gridDim.z CTAs per row position), at most one CTA per row tile."""
    waves = -(-row_tiles * others // resident)
    return -(-row_tiles // waves)


_TICKETS: dict[int, torch.Tensor] = {}


def tickets(device_index: int, *, allocate: bool = True) -> torch.Tensor | None:
    """Zeroed int32 split-K tickets [1 << 20], shared by every split-K launch on the device (these kernels'
    and the Triton kernels' `triton_gemv._workspace`; each launch leaves them 0), allocated by `prepare` at
    load time so that CUDA graphs capture a buffer that outlives them. Launches must not overlap on two
    streams (engines run a forward on one stream). allocate=False: None where not yet allocated."""
    if device_index not in _TICKETS and allocate:
        _TICKETS[device_index] = torch.zeros(1 << 20, dtype=torch.int32, device=torch.device("cuda", device_index))
    return _TICKETS.get(device_index)


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4                         # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (value: x, y, z)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6         # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def launch(x: torch.Tensor, x_gs: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, *,
           bias: torch.Tensor | None = None, schedule: torch.Tensor | None = None, cps: int | None = None,
           rw: int | None = None, nt: int | None = None, stages: int = STAGES, wgmma: bool | None = None,
           cluster: bool | None = None, persist: bool | None = None, persist_ctas: int | None = None,
           prefetch: bool | None = None, push: bool | None = None,
           x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = ((x @ deq_unscaled(w).T) * x_gs[:, None]) * S_dec_w[None, :] (+ bias), rounded once.

    x     fp16 [M, K] contiguous: exact e2m1(q) * s values of the per-token quantized activation; or
          (dense, with x_scales) its codes, uint8 [M, K/2] ModelOpt, and x_scales its e4m3 block scales
          [M, K/16] (`triton_quant.quantize_per_token`; the same bits, 3.5x fewer bytes staged)
    x_gs  fp32 [M]: the activation's S_dec per token
    w     NVFP4 [N, K] (codes contiguous; global_scale [] or [N]; layout "modelopt" or "mma_tiled");
          N % 16 == 0, K % 128 == 0. Grouped: stacked experts [E, N, K] (global_scale [E] or [E, N])
    out   bf16 or fp16 [M, N] contiguous, bias: [N] in out's dtype or None; or fp32 (no bias)
    schedule  grouped (MoE) rows: int32 [3, Z] contiguous, the expert, first row and end row (exclusive,
          the expert's last) of each tile of 8 * nt rows, as `triton_moe.moe_schedule(ids, E, 8 * nt)` gives
          them (rows of x and out in that schedule's order; empty ranges are skipped); nt must be given
    cps   override of `config`'s chunks per split (benchmarks); rw, nt: of `tiles`' warps and token
          tiles per CTA; stages: of the weight pipeline's depth (2..8; none but cps changes the result)
    wgmma the warpgroup-MMA variant (sm_90a; rw % 4 == 0): one wgmma per k16 step and 4 warps instead of
          nt mma.sync per warp; None: `WGMMA` (NVFP4_SAMPLER_MMA, default off: measured no faster at M <= 16)
    cluster  split-K slices added through a thread-block cluster's shared memory instead of FP32 planes in
          global memory (the same bits for the same slices; `config` lengthens the default slice where S
          would exceed CLUSTER_MAX_S); None: `CLUSTER` (NVFP4_SAMPLER_SPLIT_K)
    persist  about one wave of persistent CTAs, each over several row tiles (the same bits); None:
          `persist_default` (NVFP4_SAMPLER_PERSIST) where the one-tile form is more than a wave and the
          persistent form's shared memory fits (`launch_form`);
          persist_ctas: override of their number per row position (`persistent_ctas`; tests, benchmarks)
    prefetch  each warp's slice prefetched into L2 as it starts (tiled weights only; the same bits); None:
          `PREFETCH` (NVFP4_SAMPLER_PREFETCH) for tiled weights
    push  the cluster's split-K partial sums pushed into their owner CTAs (where the launch splits K through
          a cluster, one tile a CTA, rw >= S; the same bits); None: `PUSH` (NVFP4_SAMPLER_SPLIT_K) on dense
          launches whose landing space fits
    """
    codes = x_scales is not None
    m, k = x.shape[0], x.shape[1] * (2 if codes else 1)
    n = w.shape[-2]
    if x.dtype != (torch.uint8 if codes else torch.float16) or not x.is_contiguous() or x_gs.shape != (m,) \
            or x_gs.dtype != torch.float32:
        raise ValueError(f"x must be contiguous {'uint8 codes [M, K/2]' if codes else 'fp16 [M, K]'} with fp32 x_gs "
                         f"[M]; got {x.dtype} {tuple(x.shape)}, x_gs {x_gs.dtype} {tuple(x_gs.shape)}")
    if codes and (x_scales.shape != (m, k // 16) or x_scales.dtype != torch.float8_e4m3fn
                  or not x_scales.is_contiguous() or schedule is not None):
        raise ValueError(f"x_scales must be contiguous float8_e4m3fn [{m}, {k // 16}] of a dense launch, got "
                         f"{x_scales.dtype} {tuple(x_scales.shape)}" + (" with a schedule" if schedule is not None else ""))
    dims = 2 if schedule is None else 3
    if w.codes.dim() != dims or w.shape[-1] != k or not shape_ok(n, k) or not w.codes.is_contiguous():
        raise ValueError(f"w must be contiguous {'[N, K]' if schedule is None else '[E, N, K]'} with N % 16 == 0 and "
                         f"K % {CHUNK} == 0, got {tuple(w.shape)}")
    if out.shape != (m, n) or out.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16/fp16/fp32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out.dtype or out.dtype == torch.float32
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}] in out's dtype bf16/fp16, got {bias.dtype} {tuple(bias.shape)}")
    gs = w.global_scale
    if schedule is None:
        gs_row, gs_expert = (0 if gs.dim() == 0 else gs.stride(0)), 0
    else:
        if schedule.dtype != torch.int32 or schedule.dim() != 2 or schedule.shape[0] != 3 or not schedule.is_contiguous() \
                or schedule.device != x.device or nt is None:
            raise ValueError(f"schedule must be contiguous int32 [3, Z] on {x.device}, with nt given; got "
                             f"{schedule.dtype} {tuple(schedule.shape)}, nt={nt}")
        if gs.dim() not in (1, 2) or gs.shape[0] != w.shape[0]:
            raise ValueError(f"a stacked weight's global_scale must be [E] or [E, N], got {tuple(gs.shape)}")
        gs_row, gs_expert = (0 if gs.dim() == 1 else gs.stride(1)), gs.stride(0)
    if not 2 <= stages <= 8:
        raise ValueError(f"stages must be in [2, 8], got {stages}")
    if m == 0:
        return out
    cfg = config(n, k, cps=cps, cluster=cluster)
    nt, rw = tiles(m if schedule is None else 8 * nt, rw=rw, nt=nt)
    wgmma = WGMMA if wgmma is None else wgmma
    if wgmma and rw % 4:
        raise ValueError(f"the wgmma variant runs whole warpgroups: rw % 4 == 0, got rw={rw}")
    tiled = w.layout == "mma_tiled"
    prefetch = PREFETCH and tiled if prefetch is None else prefetch
    if prefetch and not tiled:
        raise ValueError("the L2 prefetch reads the tiled layout's slices: prefetch needs a mma_tiled weight")
    m_tiles, row_ctas = -(-m // (8 * nt)) if schedule is None else schedule.shape[1], -(-n // (16 * rw))
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    counters = tickets(dev)
    if row_ctas * m_tiles > counters.numel() or m_tiles > 65535:       # gridDim.z's limit
        raise ValueError(f"too many tiles: {m_tiles} token tiles x {row_ctas} row tiles")
    cluster, slices = cfg["CLUSTER"], cfg["S"]

    def one_tile_resident(push: bool, smem: int) -> int:
        one = _kernel(nt, rw, out.dtype, tiled, stages, dev, wgmma, cluster, False, prefetch, push, codes)["w4a16_mma"]
        return _resident_ctas(one, 32 * rw, smem, dev, slices if cluster else 1)

    persist, push, smem = launch_form(cfg, nt, rw, stages, persist, push, m, schedule is not None,
                                      row_ctas * slices * m_tiles, one_tile_resident)
    if persist_ctas is not None and not persist:
        raise ValueError("persist_ctas sets a persistent launch's CTAs: it needs persist")
    partials = torch.empty((slices, m, n), dtype=torch.float32, device=x.device) if slices > 1 and not cluster else None
    kernel = _kernel(nt, rw, out.dtype, tiled, stages, dev, wgmma, cluster, persist, prefetch, push, codes)["w4a16_mma"]
    args = [_ptr(w.codes), _ptr(w.block_scales), _ptr(gs), ctypes.c_int(gs_row),
            _ptr(x), _ptr(x_scales), _ptr(x_gs), _ptr(bias), _ptr(out), _ptr(partials), _ptr(counters), _ptr(schedule), ctypes.c_int(gs_expert),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(cfg["CPS"])]
    ctas = row_ctas
    if persist:
        resident = _resident_ctas(kernel, 32 * rw, smem, dev, slices if cluster else 1)
        ctas = persist_ctas or persistent_ctas(row_ctas, slices * m_tiles, resident)
        if not 1 <= ctas <= row_ctas:
            raise ValueError(f"persist_ctas must be in [1, {row_ctas}] (the row tiles), got {ctas}")
    _launch(kernel, (ctas, slices, m_tiles), 32 * rw, smem, x.device, args, pdl=pdl_default(m),
            cluster=slices if cluster else 1)
    return out


def dequantize(w: NVFP4Tensor) -> torch.Tensor:
    """A "mma_tiled" w [N, K] as bf16 [N, K] in row-major order: e2m1 * block scale, exact, without
    the global scale (as `triton_gemm.dequantize_exact` gives for a ModelOpt weight)."""
    n, k = w.shape
    if w.layout != "mma_tiled" or w.codes.dim() != 2 or not shape_ok(n, k) or not w.codes.is_contiguous():
        raise ValueError(f"dequantize needs a contiguous mma_tiled weight [N, K], got {w.layout} {tuple(w.shape)}")
    out = torch.empty((n, k), dtype=torch.bfloat16, device=w.codes.device)
    dev = w.codes.device.index if w.codes.device.index is not None else torch.cuda.current_device()
    units = n * k // 32
    # the module `prepare` loaded (the dequantizer beside the GEMM is the same in every variant)
    kernel = _kernel(*TILES[0][1:], torch.bfloat16, True, STAGES, dev, WGMMA, False, PERSIST, PREFETCH)["w4_dequant"]
    _launch(kernel, (-(-units // 256), 1, 1), 256, 0, w.codes.device,
            [_ptr(w.codes), _ptr(w.block_scales), _ptr(out), ctypes.c_int(n), ctypes.c_int(k)], pdl=False)
    return out


def _launch(kernel, grid: tuple[int, int, int], threads: int, smem: int, device: torch.device, args: list,
            *, pdl: bool, cluster: int = 1) -> None:
    """cuLaunchKernelEx of a loaded kernel on the current stream of `device` (ctypes arguments); pdl:
    as a programmatic dependent of the previous launch; cluster: CTAs (along y) per thread-block cluster."""
    from torch.cuda import _utils
    arg_ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    cfg, _attrs = _launch_config(grid, threads, smem, torch.cuda.current_stream(device).cuda_stream, pdl=pdl,
                                 cluster=cluster)
    _utils._check_cuda(_utils._get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, arg_ptrs,
                                                                          None))


def _launch_config(grid: tuple[int, int, int], threads: int, smem: int, stream, *, pdl: bool, cluster: int):
    """(CUlaunchConfig, its attribute array: keep both alive while the config is used) of a launch."""
    attrs = ([(_PROGRAMMATIC_STREAM_SERIALIZATION, (1,))] if pdl else []) + \
        ([(_CLUSTER_DIMENSION, (1, cluster, 1))] if cluster > 1 else [])
    array = (_LaunchAttribute * max(1, len(attrs)))(*[_LaunchAttribute(i, 0, (ctypes.c_uint * 16)(*v)) for i, v in attrs])
    return _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), smem, stream,
                         array if attrs else None, len(attrs)), array
