"""`cuda_mma`'s persistent CTAs and L2 prefetch on the H200 (`bash bench/h200.sh mma_persist`, which also runs
tests/test_gpu_mma.py with every launch persistent and prefetching): a CTA over several row tiles, its weight
rings streaming across them, and a warp prefetching its slice into L2 give the one-tile launch's bits. A step
of its own, so that a fault (or a cluster barrier that never completes) cannot cost the other kernel tests
their results."""
from __future__ import annotations

import pytest
import torch

from tests.test_gpu_mma import _check, _w, _x, grouped_launch, mods  # noqa: F401 - mods: the module's fixture

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 16, 40, 64, 100])
@pytest.mark.parametrize("n,k,cps", [(48, 384, None), (640, 2048, None), (640, 2048, 1), (4096, 4096, None),
                                     (2064, 12288, None), (1040, 1024, 2)])
@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("tiled,wgmma", [(False, False), (True, False), (True, True)])
def test_persistent_ctas_give_the_one_tile_bits(mods, m, n, k, cps, cluster, tiled, wgmma):
    """`launch(persist=True)`: with one CTA per row position (every tile in one CTA: its rings cross every
    tile boundary, past the last tile too), two, three, and the occupancy's default, the one-tile launch's
    bits, within the reference's bound; N not a multiple of the CTA's rows (warps past N), slices of one
    chunk (the ring runs ahead by more than a tile), S = 1 (no reduction); mma.sync and the wgmma variant
    (whose MMAs drain at each tile's end); CUDA-graph replay too, the occupancy queried inside the capture."""
    cuda_mma, _, tq = mods
    x, w = _x(m, k, seed=m + n), _w(n, k, seed=n + k, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)
    wk = cuda_mma.tile_weight(w) if tiled else w
    opts = dict(bias=bias, cps=cps, cluster=cluster, wgmma=wgmma, persist=False)
    want = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cuda_mma.launch(a.values, a.global_scale, wk, want, **opts)
    row_tiles = -(-n // (16 * cuda_mma.tiles(m)[1]))
    for ctas in sorted({1, min(2, row_tiles), min(3, row_tiles), None}, key=lambda c: c or 0):
        got = torch.full_like(want, float("nan"))
        cuda_mma.launch(a.values, a.global_scale, wk, got, **{**opts, "persist": True, "persist_ctas": ctas})
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"persist_ctas={ctas}"
    graph, got = torch.cuda.CUDAGraph(), torch.full_like(want, float("nan"))
    cuda_mma._resident_ctas.cache_clear()      # the driver's occupancy query inside the capture: engines capture
    with torch.cuda.graph(graph):              # decode sizes that no eager forward ran before
        cuda_mma.launch(a.values, a.global_scale, wk, got, **{**opts, "persist": True})
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    _check(want, x, w, bias)


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("persist", [False, True])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_l2_prefetch_gives_the_same_bits(mods, m, persist, cluster):
    """`launch(prefetch=True)` (tiled weights): each warp's slice prefetched into L2 first (persistent: each
    next tile's too) changes no bit; 1-chunk slices (nothing left to prefetch) and long ones."""
    cuda_mma, _, tq = mods
    for n, k, cps in ((640, 2048, 1), (2064, 12288, None), (4096, 4096, 16)):
        x, w = _x(m, k, seed=m + 3), cuda_mma.tile_weight(_w(n, k, seed=n + 5, per_row=False))
        a = tq.quantize_per_token_exact(x, dtype=torch.float16)
        outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for out, prefetch in zip(outs, (False, True)):
            cuda_mma.launch(a.values, a.global_scale, w, out, cps=cps, cluster=cluster, persist=persist, prefetch=prefetch)
        torch.cuda.synchronize()
        assert torch.equal(outs[1], outs[0]), (n, k, cps)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_an_ordinary_launch_gives_the_programmatic_dependents_bits(mods, m, monkeypatch):
    """NVFP4_SAMPLER_PDL (`cuda_mma.PDL`; "1": every launch): the kernel launched right after
    the quantizer with and without the programmatic-dependent attribute gives the same bits (without it its
    griddepcontrol.wait is a no-op), one tile a CTA and persistent, at the default launch of each size."""
    cuda_mma, tg, _ = mods
    for n, k in ((640, 2048), (4096, 4096), (2064, 12288)):
        x, w = _x(m, k, seed=m + 11), cuda_mma.tile_weight(_w(n, k, seed=n + 13, per_row=False))
        outs = []
        for pdl in ("1", "0"):
            monkeypatch.setattr(cuda_mma, "PDL", pdl)
            outs.append(tg.linear(x, w, path="mma"))      # the quantizer, then the kernel, as engines run it
        torch.cuda.synchronize()
        assert torch.equal(outs[1], outs[0]), (n, k)


@pytest.mark.parametrize("cluster", [False, True])
def test_persistent_ctas_grouped(mods, cluster):
    """The grouped (MoE) launch persistent: the one-tile launch's bits, empty expert tiles skipped."""
    cuda_mma, _, tq = mods
    run = grouped_launch(cuda_mma, tq, 2048, seed=9)
    want = run(cluster=cluster, persist=False)
    for ctas in (1, 3, None):
        assert torch.equal(run(cluster=cluster, persist=True, persist_ctas=ctas), want), f"persist_ctas={ctas}"


def test_bad_launch_forms_are_refused(mods):
    """persist_ctas needs persist and at most the row tiles; the L2 prefetch needs the tiled layout."""
    cuda_mma, _, tq = mods
    a = tq.quantize_per_token_exact(_x(16, 1024, seed=1), dtype=torch.float16)
    w_modelopt = _w(256, 1024, seed=2, per_row=False)
    w = cuda_mma.tile_weight(w_modelopt)
    out = torch.empty(16, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs persist"):
        cuda_mma.launch(a.values, a.global_scale, w, out, persist=False, persist_ctas=2)
    with pytest.raises(ValueError, match="persist_ctas must be"):
        cuda_mma.launch(a.values, a.global_scale, w, out, persist=True, persist_ctas=99)
    with pytest.raises(ValueError, match="prefetch needs a mma_tiled weight"):
        cuda_mma.launch(a.values, a.global_scale, w_modelopt, out, prefetch=True)
