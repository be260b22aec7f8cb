// Small-M exact W4A4 linear for sm_90 on FP16 tensor cores (mma.sync.m16n8k16, FP32 accumulation).
// Compiled at run time by NVRTC (kernels/cuda_mma.py); no headers. The host defines
//   NT        token tiles of 8 per CTA (1, 2 or 4; `cuda_mma.TILES` by M); more tokens loop over gridDim.z
//   RW        16-row weight tiles per CTA, one per warp (all share the CTA's staged activations)
//   OUT_BF16  1: bf16 output and bias, 0: fp16
//   TILED     1: weight codes and scales in the tiled order of `cuda_mma.tile_weight`, 0: ModelOpt row-major
//
// Operands. Weight: ModelOpt NVFP4 as stored (codes uint8 [N, K/2], even element in the low nibble;
// e4m3 scales [N, K/16]; FP32 S_dec [N] or []), read in place, no repacking. Activation: exact FP16
// values e2m1(q_a) * s_a [M, K] and FP32 S_dec_a [M] from the per-token quantizer.
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
// Reduction order. Each output element is summed in a fixed order that depends on (N, K) and the
// launch constants only, never on M or on the other tokens: k16 steps in order inside a warp, then
// the split-K planes in order 0..S-1 by the last CTA of a tile (atomic ticket). Deterministic and
// batch-invariant.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 dec(u32 w) { return (w & 0x80008000u) | ((w & 0x70007000u) >> 3); }

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

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float out_to_f32(u16 v) {
#if OUT_BF16
  return __uint_as_float(((u32)v) << 16);
#else
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
  return r;
#endif
}

__device__ __forceinline__ u16 f32_to_out(float v) {
  u16 r;
#if OUT_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
  return r;
}

#define G 4                                     // chunks per pipeline group

struct Group {                                  // one group's weight registers: codes and scales, rows g and g+8
  uint4 q0[G], q1[G];
  u16 s0[G], s1[G];
};

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

__device__ __forceinline__ void load_group(Group& b, const uint4* w_codes, const u16* w_scales, int n0, int g, int t,
                                           int K, int c, int nc) {
#pragma unroll
  for (int i = 0; i < G; ++i) {
    if (c + i < nc) {
      const size_t i0 = w_index(n0, g, t, 0, c + i, K), i1 = w_index(n0, g, t, 1, c + i, K);
      b.q0[i] = ld_stream(w_codes + i0);
      b.q1[i] = ld_stream(w_codes + i1);
      b.s0[i] = __ldg(w_scales + i0);
      b.s1[i] = __ldg(w_scales + i1);
    }
  }
}

