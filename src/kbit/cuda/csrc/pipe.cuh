/* The shared-memory pipeline of the mid- and large-M kernels (mma_pipe.cu, wgmma.cu): cp.async helpers, the
   stage layout, packed block scales folded into the A fragments, the table build.

   Defines read here (besides common.cuh's): D (pipeline stages), MAXW (warps a CTA), RT (16-row tiles a warp). */
#pragma once
#include "splitk.cuh"

__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(saddr), "l"(g) : "memory");
}
/* cp_async16 of 16 bytes that are read only where `in` (else 16 zero bytes are written; g is not read) */
__device__ __forceinline__ void cp_async16_z(u32 saddr, const void* g, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(saddr), "l"(g), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(D - 1) : "memory"); }
__device__ __forceinline__ void cp_wait_d2() {
  asm volatile("cp.async.wait_group %0;" :: "n"(D >= 2 ? D - 2 : 0) : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ V4 lds128(u32 a) {
  V4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}

/* mid M (9..64 tokens): a CTA = MAXW warps x RT row tiles (16 rows each) x one K split. Every 256-column
   segment's x[M][256], codes and scales go through a D-stage cp.async shared-memory pipeline (one CTA barrier a
   segment). x B fragments are read once per unit and used by the warp's RT tiles; block scales are folded into
   the A fragments (packed half2 multiply after the lookup), so every (tile, 8-token group) accumulates straight
   through its mma chain and the per-token-group cost is one LDS.128 and 2 mma per tile. */
#define XROW 576   /* bytes of one x row in a stage: 512 + 64 pad, conflict-free LDS.128 B fragments */
#define XSTAGE (8 * NG * XROW)
#define CSTAGE (MAXW * RT * K_BITS * 512)
#define SSTAGE (MAXW * RT * SV * 128)
#define STAGE4 (XSTAGE + CSTAGE + SSTAGE)
#if BF16
#define SPRE 1.0f
#else
#define SPRE 256.0f   /* log8 scales reach 2^-15.9: pre-scaled so that codebook x scale stays a normal half */
#endif
__shared__ u32 s_sc2[256];
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
#if BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}
/* packed (s, s) of unit u, row half r */
__device__ __forceinline__ u32 scale2(const u32* s, int u, int r, u32 sc2_base) {
#if FP16_SCALES
#if BF16
  const float f = h2f_f16((s[u] >> (16 * r)) & 0xFFFFu);
  u32 d; asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f)); return d;
#else
  u32 d; asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(s[u]), "r"(r ? 0x3232 : 0x1010)); return d;
#endif
#else
  return lds32(sc2_base + (byte_of(s[u >> 1], 2 * (u & 1) + r) << 2));
#endif
}
/* A = T with the block scales folded in: s0 on the rows g (registers 0, 2), s1 on the rows g + 8 (1, 3), both
   mma halves; A may be T */
__device__ __forceinline__ void fold_scales(u32 (&A)[2][4], const u32 (&T)[2][4], u32 s0, u32 s1) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    A[h][0] = hmul2(T[h][0], s0);
    A[h][2] = hmul2(T[h][2], s0);
    A[h][1] = hmul2(T[h][1], s1);
    A[h][3] = hmul2(T[h][3], s1);
  }
}
/* the code lookup table and the packed log8 scales (s, s), pre-multiplied by SPRE */
__device__ __forceinline__ void build_tables(u32 tab, const float* __restrict__ cb, const float* __restrict__ e_tab,
                                             u32 tid) {
  build_table_fast(tab, cb, tid, MAXW * 32);
  for (u32 i = tid; i < 256; i += MAXW * 32) {
    const u16 h = f2h(e_tab[i] * SPRE);
    s_sc2[i] = (u32)h | ((u32)h << 16);
  }
}
