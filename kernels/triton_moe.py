"""W4A4 SwiGLU MoE on CUDA GPUs (Triton), the numerics of `reference.moe`, with no host sync.

Decode (T * k <= PAIRED_MAX_PAIRS): `_moe_pairs`, one GEMV launch per weight with a
program row per (token, expert) pair, activations quantized inside the launches.
Larger decode batches (T * k <= MMA_MAX_PAIRS, where `cuda_mma` runs and the shapes fit it):
`_moe_tiled`, the tensor-core kernel of the dense decode over 8-row (16 from MMA_WIDE_PAIRS) tiles of
each expert's rows, each active expert's weights read once per tile, in six launches of ours
(`schedule_rows`, two quantizers, two GEMMs, `combine`; torch's `order // k` beside them) (H200,
Qwen3-30B-A3B layer, 2026-12-05: 16 tokens 137 us, 64 tokens 204 us, 2.6x / 2.4x the BF16 grouped
GEMM, before the 8-chunk slice). Larger batches ("exact"): the same steps with a Triton FP16 tensor-core
GEMM over 64-, 128- or 256-row tiles, each weight's codes decoded in it (`triton_gemm.launch_exact`), x
quantized once per token and read per pair by the GEMM, the SwiGLU fused into w13's epilogue. The
grouped packed GEMM below where neither fits
(steps all on the device; the grid sizes depend only on T, top-k and E):
  1. schedule   (token, slot) pairs sorted by expert (stable), per-expert row ranges and a list of
                BLOCK_M-row tiles, each tile inside one expert (`schedule_rows`)
  2. quantize   x once per token (T rows, not T*k): the per-token amax and scales are computed in
                the same pass that writes the codes; the grouped GEMM gathers codes by token index,
                so no permuted copy of x is ever written
  3. GEMM 1     grouped packed W4A4 GEMM over w13 with the SwiGLU fused in the epilogue
                (gate and up rows of one tile are accumulated by the same program) -> act [P, I]
  4. quantize   act per row (one pass over act: amax, scales, codes)
  5. GEMM 2     grouped packed W4A4 GEMM over w2, the router weight fused in the epilogue -> y [P, H]
  6. combine    out[t] = sum of y over the token's k pairs (fp32), cast to x.dtype
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cuda_mma, switches, triton_gemm, triton_gemv, triton_quant
from .format import NVFP4Tensor


def moe_block_m(pairs: int, num_experts: int) -> int:
    """Rows per grouped-GEMM tile from the mean rows per expert."""
    mean = pairs / num_experts
    return 16 if mean <= 16 else 32


def schedule_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Z, the tiles a schedule of `pairs` pairs holds: a used expert's rows fill whole tiles but its last, and
    at most min(E, P) experts are used, so P // block_m + min(E, P) bound the non-empty tiles (a fixed size for
    CUDA graphs; 1 token, top-8 of 128 experts, 8-row tiles: 9 tiles, not 129)."""
    return pairs // block_m + min(num_experts, max(pairs, 1))


