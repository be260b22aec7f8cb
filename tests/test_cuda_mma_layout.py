"""CPU checks of the small-M CUDA kernel (`kernels/cuda/w4a16_mma.cu`) that need no GPU.

1. The fragment mapping, modelled in numpy with the constants read out of the .cu source: the bit
   decode `dec` turns every pair of E2M1 codes into the FP16 pair e2m1 * 2^-14 exactly, and the
   activation permutation pairs each weight element with its own activation element, so the sum
   over the MMA's slots is the plain dot product (exactly, in float64).
2. Its compilation for sm_90 (tests/test_cuda_mma_sm90.py: NVRTC and ptxas on the CPU); here the
   warpgroup-MMA variant's shared-memory layout, modelled as in 1.
The GPU test (`tests/test_gpu_mma.py`) checks the kernel's numbers on the H200.
"""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import torch

from nvfp4_sampler.kernels import cuda_mma
from nvfp4_sampler.kernels.format import E2M1_VALUES

SOURCE = cuda_mma._SOURCE.read_text()
E2M1 = np.array([*E2M1_VALUES, *(-v for v in E2M1_VALUES)])     # by 4-bit code, sign in bit 3


_DEC = re.search(r"dec\(u32 w\) \{ return \(w & (0x[0-9a-f]+)u\) \| \(\(w & (0x[0-9a-f]+)u\) >> (\d)\); \}", SOURCE)


def _dec(w: np.ndarray) -> np.ndarray:
    """The kernel's `dec`, with its constants read from the source."""
    sign, mag, shift = (int(v, 0) for v in _DEC.groups())
    return (w & np.uint32(sign)) | ((w & np.uint32(mag)) >> np.uint32(shift))


