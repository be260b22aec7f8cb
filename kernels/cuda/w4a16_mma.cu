// Small-M exact W4A4 linear for sm_90 on FP16 tensor cores (mma.sync.m16n8k16, FP32 accumulation).
// Compiled at run time by NVRTC (kernels/cuda_mma.py); no headers. The host defines
//   NT        token tiles of 8 per CTA (1..8; `cuda_mma.TILES` by M); more tokens loop over gridDim.z
//   RW        16-row weight tiles per CTA, one per warp (all share the CTA's staged activations)
//   OUT_BF16  1: bf16 output and bias, 0: fp16
//   OUT_F32   1: fp32 output, no bias (the MoE's expert GEMMs, whose SwiGLU and combine read FP32)
//   TILED     1: weight codes and scales in the tiled order of `cuda_mma.tile_weight`, 0: ModelOpt row-major
//   STAGES    chunks in each warp's ring in shared memory (2..8): a warp streams its rows through it by
//             cp.async, STAGES - 1 chunks in flight without holding registers
//   WGMMA     1: each k16 step is one warpgroup MMA (wgmma.mma_async.m64n{8 NT}k16, sm_90a) per 4 warps instead
//             of 2 NT mma.sync per warp, the activations read by the tensor cores from shared memory;
//             needs RW % 4 == 0 and `wgmma_k32`, which the host generates for NT (`cuda_mma._wgmma_source`)
//   CLUSTER   1: launched as clusters of the S split-K CTAs of a tile (1 x S x 1, S <= 8), which add their
//             partial sums through distributed shared memory instead of FP32 planes in global memory
//   CLUSTER_PUSH  1 (CLUSTER, one tile a CTA, RW >= S): each warp pushes its partial sums into the owner CTA's
//             shared memory (st.async, counted on the owner's mbarrier) instead of every CTA pulling them
//             behind two cluster barriers: no release fence before the reduction, no second barrier (its
//             sources are registers); the owner waits for its bytes only. The same bits
//   PERSIST   1: a CTA computes row tiles blockIdx.x, blockIdx.x + gridDim.x, ... (the host launches about one
//             wave of CTAs): its activations are staged once, and each warp's ring streams the chunks of its
//             next tile while the current one is reduced and stored, so the weight stream does not drain
//             between tiles; 0: gridDim.x is the number of row tiles (one each). Same bits either way.
//   X_CODES   1 (dense): x is the activation's codes (uint8 [M, K/2], ModelOpt) and `x_scales` its e4m3 block
//             scales [M, K/16] (`triton_quant.quantize_per_token`), 3.5x fewer bytes than its exact FP16 rows: each
//             thread loads 16 code bytes and a scale pair of a row and decodes them as the weights' ModelOpt words
//             (`dec`, times the block scale: the exact value * 2^-14) into the same staged layout; the epilogue
//             multiplies acc by 2^28 instead of 2^14. The same bits (every value and partial sum scaled by a
//             power of two, far from FP32's subnormals)
//   PREFETCH  1 (TILED): each warp prefetches the rest of its slice into L2 when it starts (PERSIST: each next
//             tile's slice when a tile starts), one bulk prefetch for the codes and one for the block scales,
//             so the DRAM round trips of a slice's later chunks overlap its first ones' (no registers, no
//             shared memory)
//
// Operands. Weight: ModelOpt NVFP4 (codes uint8 [N, K/2], even element in the low nibble; e4m3 scales
// [N, K/16]; FP32 S_dec [N] or []), read in place, or (TILED) repacked by `cuda_mma.tile_weight`.
// Activation: exact FP16 values e2m1(q_a) * s_a [M, K] and FP32 S_dec_a [M] from the per-token quantizer.
//
// Fragment mapping. An MMA's k order is free as long as both operands use it. Thread (g = lane/4,
// t = lane%4) of a warp owns, in each 128-element chunk, the elements [32t, 32t + 32) of its rows
// (rows g and g+8 of the warp's 16-row tile): 16 code bytes = one 128-bit load per row, 64
// contiguous bytes per row across the 4 threads. A 32-bit word of codes holds elements e0..e7 of
// one 16-element block; its nibble at bits [15:12]/[31:28] is e3/e7, so
//   dec(w) = (w & 0x80008000) | ((w & 0x70007000) >> 3)
// turns (e3, e7) into the FP16 pair (e2m1(e3), e2m1(e7)) * 2^-14 (sign, exponent and mantissa bits
// land in place; E2M1's subnormal 0.5 lands on FP16's subnormal grid), and dec(w << 4), dec(w << 8),
// dec(w << 12) give (e2, e6), (e1, e5), (e0, e4). One k16 step takes two of these pairs per row; the
// activation pairs are permuted the same way once, when the CTA stages them in shared memory. Each
// decoded pair is multiplied by its block scale (FP16, exact: <= 6 significant bits on the 2^-24
// grid), so the MMA multiplies exact values and accumulates in FP32; the epilogue applies
// ((acc * 2^14) * S_dec_a[m]) * S_dec_w[n] (+ bias) in FP32 and rounds once, the reference's order.
//
// Grouped (MoE). With a tile table (`cuda_mma.launch`'s `schedule`: int32 [3, Z] expert, first row, end row of
// the expert's rows), CTA z computes rows [first, min(first + NT * 8, end)) of x and out against expert
// tiles[0][z] of a stacked weight [E, N, K] (its codes, scales and global scales offset by the expert);
// an empty range exits before it touches anything (the schedule's spare tiles).
//
// WGMMA. The register A operand of wgmma.m64nNk16 is, per warp, mma.m16n8k16's A fragment (warp w of a
// warpgroup: rows 16 w..16 w + 15 of the 64), and its FP32 accumulator fragment is mma's C fragment for
// each 8 columns, so the decode and the epilogue are the same. B (the tokens) is read from shared memory
// through a descriptor: K-major without swizzle, core matrices of 8 tokens x 16 bytes (8 k), the two
// k-halves of a step NT * 128 bytes apart (leading byte offset), consecutive 8-token groups 128 bytes
// apart (stride byte offset). The staging writes the permuted pairs in that layout: [chunk][word][mma
// half][k half][token][t] (4 bytes per t), so the k order both operands share is the one above. A word's two
// MMAs stay in flight while the next word decodes (`wgmma_k32` waits for the previous word's only; ptxas
// keeps the A registers of the group in flight apart), `wgmma_drain` completes them before acc is read.
//
// Reduction order. Each output element is summed in a fixed order that depends on (N, K) and the
// launch constants only, never on M or on the other tokens: k16 steps in order inside a warp, then
// the split-K partial sums in order 0..S-1 from 0: by the last CTA of a tile (atomic ticket), or
// (CLUSTER) by the CTA of the cluster that finishes the warp's rows (warp % S == its rank), reading
// every rank's partials from its shared memory. Both give the same bits. Deterministic and
// batch-invariant.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef WGMMA
#define WGMMA 0
#endif
#if WGMMA && RW % 4
#error "WGMMA needs whole warpgroups: RW % 4 == 0"
#endif
#ifndef CLUSTER
#define CLUSTER 0
#endif
#ifndef PERSIST
#define PERSIST 0
#endif
#ifndef CLUSTER_PUSH
#define CLUSTER_PUSH 0
#endif
#if CLUSTER_PUSH && (!CLUSTER || PERSIST)
#error "CLUSTER_PUSH is the one-tile form of CLUSTER"
#endif
#ifndef PREFETCH
#define PREFETCH 0
#endif
#ifndef X_CODES
#define X_CODES 0
#endif
#if PREFETCH && !TILED
#error "PREFETCH reads the tiled layout's contiguous slices"
#endif

