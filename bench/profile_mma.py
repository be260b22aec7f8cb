"""The small-M tensor-core kernel (`kernels.cuda_mma`) on one linear shape, for Nsight Compute.

For each M and launch form, launches the kernel `--launches` times on a fresh weight [N, K] and activation
(the activation quantized beforehand, as in bench_kernels' "kernel alone"), in the order printed; on the
H200 (`h200.sh ncu_mma`, `ncu_mma_forms`):
  ncu --clock-control none -k w4a16_mma --section WarpStateStats python3 bench/profile_mma.py --m 1,16,64
By default the launch engines run (`triton_gemm.linear`'s mma path): the weight in the "mma_tiled" layout,
`cuda_mma.throughput_options` from 9 tokens; --config takes `config`'s launch at every M (strict mode's),
--modelopt the ModelOpt layout. Forms: "one-tile" (one row tile per CTA), "persist" (persistent CTAs),
"prefetch" (the L2 prefetch of each warp's slice, tiled only), "persist+prefetch".
"""
from __future__ import annotations

import argparse

import torch

from nvfp4_sampler.kernels import cuda_mma, triton_quant

FORMS = {"one-tile": dict(persist=False), "persist": dict(persist=True), "prefetch": dict(persist=False, prefetch=True),
         "persist+prefetch": dict(persist=True, prefetch=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=24576, help="output features (default: Qwen3-8B gate_up)")
    ap.add_argument("--k", type=int, default=4096, help="input features")
    ap.add_argument("--m", default="16", help="comma-separated token counts")
    ap.add_argument("--launches", type=int, default=2, help="launches per M and form")
    ap.add_argument("--modelopt", action="store_true", help="the weight in the ModelOpt layout (not mma_tiled)")
    ap.add_argument("--config", action="store_true", help="`config`'s launch at every M (strict mode's)")
    ap.add_argument("--forms", default="one-tile", help=f"comma-separated launch forms of {sorted(FORMS)}")
    args = ap.parse_args()
    n, k = args.n, args.k
    forms = args.forms.split(",")
    if unknown := sorted(set(forms) - set(FORMS)):
        ap.error(f"unknown forms {unknown}; known: {sorted(FORMS)}")
    dev = torch.device("cuda")
    ok, reason = cuda_mma.prepare(dev)
    if not ok:
        raise SystemExit(f"cuda_mma unavailable: {reason}")
    w = triton_quant.quantize_weight((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    if not args.modelopt:
        w = cuda_mma.tile_weight(w)
    for m in map(int, args.m.split(",")):
        x = triton_quant.quantize_per_token_exact(torch.randn(m, k, device=dev, dtype=torch.bfloat16),
                                                  dtype=torch.float16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        tuned = {} if args.config else cuda_mma.throughput_options(m, n, k, warpgroup=cuda_mma.has_wgmma(dev),
                                                                 slices=cuda_mma.small_slices(dev))
        for form in forms:
            for _ in range(args.launches):
                cuda_mma.launch(x.values, x.global_scale, w, out, **tuned, **FORMS[form])
            torch.cuda.synchronize()
            print(f"[{m}, {k}] x [{n}, {k}] {w.layout}: {args.launches} launches of w4a16_mma, {form}, (NT, RW) "
                  f"{cuda_mma.tiles(m)}, {cuda_mma.config(n, k)}, overrides {tuned}")


if __name__ == "__main__":
    main()