def _halves(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A uint32 array as its (low, high) FP16 halves, in float64."""
    pair = r.astype("<u4").view("<f2").reshape(*r.shape, 2).astype(np.float64)
    return pair[..., 0], pair[..., 1]


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    src = np.stack([a, b], -1).astype("<u4").view(np.uint8).reshape(*a.shape, 8)
    idx = [(sel >> (4 * i)) & 7 for i in range(4)]
    return src[..., idx].copy().view("<u4").reshape(a.shape)


def test_decode_gives_exact_fp16_pairs():
    """Every code pair at every shift the kernel uses (all 2^16 low/high byte pairs of a word)."""
    lo, hi = np.meshgrid(np.arange(256, dtype=np.uint32), np.arange(256, dtype=np.uint32), indexing="ij")
    words = (lo << 8) | (hi << 24) | np.uint32(0x00A500A5)     # bytes 1 and 3 vary, bytes 0 and 2 fixed
    nib = lambda w, i: (w >> np.uint32(4 * i)) & np.uint32(15)  # noqa: E731 - element i of the word
    for shift, (el_lo, el_hi) in zip((0, 4, 8, 12), ((3, 7), (2, 6), (1, 5), (0, 4))):
        a, b = _halves(_dec((words << np.uint32(shift)) & np.uint32(0xFFFFFFFF)))
        assert np.array_equal(a * 2.0 ** 14, E2M1[nib(words, el_lo)]), shift
        assert np.array_equal(b * 2.0 ** 14, E2M1[nib(words, el_hi)]), shift


_SELS = re.search(r"const u32 p\[4\] = \{prmt\(v\.y, v\.w, (0x\w+)\), prmt\(v\.y, v\.w, (0x\w+)\), "
                  r"prmt\(v\.x, v\.z, (0x\w+)\), prmt\(v\.x, v\.z, (0x\w+)\)\};", SOURCE).groups()


def _staged_pairs(v: list[np.ndarray]) -> list[np.ndarray]:
    """The staging's four permuted FP16 pairs p[0..3] of one 16-byte load v.x .. v.w (selectors from the source)."""
    return [_prmt(v[1], v[3], int(_SELS[0], 16)), _prmt(v[1], v[3], int(_SELS[1], 16)),
            _prmt(v[0], v[2], int(_SELS[2], 16)), _prmt(v[0], v[2], int(_SELS[3], 16))]


def test_activation_permutation_pairs_each_element_with_its_weight():
    """One 8-element word of codes and its 8 activations: the two k16 steps' MMA slots sum to the dot."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(1000, 8), dtype=np.uint32)
    word = sum(codes[:, i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32)
    x = rng.choice(E2M1, size=(1000, 8)) * 2.0 ** rng.integers(-6, 6, size=(1000, 1))
    xh = x.astype("<f2").view("<u2").astype(np.uint32)
    v = [xh[:, 2 * i] | (xh[:, 2 * i + 1] << np.uint32(16)) for i in range(4)]      # v.x .. v.w of the load
    staged = _staged_pairs(v)
    # step 2w: A pairs dec(w), dec(w << 4) with B staged .x, .y; step 2w+1: dec(w << 8), dec(w << 12) with .z, .w
    total = np.zeros(1000)
    for shift, b in zip((0, 4, 8, 12), staged):
        a_lo, a_hi = _halves(_dec((word << np.uint32(shift)) & np.uint32(0xFFFFFFFF)))
        b_lo, b_hi = _halves(b)
        total += a_lo * b_lo + a_hi * b_hi
    want = (E2M1[codes] * x).sum(1)
    assert np.array_equal(total * 2.0 ** 14, want)


def _c_expr(pattern: str) -> str:
    """A C integer expression of the source (+, *, >>, parentheses: Python evaluates it alike)."""
    return re.search(pattern, SOURCE).group(1)


@pytest.mark.parametrize("nt", [1, 2, 8])
def test_wgmma_staging_is_what_the_descriptors_read(nt):
    """The WGMMA variant: the staging's stores (expressions read from the source) put each token's permuted
    pairs where a K-major, unswizzled wgmma B descriptor with the source's byte offsets reads element
    B[k][token] of each k16 step (core matrices of 8 tokens x 16 bytes, k halves `LBO` apart, 8-token
    groups `SBO` apart: the PTX ISA's canonical layout), and those B times the A fragments of the decoded
    codes (mma's A layout per warp) sum to each token's dot product exactly, over two chunks."""
    rows_at = _c_expr(r"u32\* rows = reinterpret_cast<u32\*>\(xs\) \+ (.+?);")
    store_at = _c_expr(r"for \(int h = 0; h < 4; \+\+h\) rows\[(.+?)\] = p\[h\];")
    lbo, sbo = _c_expr(r"\| \(\(([^()]+) >> 4\) << 16\); \}"), _c_expr(r"\(\(u64\)\(([^()]+) >> 4\) << 32\)")
    step_at = _c_expr(r"const u32 step = (.+?);")                    # in 16-byte units past the slice's first
    second_at = _c_expr(r"b_desc_step\(xs_d, step\), b_desc_step\(xs_d, step \+ (.+?)\)\);")
    rng = np.random.default_rng(nt)
    ntok, chunks = 8 * nt, 2
    x = rng.choice(E2M1, size=(ntok, chunks * 128)) * 2.0 ** rng.integers(-4, 4, size=(ntok, 1))
    xh = x.astype("<f2").view("<u2").astype(np.uint32)
    smem = np.zeros(chunks * 128 * ntok // 2, dtype=np.uint32)
    for i in range(chunks):
        for wd in range(4):
            for tt in range(4):
                for m in range(ntok):
                    k0 = i * 128 + tt * 32 + wd * 8
                    v = [np.array([xh[m, k0 + 2 * j] | (xh[m, k0 + 2 * j + 1] << np.uint32(16))]) for j in range(4)]
                    base = eval(rows_at, dict(i=i, wd=wd, m=m, tt=tt, NT=nt))
                    for h, pair in enumerate(_staged_pairs(v)):
                        smem[base + eval(store_at, dict(h=h, NT=nt))] = pair[0]
    halves = smem.view("<u2").view("<f2").astype(np.float64)             # byte address b: halves[b // 2]
    lbo, sbo = eval(lbo, dict(NT=nt)), eval(sbo, dict(NT=nt))
    codes = rng.integers(0, 16, size=chunks * 128, dtype=np.uint32)       # one weight row
    total = np.zeros(ntok)
    for c in range(chunks):
        for wd in range(4):
            step = 16 * eval(step_at, dict(c=c, wd=wd, NT=nt))
            for half, start in enumerate((step, step + 16 * eval(second_at, dict(NT=nt)))):
                b = np.array([[halves[(start + (kk // 8) * lbo + (n // 8) * sbo + (n % 8) * 16 + (kk % 8) * 2) // 2]
                               for n in range(ntok)] for kk in range(16)])
                for t in range(4):
                    el = c * 128 + 32 * t + 8 * wd
                    word = np.uint32(sum(int(codes[el + i]) << (4 * i) for i in range(8)))
                    a01 = _halves(_dec(np.array([word << np.uint32(8 * half)], dtype=np.uint32)))
                    a89 = _halves(_dec(np.array([(word << np.uint32(8 * half + 4)) & np.uint32(0xFFFFFFFF)],
                                                dtype=np.uint32)))
                    total += a01[0] * b[2 * t] + a01[1] * b[2 * t + 1] + a89[0] * b[2 * t + 8] + a89[1] * b[2 * t + 9]
    assert np.array_equal(total * 2.0 ** 14, x @ E2M1[codes])


_PAIRS = re.search(r"if \(tiled\) \{\n\s+p\[0\] = w & (0x\w+)u;\n\s+p\[1\] = \(w << (\d+)\) & (0x\w+)u;\n"
                   r"\s+p\[2\] = \(\(w & (0x\w+)u\) \* (\d+)u\) & (0x\w+)u;\n"
                   r"\s+p\[3\] = \(\(w & (0x\w+)u\) \* (\d+)u\) & (0x\w+)u;", SOURCE)


def test_tiled_words_decode_to_the_same_pairs():
    """Every code of a word re-encoded by tile_weight decodes, by the kernel's TILED `pairs` (constants
    read from the source), to the FP16 pair that `dec` gives for the ModelOpt word: all 16 x 16 codes
    in every slot, with random neighbours."""
    import torch
    m0, s1, m1, k2, f2, m2, k3, f3, m3 = (int(v, 0) for v in _PAIRS.groups())
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(4096, 8), dtype=np.uint32)
    codes[:256, :4] = np.stack(np.meshgrid(np.arange(16), np.arange(16)), -1).reshape(256, 2).repeat(2, 1)
    codes[256:512, 4:] = codes[:256, :4]
    word = sum(codes[:, i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32)
    tiled = cuda_mma._encode_words(torch.from_numpy(word.view(np.uint8).copy())).numpy().view(np.uint32).astype(np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    got = [tiled & np.uint64(m0), (tiled << np.uint64(s1)) & np.uint64(m1),
           ((tiled & np.uint64(k2)) * np.uint64(f2) & mask32) & np.uint64(m2),
           ((tiled & np.uint64(k3)) * np.uint64(f3) & mask32) & np.uint64(m3)]
    for i, shift in enumerate((0, 4, 8, 12)):
        want = _dec((word << np.uint32(shift)) & np.uint32(0xFFFFFFFF))
        assert np.array_equal(got[i].astype(np.uint32), want), f"pair {i}"


def test_config_depends_on_the_weight_shape_only():
    for n, k in [(4096, 4096), (24576, 4096), (4096, 12288), (6144, 4096), (16, 128), (96, 1152), (2048, 32768)]:
        for cluster in (False, True):
            cfg = cuda_mma.config(n, k, cluster=cluster)
            assert cfg["CPS"] * cfg["S"] >= k // cuda_mma.CHUNK > (cfg["S"] - 1) * cfg["CPS"]
            assert cfg["CPS"] <= cuda_mma._MAX_CPS
            assert cuda_mma._smem_bytes(4, cfg["CPS"], 8, cuda_mma.STAGES) <= cuda_mma._SMEM_LIMIT
            # a cluster holds the slices wherever the longest slice can: up to 128 chunks (K = 16384)
            assert cfg["CLUSTER"] == (cluster and 1 < cfg["S"] <= cuda_mma.CLUSTER_MAX_S)
            assert cfg["CLUSTER"] or not cluster or cfg["S"] == 1 or k > 16384
    assert cuda_mma.config(4096, 12288, cluster=False) == dict(CPS=4, S=24, CLUSTER=False)
    assert cuda_mma.config(4096, 12288) == cuda_mma.config(4096, 12288, cluster=cuda_mma.CLUSTER)  # launch's default
    assert cuda_mma.config(4096, 12288, cluster=True) == dict(CPS=12, S=8, CLUSTER=True)
    assert cuda_mma.config(24576, 4096, cluster=True) == dict(CPS=8, S=4, CLUSTER=True)    # the slice unchanged
    assert cuda_mma.config(4096, 12288, cps=4, cluster=True)["CLUSTER"] is False           # an explicit slice stays


def test_launch_refuses_a_bad_grouped_call():
    """The grouped (MoE) form's contract is checked before anything reaches the device."""
    import torch
    from nvfp4_sampler.kernels import reference

    w = reference.quantize_weight(torch.randn(4, 32, 128))                 # stacked experts [E, N, K]
    x, x_gs = torch.zeros(8, 128, dtype=torch.float16), torch.ones(8)
    out = torch.empty(8, 32)
    good = torch.zeros(3, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        cuda_mma.launch(x, x_gs, w, out)                                    # a stacked weight needs a schedule
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        cuda_mma.launch(x, x_gs, reference.quantize_weight(torch.randn(32, 128)), out, schedule=good, nt=1)
    for bad, nt in [(good.long(), 1), (good[:2], 1), (good.t().contiguous().t(), 1), (good, None)]:
        with pytest.raises(ValueError, match="schedule"):
            cuda_mma.launch(x, x_gs, w, out, schedule=bad, nt=nt)
    with pytest.raises(ValueError, match="bias"):
        cuda_mma.launch(x, x_gs, w, out, bias=torch.zeros(32), schedule=good, nt=1)     # fp32 out: no bias


def test_tiles_cover_every_m():
    assert [cuda_mma.tiles(m) for m in (1, 8, 9, 16, 17, 64, 4096)] == [(1, 4), (1, 4), (2, 8), (2, 8), (4, 8), (4, 8), (4, 8)]
    assert cuda_mma.tiles(16, rw=2) == (2, 2)
    with pytest.raises(ValueError):
        cuda_mma.tiles(1, rw=17)


def test_persistent_ctas_by_default_on_dense_launches_from_persist_min_m_tokens():
    """NVFP4_SAMPLER_PERSIST "auto" (the default): dense launches of PERSIST_MIN_M = 17 tokens or more take
    persistent CTAs where their one-tile CTAs are more than a wave, smaller ones and the MoE's grouped launches
    one tile a CTA; "1" every launch, "0" none. Every such size runs the token tiles that `prepare` compiles in
    the persistent form."""
    pd = cuda_mma.persist_default
    assert [pd(m, False, "auto") for m in (1, 16, 17, 64, 4096)] == [False, False, True, True, True]
    assert not pd(64, True, "auto") and not pd(64, False, "auto", waves=1.0) and pd(64, False, "auto", waves=1.5)
    assert pd(64, False, "1", waves=0.5)
    assert pd(1, False, "1") and pd(1, True, "1") and not pd(64, False, "0")
    assert {cuda_mma.tiles(m)[0] for m in range(cuda_mma.PERSIST_MIN_M, 5000)} == {cuda_mma.tiles(cuda_mma.PERSIST_MIN_M)[0]}


def test_launch_form_drops_a_default_that_does_not_fit_and_refuses_one_asked_for():
    """`launch_form`: the defaults push the split-K of dense one-tile cluster launches (rw >= S > 1) and run
    persistent CTAs from PERSIST_MIN_M tokens, each only where its shared memory fits (the H100 run of the
    eighteenth session: rw 16, nt 8, 8 stages asked 278528 B with the landing space); a form asked for
    explicitly that does not fit raises."""
    form, limit = cuda_mma.launch_form, cuda_mma._SMEM_LIMIT
    small, wide = dict(CLUSTER=True, S=2, CPS=8), dict(CLUSTER=True, S=4, CPS=4)
    many = lambda push, smem: 1                                              # noqa: E731 - every launch > a wave
    persist, push, smem = form(small, 2, 8, 3, None, None, 16, False, 400, many)
    assert (persist, push) == (False, cuda_mma.PUSH) and smem <= limit
    assert form(small, 2, 8, 3, None, True, 16, False, 400, many)[1]         # asked for
    assert not form(small, 2, 8, 3, None, None, 16, True, 400, many)[1]      # grouped: pulled
    assert not form(dict(small, S=1), 2, 8, 3, None, True, 16, False, 400, many)[1]   # nothing to push
    assert not form(dict(small, CLUSTER=False), 2, 8, 3, None, True, 16, False, 400, many)[1]
    assert not form(dict(small, S=16), 2, 8, 3, None, True, 16, False, 400, many)[1]  # rw < S: the owners pull
    persist, push, smem = form(wide, 8, 16, 8, None, None, 1, False, 400, many)  # the landing space would not fit
    assert (persist, push) == (False, False) and smem <= limit
    with pytest.raises(ValueError, match="landing space"):
        form(wide, 8, 16, 8, None, True, 1, False, 400, many)
    assert form(dict(small, CPS=16), 4, 16, 4, None, None, 64, False, 400, many) == (False, False, 204800)
    with pytest.raises(ValueError, match="persistent"):
        form(dict(small, CPS=16), 4, 16, 4, True, None, 64, False, 400, many)


@pytest.mark.skipif(cuda_mma._PERSIST != "auto", reason="the wave rule is NVFP4_SAMPLER_PERSIST=auto's")
def test_persistent_ctas_only_over_more_than_a_wave_of_one_tile_ctas():
    """From PERSIST_MIN_M tokens the default runs persistent CTAs only where the one-tile launch has more CTAs
    than fit the device at once (with less, each persistent CTA would get one tile; the pushed one-tile form
    was as fast or faster: H100, eighteenth session, 8B qkv / o / down at M = 32); the count asked of
    `resident` is the one-tile form's that would run (pushed where it fits)."""
    cfg, asked = dict(CLUSTER=True, S=2, CPS=16), []

    def resident(push, smem):
        asked.append((push, smem))
        return 132
    assert cuda_mma.launch_form(cfg, 4, 16, 3, None, None, 64, False, 192, resident)[:2] == (True, False)
    persist, push, smem = cuda_mma.launch_form(cfg, 4, 16, 3, None, None, 64, False, 96, resident)
    assert not persist and push == cuda_mma.PUSH and asked == [(push, smem)] * 2
    assert not cuda_mma.launch_form(cfg, 4, 16, 3, None, None, 16, False, 960, resident)[0]   # below PERSIST_MIN_M
    assert cuda_mma.launch_form(cfg, 4, 16, 3, True, None, 64, False, 96, resident)[0]        # asked for


def test_programmatic_launches_by_default_at_one_token_only():
    """NVFP4_SAMPLER_PDL "auto" (the default): the decode kernel is a programmatic dependent of the
    quantizer at PDL_MAX_M = 1 token (vLLM, H100: 1.04x the tokens/s at batch 1), an ordinary launch above
    (1.14x / 1.11x at batch 16 / 64); "1" every launch, "0" none."""
    pd = cuda_mma.pdl_default
    import os
    assert cuda_mma.PDL == os.environ.get("NVFP4_SAMPLER_PDL", "auto")
    assert [pd(m, "auto") for m in (1, 2, 16, 64)] == [True, False, False, False]
    assert pd(64, "1") and not pd(1, "0")


def test_the_token_count_switches_are_read_once_and_checked():
    """NVFP4_SAMPLER_PDL_MAX_M moves the "auto" bound of programmatic launches (the e2e bench's --pdl: 16);
    a value that is not a token count 0..MMA_MAX_M stops the import, naming the variable."""
    import os
    import sys
    code = "from nvfp4_sampler.kernels import cuda_mma as c; print([c.pdl_default(m) for m in (1, 16, 17)])"
    for value, want in ((None, [True, False, False]), ("16", [True, True, False]), ("0", [False] * 3)):
        env = {k: v for k, v in os.environ.items() if k != "NVFP4_SAMPLER_PDL_MAX_M"}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env if value is None else dict(env, NVFP4_SAMPLER_PDL_MAX_M=value))
        assert res.stdout.strip() == str(want), res.stderr
    for bad in ("x", "65", "-1"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, NVFP4_SAMPLER_PDL_MAX_M=bad))
        assert res.returncode != 0 and "NVFP4_SAMPLER_PDL_MAX_M must be a token count" in res.stderr


def test_throughput_options_only_above_8_tokens_and_only_prepared_variants():
    """The default path's faster launch (not batch-invariant): at 9-16 tokens a longer split-K slice where
    it keeps a wave of CTAs; above 16 tokens the first (RW, CPS) of THROUGHPUT_TILES with THROUGHPUT_MIN_CTAS CTAs, 16 warps on warpgroup MMAs where the device has them.
    The fastest forms measured on the H200 (8B, persistent, M = 32 / 64; the 1.7B sweep of the fifth
    session) are what it picks; every (NT, RW) a forward may take is compiled by `prepare`, and its shared
    memory fits, in the persistent form too."""
    opt = cuda_mma.throughput_options
    assert opt(16, 24576, 4096, warpgroup=True) == {}
    # M = 9-16: the longer slice (about SMALL_SLICES of them) where it keeps a wave of CTAs, as measured
    # fastest on the H100 at M = 16: 8B qkv 8 chunks, down 16; o and gate_up keep `config`'s; M <= 8 too
    assert [opt(m, 6144, 4096) for m in (1, 8, 9, 16)] == [{}, {}, dict(cps=8), dict(cps=8)]
    assert opt(16, 4096, 12288) == dict(cps=16) and opt(16, 4096, 4096) == {}
    assert all(opt(16, n, k) == {} for n, k in ((4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)))  # 1.7B
    # the H200's slice counts (`small_slices`: two slices where they keep a wave, else four), as measured
    # fastest there at M = 16: 8B gate_up 16 chunks, qkv 8, down 16, o `config`'s
    h200 = dict(slices=cuda_mma.SMALL_SLICES_BY_DEVICE["H200"])
    assert [opt(16, n, k, **h200) for n, k in ((24576, 4096), (6144, 4096), (4096, 4096), (4096, 12288))] == \
        [dict(cps=16), dict(cps=8), {}, dict(cps=16)]
    assert [opt(16, n, k, **h200) for n, k in ((4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144))] == \
        [{}, {}, dict(cps=8), {}]                                   # 1.7B: gate_up takes 8 chunks, not `config`'s 4
    assert opt(8, 24576, 4096, **h200) == {} and cuda_mma.small_slices(torch.device("cpu")) == (cuda_mma.SMALL_SLICES,)
    picks = {   # (M, N, K): (RW, CPS), the measured fastest
        (32, 6144, 4096): (8, 16), (64, 6144, 4096): (16, 16),       # 8B qkv (M = 32: 15.9 vs the best 15.4 us)
        (32, 4096, 4096): (8, 8), (64, 4096, 4096): (8, 16),         # 8B o
        (32, 24576, 4096): (16, 16), (64, 24576, 4096): (16, 16),    # 8B gate_up
        (32, 4096, 12288): (16, 16), (64, 4096, 12288): (16, 16),    # 8B down
        (32, 4096, 2048): (8, 8), (64, 4096, 2048): (8, 8), (64, 2048, 2048): (8, 8),   # 1.7B qkv, o
        (32, 12288, 2048): (8, 16), (64, 12288, 2048): (16, 16),     # 1.7B gate_up
        (32, 2048, 6144): (8, 8), (64, 2048, 6144): (8, 16)}         # 1.7B down
    for (m, n, k), (rw, cps) in picks.items():
        assert opt(m, n, k) == dict(rw=rw, cps=cps), (m, n, k)
        assert opt(m, n, k, warpgroup=True) == dict(rw=rw, cps=cps) | ({"wgmma": True} if rw == 16 else {})
    assert opt(64, 16384, 512) == dict(rw=16, cps=4)                 # no more chunks than K has
    for m in range(1, 65):
        for n, k in ((24576, 4096), (4096, 12288), (2048, 2048), (6144, 4096)):
            o = opt(m, n, k, warpgroup=True)
            nt, rw = cuda_mma.tiles(m, rw=o.get("rw"))
            assert (nt, rw) in cuda_mma.VARIANTS
            assert o.get("wgmma", False) == (rw == 16)                  # as `prepare` compiles them
            cps = cuda_mma.config(n, k, cps=o.get("cps"))["CPS"]
            assert cuda_mma._smem_bytes(nt, cps, rw, cuda_mma.STAGES) <= cuda_mma._SMEM_LIMIT
            # the persistent form fits too (its split-K partial sums in a space of their own): engines that
            # turn it on never fall back to one tile a CTA; and the pushed split-K's landing space (S <= rw)
            assert cuda_mma._smem_bytes(nt, cps, rw, cuda_mma.STAGES, rw) <= cuda_mma._SMEM_LIMIT
            s = cuda_mma.config(n, k, cps=o.get("cps"))["S"]
            assert cuda_mma._smem_bytes(nt, cps, rw, cuda_mma.STAGES, -(-rw // s) * s) <= cuda_mma._SMEM_LIMIT


def _w_index(n0: int, g: int, t: int, half: int, c: int, k: int, tiled: bool) -> int:
    """The kernel's w_index (both layouts; its text is checked against the source below)."""
    if tiled:
        return ((((n0 >> 4) * (k >> 7) + c) * 2 + half) * 8 + g) * 4 + t
    return (n0 + g + 8 * half) * (k >> 5) + c * 4 + t


def test_tiled_order_is_what_the_kernel_indexes():
    """tile_weight puts row n0 + g + 8 * half, chunk c, thread t's 16 code bytes (2 scale bytes) at the
    kernel's w_index, and tile_weight of the tiled weight inverts it."""
    import torch
    from nvfp4_sampler.kernels import reference
    n, k = 48, 384
    w = reference.quantize_weight(torch.randn(n, k, dtype=torch.bfloat16))
    tw = cuda_mma.tile_weight(w)
    assert tw.codes.shape == w.codes.shape and tw.block_scales.shape == w.block_scales.shape
    codes, scales = tw.codes.reshape(-1, 16), tw.block_scales.view(torch.uint8).reshape(-1, 2)
    wsc = w.block_scales.view(torch.uint8)
    for n0 in range(0, n, 16):
        for c in range(k // 128):
            for half in (0, 1):
                for g in range(8):
                    for t in range(4):
                        i = _w_index(n0, g, t, half, c, k, tiled=True)
                        row = n0 + g + 8 * half
                        want = cuda_mma._encode_words(w.codes[row, c * 64 + t * 16: c * 64 + t * 16 + 16])
                        assert torch.equal(codes[i], want)
                        assert torch.equal(scales[i], wsc[row, c * 8 + t * 2: c * 8 + t * 2 + 2])
    back = cuda_mma.tile_weight(tw)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.block_scales.view(torch.uint8), wsc)
    assert "((((size_t)(n0 >> 4) * (K >> 7) + c) * 2 + half) * 8 + g) * 4 + t" in SOURCE


@pytest.mark.parametrize("tiled", [False, True])
def test_persistent_stream_issues_the_chunks_each_tile_computes(tiled):
    """PERSIST: a warp's issue side (sources stepping by CSTEP a chunk and by tjump from a tile's end to the
    next's start, `w_index` being linear in the row) runs STAGES - 1 chunks ahead of the compute side; the
    chunk computed at each step is the one of its tile and slice position, issued as empty exactly for rows
    past N; `persistent_ctas` gives every row tile to one CTA. A model of the .cu file's arithmetic."""
    assert "(size_t)(n0 + g + 8 * half) * (K >> 5) + (size_t)c * 4 + t" in SOURCE
    assert "const size_t tjump = w_index(tstride, 0, 0, 0, 0, K) - (size_t)nc * CSTEP;" in SOURCE
    assert "if (++ic == nc) ic = 0, qa += tjump, qb += tjump, sp += tjump, in0 += tstride;" in SOURCE
    cstep = 64 if tiled else 4
    for n, k, cps, rw, ctas, stages in [(48, 384, 3, 8, 1, 3), (640, 2048, 1, 8, 2, 3), (1040, 1024, 2, 4, 3, 8),
                                        (4096, 4096, 4, 8, 7, 2), (2064, 12288, 12, 16, 1, 4)]:
        row_tiles, chunks = -(-n // (16 * rw)), k // 128
        for split in range(-(-chunks // cps)):
            c0 = split * cps
            nc = min(cps, chunks - c0)
            for bx in range(ctas):
                for warp, g, t in [(0, 0, 0), (rw - 1, 7, 3), (rw // 2, 3, 1)]:
                    n0 = (bx * rw + warp) * 16
                    tstride = 16 * rw * ctas
                    tjump = _w_index(tstride, 0, 0, 0, 0, k, tiled) - nc * cstep
                    qa, in0, ic, issued = _w_index(n0, g, t, 0, c0, k, tiled), n0, 0, []
                    tiles = range(bx, row_tiles, ctas)
                    for _ in range(len(tiles) * nc + stages - 1):
                        issued.append((qa, in0 < n))
                        qa += cstep
                        ic += 1
                        if ic == nc:
                            ic, qa, in0 = 0, qa + tjump, in0 + tstride
                    computed = [((rt * rw + warp) * 16, c) for rt in tiles for c in range(nc)]
                    for (src, real), (rows, c) in zip(issued, computed):
                        assert real == (rows < n)
                        if real:
                            assert src == _w_index(rows, g, t, 0, c0 + c, k, tiled), (n, k, split, bx, warp, c)
    for row_tiles, others, resident in [(192, 4, 396), (48, 8, 396), (384, 4, 924), (5, 1, 1000), (1, 8, 3)]:
        p = cuda_mma.persistent_ctas(row_tiles, others, resident)
        assert 1 <= p <= row_tiles
        assert sorted(rt for bx in range(p) for rt in range(bx, row_tiles, p)) == list(range(row_tiles))
        waves = -(-row_tiles * others // resident)
        assert -(-row_tiles // p) == min(waves, row_tiles)  # each CTA's tiles: the fewest waves, evenly
    assert cuda_mma.persistent_ctas(192, 4, 396) == 96 and cuda_mma.persistent_ctas(48, 8, 396) == 48


def test_launch_config_carries_pdl_and_the_cluster():
    """The CUlaunchConfig `_launch` and the cluster occupancy query build: grid, block, shared memory, the
    programmatic-dependent-launch attribute and the cluster's dimensions (1, S, 1)."""
    cfg, attrs = cuda_mma._launch_config((3, 4, 5), 256, 1024, None, pdl=True, cluster=4)
    assert (list(cfg.grid), list(cfg.block), cfg.shared_mem, cfg.num_attrs) == ([3, 4, 5], [256, 1, 1], 1024, 2)
    assert [(a.id, list(a.value[:3])) for a in attrs] == [(6, [1, 0, 0]), (4, [1, 4, 1])]
    assert [(cfg.attrs[i].id, cfg.attrs[i].value[1]) for i in range(2)] == [(6, 0), (4, 4)]
    cfg, _ = cuda_mma._launch_config((1, 2, 1), 128, 0, None, pdl=False, cluster=1)
    assert cfg.num_attrs == 0 and not cfg.attrs


def test_moe_path_falls_back_where_cuda_mma_cannot_run():
    """The MoE default path by (token, expert) pairs: the per-pair GEMVs up to PAIRED_MAX_PAIRS; above,
    the tensor-core kernels only where `mma_fits` / `exact_fits` (here, on the CPU, never: the grouped GEMM)."""
    import torch
    pytest.importorskip("triton")
    from nvfp4_sampler.kernels import reference, triton_moe
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w13, w2 = reference.quantize_weight(torch.randn(4, 256, 256)), reference.quantize_weight(torch.randn(4, 256, 128))
    assert not triton_moe.mma_fits(x, w13, w2)
    assert triton_moe.moe_path(triton_moe.PAIRED_MAX_PAIRS, x, w13, w2) == "pairs"
    assert triton_moe.moe_path(triton_moe.PAIRED_MAX_PAIRS + 1, x, w13, w2) == "grouped"
    assert not triton_moe.exact_fits(x, w13, w2)
    assert triton_moe.moe_path(triton_moe.MMA_MAX_PAIRS + 1, x, w13, w2) == "grouped"
    with pytest.raises(ValueError, match="mma MoE"):
        triton_moe.moe(x, w13, w2, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int64), path="mma")


@pytest.mark.parametrize("var,attr,values", [("NVFP4_SAMPLER_MMA", "WGMMA", ("mma", "wgmma")),
                                             ("NVFP4_SAMPLER_SPLIT_K", "CLUSTER", ("global", "cluster")),
                                             ("NVFP4_SAMPLER_SPLIT_K", "PUSH", ("cluster", "push")),
                                             ("NVFP4_SAMPLER_PERSIST", "PERSIST", ("0", "1")),
                                             ("NVFP4_SAMPLER_PREFETCH", "PREFETCH", ("0", "1")),
                                             ("NVFP4_SAMPLER_X_CODES", "X_CODES", ("0", "1")),
                                             ("NVFP4_SAMPLER_PDL", "pdl_default(2)", ("0", "1"))])
def test_the_kernel_switches_are_read_once_and_checked(var, attr, values):
    """NVFP4_SAMPLER_MMA picks the default MMA of every launch at import ("mma" or "wgmma"),
    NVFP4_SAMPLER_SPLIT_K its split-K reduction ("global" planes, "cluster" pulled, "push" the default),
    NVFP4_SAMPLER_PERSIST persistent CTAs at every launch ("1"; "0" none, "auto" by size), NVFP4_SAMPLER_PREFETCH the L2
    prefetch ("0" or "1") and NVFP4_SAMPLER_PDL the programmatic dependent launch ("1" every launch, "0"
    none, "auto" by size); anything else stops the import with the variable's name."""
    import os
    import sys
    code = f"from nvfp4_sampler.kernels import cuda_mma; print(cuda_mma.{attr})"
    for value, want in zip(values, ("False", "True")):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, **{var: value}))
        assert res.stdout.strip() == want, res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **{var: "x"}))
    assert res.returncode != 0 and f"{var} must be one of" in res.stderr and repr(values[1]) in res.stderr


def test_the_exact_gemm_switch_is_read_once_and_checked():
    """NVFP4_SAMPLER_EXACT_MIN_M (the e2e bench's --exact engine): tiled weights take the exact Triton GEMM
    from that many tokens to MMA_MAX_M (0: never); anything but such a count stops the import, naming it."""
    import os
    import sys
    code = ("import torch; from nvfp4_sampler.kernels import cuda_mma, reference, triton_gemm as tg; "
            "w = cuda_mma.tile_weight(reference.quantize_weight(torch.randn(32, 256).bfloat16())); "
            "print([tg.linear_path(m, 'per_token', w) for m in (1, 32, 33, 64, 65)])")
    for value, want in (("0", ["mma"] * 4 + ["bf16"]), ("33", ["mma"] * 2 + ["exact"] * 2 + ["bf16"])):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, NVFP4_SAMPLER_EXACT_MIN_M=value))
        assert res.stdout.strip() == str(want), res.stderr
    for bad in ("x", "65", "-1"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, NVFP4_SAMPLER_EXACT_MIN_M=bad))
        assert res.returncode != 0 and "NVFP4_SAMPLER_EXACT_MIN_M must be a token count" in res.stderr


def test_the_moe_pairs_switch_is_read_once_and_checked():
    """NVFP4_SAMPLER_PAIRED_MAX_PAIRS (the e2e bench's --moe-mma engine: 0): the MoE's per-pair GEMVs up to that
    many (token, expert) pairs, the grouped launches above (here, on the CPU, the Triton grouped GEMM); anything
    but a count 0..64 stops the import, naming it."""
    import os
    import sys
    code = ("import torch; from nvfp4_sampler.kernels import reference, triton_moe as tm; "
            "x = torch.zeros(1, 256, dtype=torch.bfloat16); w = reference.quantize_weight(torch.randn(4, 256, 256)); "
            "print([tm.moe_path(p, x, w, w) for p in (1, 8, 32, 33)])")
    for value, want in ((None, ["pairs"] * 3 + ["grouped"]), ("0", ["grouped"] * 4), ("8", ["pairs"] * 2 + ["grouped"] * 2)):
        env = {k: v for k, v in os.environ.items() if k != "NVFP4_SAMPLER_PAIRED_MAX_PAIRS"}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env if value is None else dict(env, NVFP4_SAMPLER_PAIRED_MAX_PAIRS=value))
        assert res.stdout.strip() == str(want), res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, NVFP4_SAMPLER_PAIRED_MAX_PAIRS="65"))
    assert res.returncode != 0 and "NVFP4_SAMPLER_PAIRED_MAX_PAIRS must be a token count" in res.stderr