// Split-K planes summed per unrolled step of the last CTA: 4 x NT x 4 loads in flight, halved at NT = 8
// (whose 128 would take 174 registers).
constexpr int kPlaneUnroll = NT > 4 ? 2 : 4;
// The epilogue's power of two: the weights decode to value * 2^-14, and so do X_CODES' activations
constexpr float kUnscale = X_CODES ? 268435456.f : 16384.f;

__device__ __forceinline__ u32 dec(u32 w) { return (w & 0x80008000u) | ((w & 0x70007000u) >> 3); }

// The four FP16 pairs of a 32-bit word of codes, p[i] = (e2m1(e_{3-i}), e2m1(e_{7-i})) * 2^-14 (the MMA's
// A-operand order). ModelOpt words: dec of the word shifted by 0, 4, 8, 12 (3-4 instructions a pair).
// TILED words (`cuda_mma.tile_weight` re-encodes each word; `_TILED_BITS` says where each bit lives): e3
// already sits at the FP16 pair's bits (one AND), e2 three bits lower (a shift and an AND), e1 and e0 with
// sign and magnitude apart by 5 and 7 bits, which one multiply by 2 + 64 (4 + 512) moves into place at
// once; the copies it leaves elsewhere are masked (2.25 instructions a pair).
__device__ __forceinline__ void pairs(u32 w, u32 (&p)[4], bool tiled = TILED) {
  if (tiled) {
    p[0] = w & 0x8E008E00u;
    p[1] = (w << 3) & 0x8E008E00u;
    p[2] = ((w & 0x40384038u) * 66u) & 0x8E008E00u;
    p[3] = ((w & 0x20072007u) * 516u) & 0x8E008E00u;
  } else {
    p[0] = dec(w);
    p[1] = dec(w << 4);
    p[2] = dec(w << 8);
    p[3] = dec(w << 12);
  }
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u16 s) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(s));
  return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// A thread's two e4m3 block scales of one row and chunk (blocks 2t and 2t+1) as FP16 pairs (s, s): sc[0]
// scales its words 0-1, sc[1] its words 2-3.
__device__ __forceinline__ void block_scales(u16 s, u32 (&sc)[2]) {
  const u32 f = e4m3x2_to_f16x2(s);
  sc[0] = prmt(f, f, 0x1010);
  sc[1] = prmt(f, f, 0x3232);
}