def moe_schedule(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Device-side grouping of the P = T*k (token, slot) pairs by expert.

    Returns (order int64 [P]: pair ids sorted by expert, stable; tile_expert, tile_start, tile_end
    int32 [Z] (`schedule_tiles`): expert and sorted-row range of each tile; unused tiles have an empty
    range). No host synchronization (torch.bincount would sync on CUDA), so CUDA graphs can capture it.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(schedule_tiles(p, num_experts, block_m), device=flat.device)
    te = torch.searchsorted(tile_ends, t, right=True)
    valid = te < num_experts
    e = te.clamp(max=num_experts - 1)
    start = starts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    tile_start = torch.where(valid, start, 0).to(torch.int32)
    tile_end = torch.where(valid, ends[e], 0).to(torch.int32)
    return order, e.to(torch.int32), tile_start, tile_end


SCHEDULE_MAX_PAIRS = 4096   # `schedule_rows` sorts the pairs in one program (registers); beyond, in chunks
SCHEDULE_CHUNK = 1024       # pairs a program sorts beyond SCHEDULE_MAX_PAIRS, in up to SCHEDULE_MAX_CHUNKS chunks
SCHEDULE_MAX_CHUNKS = 256   # (whose counts one program adds up); beyond, `moe_schedule`'s torch ops
SCHEDULE_FEW_CHUNKS = 64    # up to this many chunks the counts program holds this many rows, beyond MAX_CHUNKS: two
                            # compilations, the first reached by the load-time warm-up at 8192 tokens of top-8


@triton.jit
def _store_tiles(counts, sched_ptr, Z, E, E_PAD: tl.constexpr, Z_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The schedule [3, Z] (expert, first row, end row of each BLOCK_M-row tile; rows sorted by expert) from the
    rows of each expert, counts int32 [E_PAD]."""
    ends = tl.cumsum(counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    first = (ends - counts) - (tile_ends - tiles) * BLOCK_M      # row of tile t of expert e: first + t * BLOCK_M
    experts = tl.arange(0, E_PAD)
    for z0 in range(0, Z, Z_BLOCK):
        t = z0 + tl.arange(0, Z_BLOCK)
        te = tl.sum((tile_ends[None, :] <= t[:, None]).to(tl.int32), axis=1)        # searchsorted(right=True)
        hot = experts[None, :] == te[:, None]                                         # none where te >= E_PAD
        ok = te < E
        start = tl.where(ok, tl.sum(tl.where(hot, first[None, :], 0), axis=1) + t * BLOCK_M, 0)
        end = tl.where(ok, tl.sum(tl.where(hot, ends[None, :], 0), axis=1), 0)
        m = t < Z
        tl.store(sched_ptr + t, tl.minimum(te, E - 1), mask=m)
        tl.store(sched_ptr + Z + t, start, mask=m)
        tl.store(sched_ptr + 2 * Z + t, end, mask=m)


@triton.jit(do_not_specialize=['P', 'Z'])   # counts of tokens: one compilation for all
def _schedule_kernel(ids_ptr, order_ptr, pos_ptr, sched_ptr, P, Z, E,
                     P_PAD: tl.constexpr, E_PAD: tl.constexpr, Z_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: `moe_schedule`'s stable sort by expert (keys expert * P_PAD + pair), the per-expert
    row ranges and tiles, and the inverse permutation, in one launch instead of ~30 torch ops."""
    i = tl.arange(0, P_PAD)
    valid = i < P
    ids = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    order = tl.sort(tl.where(valid, ids * P_PAD + i, E_PAD * P_PAD + i)) % P_PAD   # padding sorts last
    tl.store(order_ptr + i, order, mask=valid)
    tl.store(pos_ptr + order, i, mask=valid)
    _store_tiles(tl.histogram(ids, E_PAD, mask=valid), sched_ptr, Z, E, E_PAD, Z_BLOCK, BLOCK_M)


@triton.jit(do_not_specialize=['P'])
def _chunk_counts_kernel(ids_ptr, counts_ptr, P, C: tl.constexpr, E_PAD: tl.constexpr):
    """Program b: the pairs of each expert among pairs [b C, (b + 1) C) into counts[b, :E_PAD]."""
    b = tl.program_id(0)
    i = b * C + tl.arange(0, C)
    valid = i < P
    ids = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    tl.store(counts_ptr + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD, mask=valid))


@triton.jit(do_not_specialize=['Z', 'B'])
def _chunk_offsets_kernel(counts_ptr, sched_ptr, Z, E, B, B_PAD: tl.constexpr, E_PAD: tl.constexpr,
                          Z_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program over the chunks' counts [B, E_PAD]: counts[b, e] becomes where chunk b's sorted pairs of
    expert e begin in the stable order, less the chunk's own pairs of lower experts (the scatter adds each
    pair's place in its chunk's sort); then the tiles (`_store_tiles`)."""
    chunk = tl.arange(0, B_PAD)
    off = chunk[:, None] * E_PAD + tl.arange(0, E_PAD)[None, :]
    mask = (chunk < B)[:, None]
    c = tl.load(counts_ptr + off, mask=mask, other=0)
    total = tl.sum(c, axis=0)
    first = tl.cumsum(total, 0) - total                              # each expert's first row
    tl.store(counts_ptr + off, first[None, :] + (tl.cumsum(c, 0) - c) - (tl.cumsum(c, 1) - c), mask=mask)
    _store_tiles(total, sched_ptr, Z, E, E_PAD, Z_BLOCK, BLOCK_M)


@triton.jit(do_not_specialize=['P'])
def _chunk_scatter_kernel(ids_ptr, offs_ptr, order_ptr, pos_ptr, P, C: tl.constexpr, E_PAD: tl.constexpr):
    """Program b sorts pairs [b C, (b + 1) C) by (expert, pair) and writes each to its row of the stable
    order: `_chunk_offsets_kernel`'s offset of (b, expert) plus its place in the chunk's sort."""
    b = tl.program_id(0)
    j = tl.arange(0, C)
    valid = b * C + j < P
    ids = tl.load(ids_ptr + b * C + j, mask=valid, other=0).to(tl.int32)
    keys = tl.sort(tl.where(valid, ids * C + j, E_PAD * C + j))         # padding sorts last
    e = keys // C
    pair = b * C + keys % C
    used = e < E_PAD
    row = tl.load(offs_ptr + b * E_PAD + e, mask=used, other=0) + j
    tl.store(order_ptr + row, pair, mask=used)
    tl.store(pos_ptr + pair, row, mask=used)


def schedule_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`moe_schedule` as `cuda_mma.launch` takes it: (order int32 [P], pos int32 [P] its inverse
    (pos[order[s]] = s), schedule int32 [3, Z] (`schedule_tiles`)): up to SCHEDULE_MAX_PAIRS pairs in one
    launch (`_schedule_kernel`), beyond in three (counts of SCHEDULE_CHUNK-pair chunks, their offsets and the
    tiles, each chunk sorted and scattered), past SCHEDULE_MAX_CHUNKS chunks from `moe_schedule`'s torch ops;
    the same values either way."""
    p = topk_ids.numel()
    dev = topk_ids.device
    chunks = triton.cdiv(p, SCHEDULE_CHUNK)
    if not 0 < chunks <= SCHEDULE_MAX_CHUNKS:
        order, tile_expert, tile_start, tile_end = moe_schedule(topk_ids, num_experts, block_m)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(p, device=dev)
        return order.to(torch.int32), pos.to(torch.int32), torch.stack([tile_expert, tile_start, tile_end])
    z = schedule_tiles(p, num_experts, block_m)
    order = torch.empty(p, dtype=torch.int32, device=dev)
    pos = torch.empty(p, dtype=torch.int32, device=dev)
    schedule = torch.empty((3, z), dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    e_pad = triton.next_power_of_2(num_experts)
    if p <= SCHEDULE_MAX_PAIRS:
        _schedule_kernel[(1,)](ids, order, pos, schedule, p, z, num_experts, P_PAD=triton.next_power_of_2(p),
                               E_PAD=e_pad, Z_BLOCK=64, BLOCK_M=block_m, num_warps=8)
        return order, pos, schedule
    offsets = torch.empty((chunks, e_pad), dtype=torch.int32, device=dev)
    _chunk_counts_kernel[(chunks,)](ids, offsets, p, C=SCHEDULE_CHUNK, E_PAD=e_pad, num_warps=4)
    b_pad = SCHEDULE_FEW_CHUNKS if chunks <= SCHEDULE_FEW_CHUNKS else SCHEDULE_MAX_CHUNKS
    _chunk_offsets_kernel[(1,)](offsets, schedule, z, num_experts, chunks, B_PAD=b_pad, E_PAD=e_pad, Z_BLOCK=64,
                                BLOCK_M=block_m, num_warps=8 if b_pad == SCHEDULE_FEW_CHUNKS else 16)
    _chunk_scatter_kernel[(chunks,)](ids, offsets, order, pos, p, C=SCHEDULE_CHUNK, E_PAD=e_pad, num_warps=4)
    return order, pos, schedule


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, H, K_TOP: tl.constexpr, BLOCK_H: tl.constexpr,
                    WEIGHTED: tl.constexpr):
    """out[t] = sum over slots j in order of topk_weights[t, j] * y[pos[t * K_TOP + j]], fp32, one rounding
    (WEIGHTED 0: the rows added as they are, from 0 one addition at a time)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        row = tl.load(pos_ptr + t * K_TOP + j).to(tl.int64)
        val = tl.load(y_ptr + row * H + cols, mask=m, other=0.0)
        if WEIGHTED:
            acc += tl.load(w_ptr + t * K_TOP + j).to(tl.float32) * val
        else:
            acc += val
    tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine(y: torch.Tensor, pos: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype, *,
            weighted: bool = True) -> torch.Tensor:
    """y fp32 [P, H] (pairs in schedule order), pos int [P] (pair -> row of y), topk_weights [T, k] ->
    [T, H] in dtype: each token's k rows times their router weights (weighted False: rows that carry
    them already), summed in slot order, one launch (the per-pair path sums in its w2 launch)."""
    t, k = topk_weights.shape
    h = y.shape[1]
    out = torch.empty((t, h), dtype=dtype, device=y.device)
    if t:     # 8 warps a 1024-column block (H100, twenty-ninth session, 8192 tokens: 195 us; 4 warps 291)
        _combine_kernel[(t, triton.cdiv(h, 1024))](y, pos, topk_weights.contiguous(), out, h, K_TOP=k, BLOCK_H=1024,
                                                   WEIGHTED=weighted, num_warps=8)
    return out


def moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, *, op_order: str = "vllm", path: str | None = None) -> torch.Tensor:
    """W4A4 SwiGLU MoE: x [T, H] float; w13 [E, 2I, H] (gate rows then up rows; global_scale [E]
    or [E, 2I]); w2 [E, H, I] ([E] or [E, H]); topk_weights [T, k]; topk_ids [T, k] int.
    op_order: the per-token activation quantizer's, "vllm" or "te". path: None (by size: "pairs" up to
    PAIRED_MAX_PAIRS (token, expert) pairs, "mma" up to MMA_MAX_PAIRS where `mma_fits` (16-row expert tiles
    from MMA_WIDE_PAIRS), "exact" beyond where `exact_fits` (the codes decoded in the GEMM, `exact_config`),
    else "grouped"), or one forced: "pairs", "grouped", "mma" (what `mma_fits`
    checks), "exact" (bf16/fp16 x, ModelOpt weights with H, I % 64 == 0: `_moe_tiled`'s FP16 tensor-core GEMM).
    Returns [T, H] in x.dtype, equal to `reference.moe` up to FP32 summation order."""
    if w13.codes.dim() != 3 or w2.codes.dim() != 3:
        raise ValueError(f"w13 and w2 must be stacked experts [E, N, K], got {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if w13.shape[2] != h or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    k = topk_ids.shape[1]
    p = t * k
    if path not in (None, "pairs", "grouped", "mma", "exact"):
        raise ValueError(f"path must be None, 'pairs', 'grouped', 'mma' or 'exact', got {path!r}")
    path = path or moe_path(p, x, w13, w2)
    if path == "mma":
        return _moe_tiled(x, w13, w2, topk_weights, topk_ids, op_order,
                          nt=cuda_mma.GROUPED_NT_WIDE if p >= MMA_WIDE_PAIRS else cuda_mma.GROUPED_NT)
    if path == "exact":
        return _moe_tiled(x, w13, w2, topk_weights, topk_ids, op_order, gemm="exact", config=exact_config(p, w13, w2))
    if path == "pairs":
        return _moe_pairs(x, w13, w2, topk_weights, topk_ids, op_order)
    bm = moe_block_m(p, e)
    order, pos, schedule = schedule_rows(topk_ids, e, bm)
    tiles = tuple(schedule.unbind(0))
    cfg = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=1)
    a = triton_quant.quantize_per_token(x, op_order=op_order)
    act = torch.empty((p, inter), dtype=x.dtype, device=x.device)
    triton_gemm.launch_w4a4(a, w13, act, a_index=order // k, schedule=tiles, swiglu=True, config=cfg)
    a2 = triton_quant.quantize_per_token(act, op_order=op_order)
    y = torch.empty((p, h), dtype=torch.float32, device=x.device)
    row_weight = topk_weights.reshape(-1).float().index_select(0, order)
    triton_gemm.launch_w4a4(a2, w2, y, schedule=tiles, row_weight=row_weight, config=cfg)
    return combine(y, pos, topk_weights, x.dtype, weighted=False)   # w2's epilogue applied the router weights


# The per-pair GEMV launches: 8 blocks a step (the SwiGLU variant at ~170 registers, sm_90) and split-K until
# about this many programs. H100 (docs/BENCHMARKS.md, twenty-second session, 30B-A3B layer, top-8, us at 1 / 4
# tokens): 264 programs 24.9 / 55.7, the dense GEMV's 528 27.9 / 57.7, 1056 28.2 / 66.8.
PAIRS_MIN_PROGRAMS = 264
# The w2 launch programmatically after w13's (CUDA): its programs start as w13's leave the SMs and prefetch their
# weights before the grid-dependency wait. NVFP4_SAMPLER_PAIRS_PDL=0: launched plainly (same bits).
PAIRS_PDL = triton_quant.PDL and switches.choice("NVFP4_SAMPLER_PAIRS_PDL", ("1", "0")) == "1"
# up to this many (token, expert) pairs run as per-pair GEMVs (no routing sort). H100 (docs/BENCHMARKS.md,
# twenty-first session, 30B-A3B layer, top-8, us pairs / the six-launch `cuda_mma` path): 8 pairs 27.8 / 35.0,
# 32 pairs 59.6 / 65.2, 64 pairs 98.4 / 94.1; twenty-second: 48 pairs 85.5 / 77.1.
# NVFP4_SAMPLER_PAIRED_MAX_PAIRS moves it (the e2e bench's --moe-mma engine: 0, the tensor-core path from 1 token)
PAIRED_MAX_PAIRS = switches.count("NVFP4_SAMPLER_PAIRED_MAX_PAIRS", 32, cuda_mma.MMA_MAX_M)
MMA_MAX_PAIRS = 2048  # the default path's upper end (H200, 30B-A3B layer, top-8, us mma / grouped): 32 tokens
                      # 275 / 419, 64: 308 / 460, 128: 392 / 467, 256: 577 / 615; 1024: 1709 / 1269
MMA_WIDE_PAIRS = 513  # from here the mma path's expert tiles hold 16 rows (`cuda_mma.GROUPED_NT_WIDE`)
# Beyond MMA_MAX_PAIRS the default is "exact": each weight's codes decoded in its GEMM (`_decode_pairs`), over
# tiles of 64 rows, 128 from EXACT_TALL_ROWS rows an expert on average, 256 from EXACT_WIDE_ROWS (both weights: one
# schedule). H100, thirtieth session, 30B-A3B layer, us of each weight's GEMM alone at 1024 / 2048 / 4096 / 6144 /
# 8192 tokens: w13 128-row codes 340 / 483 / 770 / 1073 / 1330, 256-row (interleaved) 486 / 495 / 728 / 987 / 1168,
# its FP16 copy with the dequantization (the default beyond 4096 tokens until then) 664 / 701 / 833 / 1001 / 1149;
# w2 188 / 270 / 459 / 635 / 799, 256-row 265 / 274 / 414 / 548 / 679, FP16 358 / 398 / 513 / 635 / 747. The
# layer at 8192 tokens on 256-row codes 2215 us against 2255 with the FP16 copies, and no transient FP16 experts
# (1.2 GB a call).
EXACT_TALL_ROWS = 64    # from this many rows an expert on average, the exact path's tiles hold 128 rows (H100,
                       # twenty-ninth session, 1024 tokens (64 rows an expert), us w13 / w2 with codes: 64-row tiles,
                       # 128-element K steps 403 / 215, 128-row 377 / 190)
EXACT_WIDE_ROWS = 256   # from this many, 256 rows (4096 tokens of top-8 over 128 experts; 128-row tiles win at 2048)
# Each weight's GEMM form by tile rows (EXACT_GROUPED's keys; 64-row tiles take EXACT_GROUPED). 128 rows (H100,
# twenty-ninth session, us at 1024 / 8192 tokens): w13 with 64-column tiles, 4 warps, 4 stages 371 / 1516 then
# (EXACT_GROUPED 413 / 1699, 128-element K steps 377 / 1524 but spilling); w2 with 128-element K steps 190 / 837
# (EXACT_GROUPED 264 / 1100). 256 rows: a decoded weight tile feeds HGMMA of N 256, w13's gate and up rows
# interleaved in one accumulator (INTERLEAVE; without it the wgmma serialized at 255 registers).
EXACT_FORMS = {128: {"w13": dict(BLOCK_N=64, num_warps=4, num_stages=4), "w2": dict(BLOCK_K=128)},
               256: {"w13": dict(BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3, INTERLEAVE=True),
                     "w2": dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)}}


def exact_config(pairs: int, w13: NVFP4Tensor, w2: NVFP4Tensor) -> dict[str, dict]:
    """The "exact" path's GEMM configurations {"w13": ..., "w2": ...} for T * k = `pairs` over the experts of
    w13 [E, 2I, H] and w2 [E, H, I], the codes decoded in the GEMM: tiles of 256 rows from EXACT_WIDE_ROWS rows an
    expert on average, 128 from EXACT_TALL_ROWS (each weight's EXACT_FORMS form; 128 rows where a weight's K is not
    a multiple of the 256-row forms' K step, EXACT_GROUPED's where not of the 128-row form's), else 64 (both
    weights: one schedule); GROUP_M row tiles per column sweep (they share their weight tile in L2; the same bits in
    any order; column-major, GROUP_M 0, 809 / 3747 us at 1024 / 8192 tokens, twenty-first session)."""
    rows = pairs / w13.shape[0]
    tile = 256 if rows >= EXACT_WIDE_ROWS else 128 if rows >= EXACT_TALL_ROWS else 64
    if tile == 256 and any(w.shape[2] % exact_form(n, 256)["BLOCK_K"] for n, w in (("w13", w13), ("w2", w2))):
        tile = 128
    out = {}
    for name, w in (("w13", w13), ("w2", w2)):
        form = exact_form(name, tile) if tile > 64 else None
        out[name] = (form if form and w.shape[2] % form["BLOCK_K"] == 0
                     else dict(triton_gemm.EXACT_GROUPED, GROUP_M=4, BLOCK_M=tile, W_CODES=True))
    return out


def exact_form(weight: str, rows: int) -> dict:
    """The exact GEMM's configuration for `weight` ("w13" or "w2") over tiles of `rows` (128 or 256) rows: its
    EXACT_FORMS form, the codes decoded in the GEMM."""
    return dict(triton_gemm.EXACT_GROUPED, GROUP_M=4, BLOCK_M=rows, W_CODES=True, **EXACT_FORMS[rows][weight])


def moe_path(pairs: int, x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor) -> str:
    """The path `moe` takes by default for T * k = `pairs` (token, expert) pairs."""
    if pairs <= PAIRED_MAX_PAIRS:
        return "pairs"
    if pairs <= MMA_MAX_PAIRS and mma_fits(x, w13, w2):
        return "mma"
    return "exact" if pairs > MMA_MAX_PAIRS and exact_fits(x, w13, w2) else "grouped"


def exact_fits(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor) -> bool:
    """`_moe_tiled(gemm="exact")` takes these by default: bf16/fp16 x on CUDA, ModelOpt weights whose H and I are
    multiples of the GEMM's K tile (`triton_gemm.EXACT_GROUPED`)."""
    bk = triton_gemm.EXACT_GROUPED["BLOCK_K"]
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w13.layout == "modelopt"
            and w2.layout == "modelopt" and w13.shape[2] % bk == 0 and w2.shape[2] % bk == 0)


