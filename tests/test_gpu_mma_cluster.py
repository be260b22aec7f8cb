"""`cuda_mma`'s split-K through thread-block clusters on the H200 (`bash bench/h200.sh mma_cluster`, which also
runs tests/test_gpu_mma.py with every launch on it): the global planes' bits for the same slices. A step of
its own, so that a fault in the cluster form cannot cost the other kernel tests their results."""
from __future__ import annotations

import pytest
import torch

from tests.test_gpu_mma import _check, _w, _x, grouped_launch, mods  # noqa: F401 - mods: the module's fixture

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 16, 40, 64, 100])
@pytest.mark.parametrize("n,k,cps", [(640, 2048, None), (4096, 4096, None), (4096, 4096, 16), (256, 8192, 8),
                                     (4096, 12288, None), (2048, 2048, 8),
                                     (6144, 4096, 8), (4096, 12288, 16)])   # S = 4, 6: the default at 9-16 rows
@pytest.mark.parametrize("wgmma", [False, True])
def test_cluster_split_k_gives_the_global_planes_bits(mods, m, n, k, cps, wgmma):
    """`launch(cluster=True)`: the S split-K CTAs of a tile add their partial sums through a thread-block
    cluster's shared memory, in the order the global FP32 planes are added: the same bits for the same
    slices (S = 2, 4, 6, 8; at K = 12288 the cluster's default slice is 12 chunks, S = 8), within the
    reference's bound; pulled by the owners (`push=False`) or pushed to them (`push`, one tile a CTA; rw < S
    pulls); CUDA-graph replay too."""
    cuda_mma, _, tq = mods
    x, w = _x(m, k, seed=m + k), _w(n, k, seed=n + 7, per_row=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = tq.quantize_per_token_exact(x, dtype=torch.float16)
    wk = cuda_mma.tile_weight(w)
    cfg = cuda_mma.config(n, k, cps=cps, cluster=True)
    assert cfg["CLUSTER"]
    cps = cfg["CPS"]
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    forms = (dict(cluster=False), dict(cluster=True, push=False), dict(cluster=True, push=True, persist=False))
    for out, opts in zip(outs[:3], forms):
        cuda_mma.launch(a.values, a.global_scale, wk, out, bias=bias, cps=cps, wgmma=wgmma, **opts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_mma.launch(a.values, a.global_scale, wk, outs[3], bias=bias, cps=cps, cluster=True, wgmma=wgmma, push=False)
        cuda_mma.launch(a.values, a.global_scale, wk, outs[4], bias=bias, cps=cps, cluster=True, wgmma=wgmma,
                        push=True, persist=False)
    graph.replay()
    torch.cuda.synchronize()
    _check(outs[0], x, w, bias)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_cluster_split_k_grouped(mods):
    """The grouped (MoE) launch with split-K through clusters: the global planes' bits, empty tiles skipped
    by whole clusters; pulled or pushed."""
    cuda_mma, _, tq = mods
    run = grouped_launch(cuda_mma, tq, 2048, seed=5)
    want = run(cluster=False)
    assert cuda_mma.config(256, 2048)["S"] > 1 and torch.equal(run(cluster=True, push=False), want)
    assert torch.equal(run(cluster=True, push=True, persist=False), want)