// A word of codes decoded (`pairs`) and multiplied by its block scale pair (exact in FP16), as the GEMM
// and the dequantizer both use it (tiled false: a ModelOpt word whatever TILED says, the activation's codes).
__device__ __forceinline__ void scaled_pairs(u32 w, u32 sc, u32 (&p)[4], bool tiled = TILED) {
  pairs(w, p, tiled);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = hmul2(p[i], sc);
}

// The four permuted FP16 pairs p of word wd of quarter tt of token m's chunk i, into the CTA's staged
// activations: [chunk][word][token][t] (mma.sync), or WGMMA's [chunk][word][mma half][k half][token][t] (pair h
// of the step's k halves).
__device__ __forceinline__ void stage_word(uint4* xs, int i, int wd, int m, int tt, const u32 (&p)[4]) {
#if WGMMA
  u32* rows = reinterpret_cast<u32*>(xs) + ((i * 4 + wd) * 4 * (NT * 8) + m) * 4 + tt;
#pragma unroll
  for (int h = 0; h < 4; ++h) rows[h * (NT * 8) * 4] = p[h];
#else
  xs[((i * 4 + wd) * (NT * 8) + m) * 4 + tt] = make_uint4(p[0], p[1], p[2], p[3]);
#endif
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {   // dst: a shared-memory address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

#if CLUSTER
// Every thread of the cluster's CTAs arrives (release: its shared-memory stores before) and waits (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Shared address `addr` of this CTA mapped to the cluster's CTA `rank`.
__device__ __forceinline__ u32 map_cluster(u32 addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// Four fp32 into another CTA's shared memory (cluster addresses), counted on its mbarrier `bar` (complete_tx).
__device__ __forceinline__ void st_async4(u32 addr, const float (&v)[4], u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(bar) : "memory");
}

// Initialises this CTA's mbarrier `bar` for one arrival, fenced so that the cluster's async copies may count on it.
__device__ __forceinline__ void mbar_init(u32 bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The one arrival on mbarrier `bar`, which then completes its phase once `bytes` have arrived (complete_tx).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Waits for phase 0 of this CTA's mbarrier `bar` (its expected bytes all arrived); acquire: they are visible.
// A protocol fault traps (a launch error) after ~2^22 polls (seconds) instead of hanging the device.
__device__ __forceinline__ void mbar_wait0(u32 bar) {
  u32 done = 0;
  for (u32 polls = 0; !done; ++polls) {
    if (polls == (1u << 22)) __trap();
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar) : "memory");
  }
}

// The fp32 at shared address `addr` of the cluster's CTA `rank`.
__device__ __forceinline__ float ld_cluster(u32 addr, u32 rank) {
  u32 remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float f16_to_f32(u16 v) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
  return r;
}

__device__ __forceinline__ u16 f32_to_f16(float v) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ u16 f32_to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// A value of the output dtype to FP32 and back, rounded once.
__device__ __forceinline__ float out_to_f32(u16 v) {
#if OUT_BF16
  return __uint_as_float(((u32)v) << 16);
#else
  return f16_to_f32(v);
#endif
}

__device__ __forceinline__ u16 f32_to_out(float v) {
#if OUT_BF16
  return f32_to_bf16(v);
#else
  return f32_to_f16(v);
#endif
}

// Where thread (g, t)'s 16 code bytes (and 2 scale bytes) of row g + 8 * half, chunk c live, in units of
// 16 (2) bytes. ModelOpt layout: row-major. TILED (`cuda_mma.tile_weight`): [N/16][K/128][half][g][t], so a
// warp's loads of one chunk read 2 x 512 contiguous code bytes and 128 contiguous scale bytes.
__device__ __forceinline__ size_t w_index(int n0, int g, int t, int half, int c, int K) {
#if TILED
  return ((((size_t)(n0 >> 4) * (K >> 7) + c) * 2 + half) * 8 + g) * 4 + t;
#else
  return (size_t)(n0 + g + 8 * half) * (K >> 5) + (size_t)c * 4 + t;
#endif
}

#if PREFETCH
// Chunks [c, c + n) of the 16-row tile at row n0 (tiled layout: contiguous, 1024 code bytes and 128 scale bytes a
// chunk) into L2, by one thread.
__device__ __forceinline__ void prefetch_l2(const uint4* codes, const u16* scales, int n0, int c, int n, int K) {
  const size_t i = w_index(n0, 0, 0, 0, c, K);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(codes + i), "r"(n * 1024) : "memory");
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(scales + i), "r"(n * 128) : "memory");
}
#endif