__device__ __forceinline__ void compute_group(const Group& b, float (&acc)[NT][4], const uint4* xs, int c, int nc,
                                              int g, int t) {
#pragma unroll
  for (int i = 0; i < G; ++i) {
    if (c + i < nc) {
      const u32 f0 = e4m3x2_to_f16x2(b.s0[i]), f1 = e4m3x2_to_f16x2(b.s1[i]);
      const u32 w0[4] = {b.q0[i].x, b.q0[i].y, b.q0[i].z, b.q0[i].w};
      const u32 w1[4] = {b.q1[i].x, b.q1[i].y, b.q1[i].z, b.q1[i].w};
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        const u32 sel = wd < 2 ? 0x1010 : 0x3232;          // words 0-1: block 2t, words 2-3: block 2t+1
        const u32 sa = prmt(f0, f0, sel), sb = prmt(f1, f1, sel);
        const u32 a = w0[wd], bb = w1[wd];
        const u32 a0 = hmul2(dec(a), sa), a1 = hmul2(dec(bb), sb);
        const u32 a2 = hmul2(dec(a << 4), sa), a3 = hmul2(dec(bb << 4), sb);
        const u32 a4 = hmul2(dec(a << 8), sa), a5 = hmul2(dec(bb << 8), sb);
        const u32 a6 = hmul2(dec(a << 12), sa), a7 = hmul2(dec(bb << 12), sb);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 bx = xs[(((c + i) * 4 + wd) * (NT * 8) + j * 8 + g) * 4 + t];
          mma(acc[j], a0, a1, a2, a3, bx.x, bx.y);
          mma(acc[j], a4, a5, a6, a7, bx.z, bx.w);
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(RW * 32)
w4a16_mma(const uint4* __restrict__ w_codes,    // uint8 [N, K/2] as 16-byte vectors
          const u16* __restrict__ w_scales,     // e4m3 [N, K/16] as byte pairs
          const float* __restrict__ w_gs,       // fp32 S_dec: [N] (stride 1) or [] (stride 0)
          int w_gs_stride,
          const uint4* __restrict__ x,          // fp16 [M, K] exact e2m1 * s values
          const float* __restrict__ x_gs,       // fp32 S_dec per token [M]
          const u16* __restrict__ bias,         // [N] in the output dtype, or null
          u16* __restrict__ out,                // [M, N] bf16 / fp16
          float* __restrict__ partials,         // fp32 [S, M, N] when S > 1
          int* __restrict__ tickets,            // int32 [gridDim.x * gridDim.z], zero; left zero
          int M, int N, int K,
          int cps) {                            // chunks of 128 K-elements per split (dynamic smem: cps * NT * 2 KiB)
  extern __shared__ uint4 xs[];                 // [chunk][word][token][t]: permuted fp16 pairs
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int S = gridDim.y, split = blockIdx.y;
  const int chunks = K >> 7, c0 = split * cps, nc = min(cps, chunks - c0);
  const int m0 = blockIdx.z * NT * 8;
  const int n0 = (blockIdx.x * RW + warp) * 16;
  const bool rows_ok = n0 < N;

  // 1. the first two groups of weight loads in flight, then the CTA's activations staged in shared
  //    memory, permuted into the weight's pair order
  Group A, B;
  if (rows_ok) {
    load_group(A, w_codes, w_scales, n0, g, t, K, c0, c0 + nc);
    load_group(B, w_codes, w_scales, n0, g, t, K, c0 + G, c0 + nc);
  }
  // launched as a programmatic dependent of the activation quantizer: its results are visible after this
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int e = threadIdx.x; e < NT * 8 * cps * 16; e += RW * 32) {
    const int wd = e & 3, tt = (e >> 2) & 3, i = (e >> 4) % cps, m = (e >> 4) / cps;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m0 + m < M && i < nc)
      v = __ldg(x + ((size_t)(m0 + m) * K + (size_t)(c0 + i) * 128 + tt * 32 + wd * 8) / 8);
    xs[((i * 4 + wd) * (NT * 8) + m) * 4 + tt] = make_uint4(prmt(v.y, v.w, 0x7632), prmt(v.y, v.w, 0x5410),
                                                            prmt(v.x, v.z, 0x7632), prmt(v.x, v.z, 0x5410));
  }
  __syncthreads();

  // 2. decode and multiply one group while the next one loads (register double buffer)
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  if (rows_ok) {
    for (int c = 0; c < nc; c += 2 * G) {
      compute_group(A, acc, xs, c, nc, g, t);
      if (c + 2 * G < nc) load_group(A, w_codes, w_scales, n0, g, t, K, c0 + c + 2 * G, c0 + nc);
      if (c + G < nc) compute_group(B, acc, xs, c + G, nc, g, t);
      if (c + 3 * G < nc) load_group(B, w_codes, w_scales, n0, g, t, K, c0 + c + 3 * G, c0 + nc);
    }
  }

  // 3. split-K: partial planes, the last CTA of the tile adds them in plane order
  if (S > 1) {
    if (rows_ok) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
          if (m < M) partials[((size_t)split * M + m) * N + n] = acc[j][v];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      int* ticket = tickets + blockIdx.z * gridDim.x + blockIdx.x;
      last = atomicAdd(ticket, 1) == S - 1;
      if (last) *ticket = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (rows_ok) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
          float sum = 0.f;
          if (m < M)
            for (int s = 0; s < S; ++s) sum = __fadd_rn(sum, __ldcg(partials + ((size_t)s * M + m) * N + n));
          acc[j][v] = sum;
        }
    }
  }

  // 4. epilogue: ((acc * 2^14) * S_dec_a) * S_dec_w + bias, rounded once
  if (!rows_ok) return;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int m = m0 + j * 8 + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
      if (m < M) {
        // __fmul_rn / __fadd_rn: never contracted into an FMA (the reference rounds each step)
        float r = __fmul_rn(__fmul_rn(__fmul_rn(acc[j][v], 16384.f), x_gs[m]), w_gs[(size_t)n * w_gs_stride]);
        if (bias) r = __fadd_rn(r, out_to_f32(bias[n]));
        out[(size_t)m * N + n] = f32_to_out(r);
      }
    }
}