def mma_fits(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor) -> bool:
    """`_moe_tiled(gemm="mma")` can run: bf16/fp16 x, ModelOpt weights of `cuda_mma`'s shape contract, on a
    device where `cuda_mma` is prepared (`triton_gemm._mma_supported`, at load time through `dispatch`)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and w13.layout == "modelopt" and w2.layout == "modelopt"
            and cuda_mma.shape_ok(*w13.shape[1:]) and cuda_mma.shape_ok(*w2.shape[1:])
            and triton_gemm._mma_supported(x.device))


def _moe_tiled(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, op_order: str, *, gemm: str = "mma", nt: int | None = None,
               cps: int | None = None, wgmma: bool | None = None, cluster: bool | None = None,
               push: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """MoE over tiles of each expert's rows, exact products, in six launches of ours: the (token, slot) pairs
    sorted by expert (`schedule_rows`), x's rows quantized in that order into exact values (a token's k
    rows alike), w13 into fp32 [P, 2I], SwiGLU in fp32 rounded to x's dtype and quantized per row in one
    pass, w2 into fp32 [P, H], each token's k rows times their router weights summed in slot order
    (`combine`). gemm: "mma" (`cuda_mma` over tiles of 8 * nt rows, fp16 rows; nt: `cuda_mma.GROUPED_NT` if
    None, every nt gives the same bits; cps: a benchmark override of `cuda_mma.GROUPED_CPS`, the split-K
    slice, which changes the summation order; wgmma: of `cuda_mma.WGMMA`, the kernel's warpgroup-MMA variant; cluster: of
    `cuda_mma.CLUSTER`, split-K through thread-block clusters, push: pushed to the owners (grouped launches pull
    by default), every bit the same) or "exact"
    (`triton_gemm.launch_exact` over tiles of config's BLOCK_M rows, SwiGLU in w13's epilogue (the same
    operations, no fp32 [P, 2I]; x quantized once per token, each pair's GEMM row reading its token's row):
    larger batches; config: `exact_config`'s choice for the pair count ({"w13": ..., "w2": ...}, their BLOCK_M
    equal; a form without W_CODES dequantizes the experts to exact FP16 for the call), or one configuration for
    both, EXACT_GROUPED if None).
    Deterministic: fixed split-K order, a stable sort."""
    if gemm == "mma" and not mma_fits(x, w13, w2):
        raise ValueError(f"the mma MoE takes bf16/fp16 x and ModelOpt weights with N % 16 == 0, K % 128 == 0 on a "
                         f"device where cuda_mma runs; got {x.dtype}, {w13.layout} {tuple(w13.shape)}, "
                         f"{w2.layout} {tuple(w2.shape)}, {x.device}")
    if gemm == "exact" and (x.dtype not in (torch.bfloat16, torch.float16) or "mma_tiled" in (w13.layout, w2.layout)):
        raise ValueError(f"the exact MoE takes bf16/fp16 x and ModelOpt weights, got {x.dtype}, {w13.layout}, "
                         f"{w2.layout}")
    t, h = x.shape
    e, k, inter = w13.shape[0], topk_ids.shape[1], w13.shape[1] // 2
    if gemm == "mma":
        nt = nt or cuda_mma.GROUPED_NT
        tile_rows = 8 * nt
        cps = cps or cuda_mma.GROUPED_CPS

        def launch(a, w, out, schedule):
            cuda_mma.launch(a.values, a.global_scale, w, out, schedule=schedule, nt=nt, cps=cps, wgmma=wgmma,
                            cluster=cluster, push=push)
    else:
        config = config or triton_gemm.EXACT_GROUPED
        configs = config if "w13" in config else {"w13": config, "w2": config}
        tile_rows = configs["w13"]["BLOCK_M"]
        if configs["w2"]["BLOCK_M"] != tile_rows:
            raise ValueError(f"w13's and w2's tiles share one schedule: BLOCK_M {tile_rows} vs {configs['w2']['BLOCK_M']}")
    order, pos, schedule = schedule_rows(topk_ids, e, tile_rows)
    y = torch.empty((t * k, h), dtype=torch.float32, device=x.device)
    if gemm == "mma":
        a = triton_quant.quantize_per_token_exact(x, op_order=op_order, dtype=torch.float16, rows=order // k)
        h13 = torch.empty((t * k, 2 * inter), dtype=torch.float32, device=x.device)
        launch(a, w13, h13, schedule)
        b = triton_quant.quantize_per_token_exact(h13, op_order=op_order, dtype=torch.float16, swiglu=x.dtype)
        launch(b, w2, y, schedule)
    else:                                       # SwiGLU in the GEMM's epilogue: no fp32 [P, 2I] round trip
        a = triton_quant.quantize_per_token_exact(x, op_order=op_order, dtype=torch.float16)
        act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
        triton_gemm.launch_exact(a, w13, act, schedule=schedule, swiglu=True, config=configs["w13"], a_index=order // k)
        b = triton_quant.quantize_per_token_exact(act, op_order=op_order, dtype=torch.float16)
        triton_gemm.launch_exact(b, w2, y, schedule=schedule, config=configs["w2"])
    return combine(y, pos, topk_weights, x.dtype)


def _moe_pairs(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, op_order: str, *, strict: bool = False, config: dict | None = None
               ) -> torch.Tensor:
    """Decode MoE in two launches and no routing sort: one GEMV per (token, expert) pair for w13
    (token quantized in the launch, SwiGLU fused) and w2 (SwiGLU row quantized in the launch,
    router weight fused; the last pair of a token to finish a column tile adds the token's k rows one
    by one in fp32 in slot order, rounded once: `combine`'s arithmetic). strict: batch-invariant (`triton_strict.moe`): the launch configurations
    (split-K, tiles) from the weight shapes and top-k alone, as for one token, never from T.
    config: `triton_gemv.gemv_config` keywords for both launches (benchmark sweeps; block_n, block_b,
    num_warps, min_programs), "w2": such keywords for w2's launch alone, and pdl (`PAIRS_PDL`'s choice)."""
    t, h = x.shape
    k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    pairs = (1 if strict else t) * k               # programs counted over all pairs (one token's in strict)
    over = {"block_b": 8, "min_programs": PAIRS_MIN_PROGRAMS, **(config or {})}
    pdl = over.pop("pdl", PAIRS_PDL) and x.is_cuda
    only2 = over.pop("w2", {})
    cfg13 = triton_gemv.gemv_config(1, inter * pairs, h, **over)
    cfg2 = triton_gemv.gemv_config(1, h * pairs, inter, **{**over, **only2})
    pair_expert = topk_ids.reshape(-1).to(torch.int32)
    row_weight = topk_weights.reshape(-1).float()          # before w13's launch: w2's may start before it ends
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    triton_gemv.launch_w4a4_pairs(x, w13, act, pair_expert=pair_expert, topk=k, swiglu=True, op_order=op_order,
                                  config=cfg13, signal=pdl)
    y = torch.empty((t * k, h), dtype=torch.float32, device=x.device)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    triton_gemv.launch_w4a4_pairs(act, w2, y, pair_expert=pair_expert, topk=1, row_weight=row_weight,
                                  op_order=op_order, config=cfg2, combined=out, wait=pdl)
    return out