#if WGMMA
// The descriptor of one k16 step's B tile at shared address `addr` (K-major, no swizzle; the header's WGMMA):
// its low word (address >> 4 in bits 0-13, the leading-byte offset from bit 16) and the constant high word.
__device__ __forceinline__ u32 b_desc_lo(u32 addr) { return ((addr & 0x3FFFF) >> 4) | ((NT * 128 >> 4) << 16); }
// The descriptor of the tile `off16` x 16 bytes past the one whose low word is `lo`: the address field plus
// off16 (shared addresses stay under 2^18, so nothing carries out of the field), one add where a descriptor
// built from each step's address took ~6 uniform instructions (50 a chunk at NT = 4: Nsight by instruction,
// H100 sixteenth session).
__device__ __forceinline__ u64 b_desc_step(u32 lo, u32 off16) { return ((u64)(128 >> 4) << 32) | (lo + off16); }
#endif

// One chunk of one warp: rows g and g+8 (codes q0/q1, block-scale pairs s0/s1) times the staged activations
// (xs_d: the low word of their first tile's WGMMA descriptor, `b_desc_lo`).
__device__ __forceinline__ void compute_chunk(uint4 q0, uint4 q1, u16 s0, u16 s1, float (&acc)[NT][4],
                                              const uint4* xs, u32 xs_d, int c, int g, int t) {
  u32 sc0[2], sc1[2];                                   // rows g and g + 8
  block_scales(s0, sc0);
  block_scales(s1, sc1);
  const u32 w0[4] = {q0.x, q0.y, q0.z, q0.w};
  const u32 w1[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
    u32 pa[4], pb[4];                                   // rows g and g + 8
    scaled_pairs(w0[wd], sc0[wd >> 1], pa);
    scaled_pairs(w1[wd], sc1[wd >> 1], pb);
#if WGMMA
    const u32 a[8] = {pa[0], pb[0], pa[1], pb[1], pa[2], pb[2], pa[3], pb[3]};
    const u32 step = (c * 4 + wd) * (NT * 32);      // x 16 bytes: [chunk][word][half][k half][token][t]
    wgmma_k32(acc, a, b_desc_step(xs_d, step), b_desc_step(xs_d, step + NT * 16));
#else
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4 bx = xs[((c * 4 + wd) * (NT * 8) + j * 8 + g) * 4 + t];
      mma(acc[j], pa[0], pb[0], pa[1], pb[1], bx.x, bx.y);
      mma(acc[j], pa[2], pb[2], pa[3], pb[3], bx.z, bx.w);
    }
#endif
  }
}

// A warp's ring slot: codes [half][lane] (16 B each), then block scales [half][g][t] (2 B each) = 1152 B.
#define SLOT 72                                 // uint4 per slot

// One chunk of the warp's rows into the slot at shared address `dst` + this lane's offsets (or, past the
// slice's end, an empty group that keeps the count): each lane copies its own 2 x 16 code bytes and 4 scale
// bytes (row lane/2, scale pair (lane%2) * 2).
__device__ __forceinline__ void issue_chunk(u32 dst, int lane, const uint4* qa, const uint4* qb, const u16* sp,
                                            bool in_slice) {
  if (in_slice) {
    cp_async16(dst + 16 * lane, qa);
    cp_async16(dst + 512 + 16 * lane, qb);
    cp_async4(dst + 1024 + 4 * lane, sp);
  }
  cp_async_commit();
}

// The epilogue's scales of a thread's accumulators: S_dec of its tokens m0 + 8 j + 2 t + v (0 past m_end) and
// of its rows n0 + g + 8 h (0 past N).
__device__ __forceinline__ void epilogue_scales(float (&sa)[NT][2], float (&sw)[2], const float* __restrict__ x_gs,
                                                const float* __restrict__ w_gs, int w_gs_stride, int m0, int m_end,
                                                int n0, int g, int t, bool rows_ok) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int v = 0; v < 2; ++v) sa[j][v] = m0 + j * 8 + 2 * t + v < m_end ? x_gs[m0 + j * 8 + 2 * t + v] : 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) sw[h] = rows_ok ? w_gs[(size_t)(n0 + g + 8 * h) * w_gs_stride] : 0.f;
}

extern "C" __global__ void __launch_bounds__(RW * 32)
w4a16_mma(const uint4* __restrict__ w_codes,    // uint8 [N, K/2] as 16-byte vectors
          const u16* __restrict__ w_scales,     // e4m3 [N, K/16] as byte pairs
          const float* __restrict__ w_gs,       // fp32 S_dec: [N] (stride 1) or [] (stride 0)
          int w_gs_stride,
          const uint4* __restrict__ x,          // fp16 [M, K] exact e2m1 * s values (X_CODES: uint8 codes [M, K/2])
          const u16* __restrict__ x_scales,     // X_CODES: e4m3 block scales [M, K/16] as byte pairs; else null
          const float* __restrict__ x_gs,       // fp32 S_dec per token [M]
          const u16* __restrict__ bias,         // [N] in the output dtype, or null (OUT_F32: null)
          void* __restrict__ out_,              // [M, N] bf16 / fp16 (OUT_F32: fp32)
          float* __restrict__ partials,         // fp32 [S, M, N] when S > 1
          int* __restrict__ tickets,            // int32 [gridDim.x * gridDim.z], zero; left zero
          const int* __restrict__ tiles,        // grouped: int32 [3, gridDim.z] expert, first row, end row; or null
          int w_gs_expert_stride,               // grouped: floats between two experts' global scales
          int M, int N, int K,
          int cps) {                            // chunks of 128 K-elements per split (`cuda_mma._smem_bytes`)
  extern __shared__ uint4 xs[];                 // [chunk][word][token][t]: permuted fp16 pairs; then the rings
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int S = gridDim.y, split = blockIdx.y;
  const int chunks = K >> 7, c0 = split * cps, nc = min(cps, chunks - c0);
  int m0 = blockIdx.z * NT * 8, m_end = M;    // this CTA's rows [m0, min(m0 + NT * 8, m_end))
  if (tiles) {
    m0 = tiles[gridDim.z + blockIdx.z];
    m_end = tiles[2 * gridDim.z + blockIdx.z];
    if (m0 >= m_end) return;
    const size_t e = tiles[blockIdx.z];
    w_codes += e * N * (K >> 5);
    w_scales += e * N * (K >> 5);
    w_gs += e * w_gs_expert_stride;
  }
  int n0 = (blockIdx.x * RW + warp) * 16;    // PERSIST: the rows of the CTA's first tile, then of each next one
  bool rows_ok = n0 < N;

#if CLUSTER_PUSH
  // The owner side of the split-K push (3'): this CTA's mbarrier expects the bytes the other S - 1 CTAs push
  // for its warps' rows (warp % S == split). Initialised, armed and fenced for the cluster before the
  // cluster barrier's arrive, whose wait (before the pushes) makes it visible to them.
  __shared__ __align__(8) u64 red_bar;
  const u32 bar_s = smem_addr(&red_bar);
  if (S > 1) {
    if (threadIdx.x == 0) {
      mbar_init(bar_s);
      mbar_expect_tx(bar_s, (RW - split + S - 1) / S * (S - 1) * NT * 32 * 16);
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  }
#endif

  // 1. the first chunks of weights in flight, then the CTA's activations staged in shared memory,
  //    permuted into the weight's pair order. Each lane's sources at chunk c0 (codes of rows g and g + 8,
  //    the scale pair it copies) step by CSTEP vectors per chunk in both layouts.
  constexpr int CSTEP = TILED ? 64 : 4;
  const uint4* qa = w_codes + w_index(n0, g, t, 0, c0, K);
  const uint4* qb = w_codes + w_index(n0, g, t, 1, c0, K);
  const u16* sp = w_scales + w_index(n0, (lane >> 1) & 7, (lane & 1) * 2, lane >> 4, c0, K);
  const uint4* ring = xs + NT * 8 * cps * 16 + warp * STAGES * SLOT;
  const u32 ring_s = smem_addr(ring);
  // WGMMA: every warp of a warpgroup takes part in its MMAs, so warps past N run the loop on empty slots
  // (their accumulators are never stored); PERSIST: every warp streams every tile's chunk count, so that
  // the rings stay in step; otherwise they skip it
  const bool loop = WGMMA || PERSIST || rows_ok;
#if PERSIST
  // The issue side runs STAGES - 1 chunks ahead of the compute side, past a tile's last chunk into the
  // CTA's next tile (rows in0, chunk ic of the slice); tiles past the last have in0 >= N and issue empty
  // groups. w_index is linear in the row: the sources move by tjump from a tile's end to the next's start.
  const int row_tiles = (N + 16 * RW - 1) / (16 * RW), tstride = 16 * RW * gridDim.x;
  const size_t tjump = w_index(tstride, 0, 0, 0, 0, K) - (size_t)nc * CSTEP;
  int in0 = n0, ic = 0;
  auto issue = [&](int slot) {
    issue_chunk(ring_s + slot * SLOT * 16, lane, qa, qb, sp, in0 < N);
    qa += CSTEP, qb += CSTEP, sp += CSTEP;
    if (++ic == nc) ic = 0, qa += tjump, qb += tjump, sp += tjump, in0 += tstride;
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
#else
  if (loop)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i, qa += CSTEP, qb += CSTEP, sp += CSTEP)
      issue_chunk(ring_s + i * SLOT * 16, lane, qa, qb, sp, rows_ok && i < nc);
#endif
#if PREFETCH
  if (lane == 0 && rows_ok && nc > STAGES - 1) prefetch_l2(w_codes, w_scales, n0, c0 + STAGES - 1, nc - STAGES + 1, K);
#endif
  // launched as a programmatic dependent of the activation quantizer: its results are visible after this
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // Vector e of the slice: word wd of quarter tt of token m's chunk i. Each thread issues XSTAGE loads before
  // it permutes and stores the first, so the staging waits for one L2 round trip per XSTAGE vectors (the
  // compiler's own unroll issued 2). XSTAGE covers all of a thread's vectors where registers allow: at NT = 2
  // x 8 warps up to 8 chunks (the M <= 16 slices; with 4, two round trips: Nsight by instruction, H100
  // sixteenth session, 13.6% of the M = 16 stall samples on the first use of the loads), at NT = 1 x 4 warps
  // up to 4. Registers at sm_90 (tests/test_cuda_mma_sm90.py): NT 2 x 8 warps with clusters 74 (78 with 4),
  // with global split-K 88 (2 CTAs an SM); RW = 16 106; 8 at NT = 4, RW = 8 spilled (ptxas held those
  // 256-thread CTAs to 80 registers), and so did 4 under PERSIST, whose issue side stays live here: it keeps
  // the compiler's form.
#if X_CODES
  // Item e of the slice: quarter tt (32 values, blocks 2 tt and 2 tt + 1) of token m's chunk i: 16 code bytes
  // and a scale pair, decoded into the four words (wd) of that quarter, stored as the loaded form stores them.
  // XC items' loads in flight before the first decode.
  constexpr int XC = 4;
  const int items = NT * 8 * cps * 4;
  for (int e0 = threadIdx.x; e0 < items; e0 += XC * RW * 32) {
    uint4 qs[XC];
    u16 ss[XC];
#pragma unroll
    for (int u = 0; u < XC; ++u) {
      const int e = e0 + u * RW * 32, tt = e & 3, m = (e >> 2) % (NT * 8), i = (e >> 2) / (NT * 8);
      qs[u] = make_uint4(0, 0, 0, 0);
      ss[u] = 0;
      if (e < items && m0 + m < m_end && i < nc) {
        qs[u] = __ldg(x + (size_t)(m0 + m) * (K >> 5) + (c0 + i) * 4 + tt);
        ss[u] = __ldg(x_scales + (size_t)(m0 + m) * (K >> 5) + (c0 + i) * 4 + tt);
      }
    }
#pragma unroll
    for (int u = 0; u < XC; ++u) {
      const int e = e0 + u * RW * 32, tt = e & 3, m = (e >> 2) % (NT * 8), i = (e >> 2) / (NT * 8);
      if (e < items) {
        u32 sc[2];
        block_scales(ss[u], sc);
        const u32 words[4] = {qs[u].x, qs[u].y, qs[u].z, qs[u].w};
#pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
          u32 p[4];
          scaled_pairs(words[wd], sc[wd >> 1], p, false);
          stage_word(xs, i, wd, m, tt, p);
        }
      }
    }
  }
#else
  constexpr int XSTAGE = PERSIST ? 1 : RW >= 16 || NT == 2 ? 8 : 4;
  const int staged = NT * 8 * cps * 16;
  struct Vec { int wd, tt, m, i; };
  auto vec = [](int e) { return Vec{e & 3, (e >> 2) & 3, (e >> 4) % (NT * 8), (e >> 4) / (NT * 8)}; };
  for (int e0 = threadIdx.x; e0 < staged; e0 += XSTAGE * RW * 32) {
    uint4 vs[XSTAGE];
#pragma unroll
    for (int u = 0; u < XSTAGE; ++u) {
      const int e = e0 + u * RW * 32;
      const auto [wd, tt, m, i] = vec(e);
      vs[u] = make_uint4(0, 0, 0, 0);
      if (e < staged && m0 + m < m_end && i < nc)
        vs[u] = __ldg(x + ((size_t)(m0 + m) * K + (size_t)(c0 + i) * 128 + tt * 32 + wd * 8) / 8);
    }
#pragma unroll
    for (int u = 0; u < XSTAGE; ++u) {
      const int e = e0 + u * RW * 32;
      const auto [wd, tt, m, i] = vec(e);
      if (e < staged) {
        const uint4 v = vs[u];
        const u32 p[4] = {prmt(v.y, v.w, 0x7632), prmt(v.y, v.w, 0x5410), prmt(v.x, v.z, 0x7632), prmt(v.x, v.z, 0x5410)};
        stage_word(xs, i, wd, m, tt, p);
      }
    }
  }
#endif
#if WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the staged tiles, visible to the MMAs' reads
#endif
  __syncthreads();

#if WGMMA
  const u32 xs_d = b_desc_lo(smem_addr(xs));
#else
  const u32 xs_d = 0;
#endif
  int rd = 0, wr = STAGES - 1;             // the slots chunk c is read from and chunk c + STAGES - 1 lands in
  float acc[NT][4];
#if PERSIST
  // the split-K partial sums (CLUSTER) in a space of their own after the rings (the activations stay, the
  // rings hold the next tile's chunks)
  float* red_tiles = reinterpret_cast<float*>(xs + NT * 8 * cps * 16 + RW * STAGES * SLOT);
  for (int rt = blockIdx.x; rt < row_tiles; rt += gridDim.x, n0 += tstride) {
    rows_ok = n0 < N;
    bool store = true;                     // whether this CTA finishes the tile's rows (split-K)
    // the token rows made opaque per tile (no instruction): otherwise the compiler keeps the epilogue's row
    // offsets and scales, invariant across tiles, live through the main loop (+12 to +40 registers)
    asm volatile("" : "+r"(m0), "+r"(m_end));
#if PREFETCH
    if (lane == 0 && n0 + tstride < N) prefetch_l2(w_codes, w_scales, n0 + tstride, c0, nc, K);   // the next tile's
#endif
#endif

  // The epilogue's scales. Up to 16 tokens a CTA (NT <= 2), one tile a CTA loads them before the main loop,
  // where their latency hides: after it, the split-K's fence (MEMBAR.GPU, in the cluster barrier's release
  // too) waited for them (Nsight source counters, H100 sixteenth session: 3.9% + 3.1% of the M = 16
  // launch's stall samples on the two fences). Registers at sm_90: NT 2 x 8 warps 63 -> 78 with the staging's
  // 4 loads (3 CTAs an SM still; shared memory allows 3), NT 1 50-54 -> 56-62; at NT 4 and 8 the same change
  // cost 12-43 registers (a CTA fewer an SM), and PERSIST keeps values set before the main loop live through
  // its tile loop.
  constexpr bool early_scales = !PERSIST && NT <= 2;
  float sa[NT][2], sw[2];
  if (early_scales) epilogue_scales(sa, sw, x_gs, w_gs, w_gs_stride, m0, m_end, n0, g, t, rows_ok);

  // 2. decode and multiply each chunk while the next ones load
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  if (loop) {
#if PERSIST
    for (int c = 0; c < nc; ++c) {
#else
    for (int c = 0; c < nc; ++c, qa += CSTEP, qb += CSTEP, sp += CSTEP) {
#endif
      cp_async_wait<STAGES - 2>();         // chunk c has landed when at most STAGES - 2 groups are pending; the
      __syncwarp();                        // syncwarp also retires every lane's reads of the slot issued next
#if PERSIST
      issue(wr);
#else
      issue_chunk(ring_s + wr * SLOT * 16, lane, qa, qb, sp, rows_ok && c + STAGES - 1 < nc);
#endif
      const uint4* slot = ring + rd * SLOT;
      const u16* sc = reinterpret_cast<const u16*>(slot + 64);
      compute_chunk(slot[lane], slot[32 + lane], sc[lane], sc[32 + lane], acc, xs, xs_d, c, g, t);
      rd = rd == STAGES - 1 ? 0 : rd + 1;
      wr = wr == STAGES - 1 ? 0 : wr + 1;
    }
#if WGMMA
    wgmma_drain(acc);                      // the last word's MMAs, in flight until here
#endif
  }

  // 3. split-K: partial planes, the last CTA of the tile adds them in plane order (the epilogue's scales
  //    loaded here unless early_scales, their latency behind the stores)
  if (!early_scales) epilogue_scales(sa, sw, x_gs, w_gs, w_gs_stride, m0, m_end, n0, g, t, rows_ok);
#if CLUSTER_PUSH
  // 3'. split-K pushed through the cluster: warp's partials [NT][lane][4] go to slot (warp / S) * S + split of
  //     the landing space after the rings (ceil(RW / S) * S slots) in the CTA of rank warp % S, whose warp adds
  //     the S partials in rank order from 0.f (its own from registers) and finishes the rows; the others exit
  if (S > 1) {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");    // every CTA's mbarrier armed
    const float* land = reinterpret_cast<const float*>(xs + NT * 8 * cps * 16 + RW * STAGES * SLOT);
    const int owner = warp % S, slots = (warp / S) * S;
    if (owner != split) {
      const u32 dst = map_cluster(smem_addr(land + ((slots + split) * NT * 32 + lane) * 4), owner);
      const u32 bar = map_cluster(bar_s, owner);
#pragma unroll
      for (int j = 0; j < NT; ++j) st_async4(dst + j * 32 * 16, acc[j], bar);
      return;
    }
    mbar_wait0(bar_s);
    float own[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) own[j][v] = acc[j][v], acc[j][v] = 0.f;
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float4 p = s == split ? make_float4(own[j][0], own[j][1], own[j][2], own[j][3])
                                    : *reinterpret_cast<const float4*>(land + (((slots + s) * NT + j) * 32 + lane) * 4);
        acc[j][0] = __fadd_rn(acc[j][0], p.x), acc[j][1] = __fadd_rn(acc[j][1], p.y);
        acc[j][2] = __fadd_rn(acc[j][2], p.z), acc[j][3] = __fadd_rn(acc[j][3], p.w);
      }
  }
#elif CLUSTER
  // 3'. split-K through the cluster: partials [warp][j][v][lane] into this CTA's shared memory (the
  //     activations' and rings' space, free once every warp is past its last MMA; PERSIST: red_tiles), then
  //     the CTA of rank warp % S adds the S CTAs' partials of warp's rows in rank order and finishes them
  if (S > 1) {
#if PERSIST
    float* red = red_tiles + warp * NT * 4 * 32 + lane;
#else
    __syncthreads();
    float* red = reinterpret_cast<float*>(xs) + warp * NT * 4 * 32 + lane;
#endif
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) red[(j * 4 + v) * 32] = acc[j][v];
    cluster_sync();
    const bool mine = warp % S == split;
    if (mine) {
      const u32 red_s = smem_addr(red);
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
#if PERSIST
      // two token tiles a round (the issue side's registers stay live here: 16 loads in flight took 94
      // registers at NT = 4, RW = 8, a CTA fewer per SM); each element still adds ranks 0..S-1 in order
#pragma unroll
      for (int j0 = 0; j0 < NT; j0 += 2)
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int j = j0; j < j0 + 2 && j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[j][v] = __fadd_rn(acc[j][v], ld_cluster(red_s + (j * 4 + v) * 128, s));
#else
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[j][v] = __fadd_rn(acc[j][v], ld_cluster(red_s + (j * 4 + v) * 128, s));
#endif
    }
    cluster_sync();                      // no CTA exits, or writes the space again, while another still reads it
#if PERSIST
    store = mine;
#else
    if (!mine) return;
#endif
  }
#else
  if (S > 1) {
    if (rows_ok) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
          if (m < m_end) partials[((size_t)split * M + m) * N + n] = acc[j][v];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
#if PERSIST
      int* ticket = tickets + blockIdx.z * row_tiles + rt;
#else
      int* ticket = tickets + blockIdx.z * gridDim.x + blockIdx.x;
#endif
      last = atomicAdd(ticket, 1) == S - 1;
      if (last) *ticket = 0;
    }
    __syncthreads();
#if PERSIST
    store = last;
    if (store) {
#else
    if (!last) return;
    {                                    // the last CTA of the tile
#endif
    __threadfence();
    if (rows_ok) {
      // every element's planes are added in plane order from 0.f (the bits do not depend on the
      // schedule); the plane loop outside and unrolled keeps the loads of 4 planes x NT x 4 elements in flight
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
#pragma unroll kPlaneUnroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
            if (m < m_end) acc[j][v] = __fadd_rn(acc[j][v], __ldcg(partials + ((size_t)s * M + m) * N + n));
          }
    }
    }
  }
#endif

  // 4. epilogue: ((acc * 2^14) * S_dec_a) * S_dec_w + bias, rounded once (X_CODES: acc * 2^28, the same value)
#if PERSIST
  if (rows_ok && store)
#else
  if (!rows_ok) return;
#endif
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
      if (m < m_end) {
        // __fmul_rn / __fadd_rn: never contracted into an FMA (the reference rounds each step)
        float r = __fmul_rn(__fmul_rn(__fmul_rn(acc[j][v], kUnscale), sa[j][v & 1]), sw[v >> 1]);
#if OUT_F32
        reinterpret_cast<float*>(out_)[(size_t)m * N + n] = r;
#else
        if (bias) r = __fadd_rn(r, out_to_f32(bias[n]));
        reinterpret_cast<u16*>(out_)[(size_t)m * N + n] = f32_to_out(r);
#endif
      }
    }
#if PERSIST
  }
#endif
}

#if TILED
// A "mma_tiled" weight as bf16 [N, K], row-major: e2m1 * block scale (exact: <= 6 significant bits), no
// global scale. One thread per 16 code bytes (tile, chunk c, half, g, t: 32 elements of row
// 16 * tile + g + 8 * half starting at 128 c + 32 t), decoded by `scaled_pairs` as the GEMM does.
extern "C" __global__ void __launch_bounds__(256)
w4_dequant(const uint4* __restrict__ w_codes, const u16* __restrict__ w_scales, u16* __restrict__ out, int N, int K) {
  const size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= (size_t)N * (K >> 5)) return;
  const int t = u & 3, g = (u >> 2) & 7, half = (u >> 5) & 1, c = (int)((u >> 6) % (size_t)(K >> 7));
  const size_t row = (u >> 6) / (size_t)(K >> 7) * 16 + g + 8 * half;
  const uint4 q = w_codes[u];
  u32 sc[2];
  block_scales(w_scales[u], sc);
  const u32 w[4] = {q.x, q.y, q.z, q.w};
  uint4* dst = reinterpret_cast<uint4*>(out + row * K + (size_t)c * 128 + t * 32);
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
    u32 p[4];
    scaled_pairs(w[wd], sc[wd >> 1], p);
    u16 e[8];                                   // elements 8 wd .. 8 wd + 7: p[i] = (e[3 - i], e[7 - i])
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 v = p[i];
      const float lo = f16_to_f32((u16)(v & 0xFFFF)), hi = f16_to_f32((u16)(v >> 16));
      e[3 - i] = f32_to_bf16(__fmul_rn(lo, 16384.f));
      e[7 - i] = f32_to_bf16(__fmul_rn(hi, 16384.f));
    }
    dst[wd] = make_uint4(e[0] | ((u32)e[1] << 16), e[2] | ((u32)e[3] << 16), e[4] | ((u32)e[5] << 16),
                         e[6] | ((u32)e[7] << 16));
  }
}
#endif
