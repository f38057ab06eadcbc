/* ROT: the incoherence rotation x R of x staged in shared memory (kernel 3, kbit.ops.gemv_mma), before the MMA loop
   reads it. R = diag(signs) * blockdiag(H_b, ...) / sqrt(b) along K with b = ROT (a power of two >= 8 dividing K;
   signs int8 +1/-1, kbit.ops._rotation), the definition of kbit.ops.hadamard.rotate: signs, then log2(b) butterfly
   stages (a, c) -> (a + c, a - c), then 1/sqrt(b), all in float32, and one rounding to the activation dtype at the
   store (the row rotated is what the unrotated kernel stages: x, or the PRO norm's output rounded as it stores it).

   A thread takes 8 contiguous columns (one 16-byte vector; stages 1, 2, 4 in registers) and a warp 256 aligned
   columns (stages 8 .. 128 by warp shuffles): the loops that stage x (or apply the norm) do this on the vector
   they hold, so every staging loop runs in whole warps. Then, by ROT_MODE:
     1  b <= 256: the vector is rotated; stored as the staged value (no barrier added);
     2  b > 256, the scratch holds every staged row (ROT_ONE): the vector goes to the float32 scratch instead; after
        the barrier that ends the staging, a thread takes one column of a block's 256-column chunks (b / 256
        values at stride 256), ends the transform in registers and stores the staged values (one barrier added);
     3  b > 256, rows in rounds of ROT_SCR / b blocks: the staging is left as it is, and rotate_staged runs both
        passes on the staged rows a round at a time (1 + 2 a round barriers added).

   Defines: ROT (0: none; else b), ROT_SCR (floats of scratch, whole blocks; b > 256), ROT_ONE (1: mode 2). */
#ifndef ROT
#define ROT 0
#endif
#if ROT
#ifndef ROT_SCR
#define ROT_SCR 0
#endif
#ifndef ROT_ONE
#define ROT_ONE 0
#endif
#if ROT < 8 || (ROT & (ROT - 1))
#error "ROT: the rotation block must be a power of two >= 8"
#endif
#if ROT > 256 && (ROT_SCR < ROT || ROT_SCR % ROT)
#error "ROT_SCR: blocks over 256 columns need a float scratch of whole blocks"
#endif
#if !XS
#error "ROT: the rotation works on x staged in shared memory (XS)"
#endif
#define ROT_MODE (ROT <= 256 ? 1 : ROT_ONE ? 2 : 3)
#define ROT_SH (ROT < 256 ? ROT : 256) /* the block's columns a warp holds */
#define ROT_SC (1.0f / sqrtf((float)ROT))

/* the sign (+1 / -1) of column e of the 8 whose signs s holds */
__device__ __forceinline__ float rot_sign(const uint2& s, int e) {
  return (float)(int)(signed char)(((e < 4 ? s.x : s.y) >> (8 * (e & 3))) & 0xFFu);
}
/* f <- the 8 columns of v times their signs (sg: the signs of these columns, 8-byte aligned) */
__device__ __forceinline__ void rot_in(float (&f)[8], const V4& v, const signed char* sg) {
  const uint2 s = *(const uint2*)sg;
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = h2f((w[e >> 1] >> (16 * (e & 1))) & 0xFFFFu) * rot_sign(s, e);
}
/* the stages below 256 of 8 columns a lane, 256 columns a warp (every lane of the warp takes part) */
__device__ __forceinline__ void rot_low(float (&f)[8], u32 lane) {
#pragma unroll
  for (int h = 1; h < 8 && h < ROT; h <<= 1)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (!(e & h)) {
        const float a = f[e], c = f[e + h];
        f[e] = a + c;
        f[e + h] = a - c;
      }
#pragma unroll
  for (int m = 1; 8 * m < ROT_SH; m <<= 1) {  /* lane ^ m holds the columns 8 m away */
    const bool hi = lane & m;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float o = __shfl_xor_sync(0xffffffffu, f[e], m);
      f[e] = hi ? o - f[e] : f[e] + o;
    }
  }
}
__device__ __forceinline__ V4 rot_pack(const float (&f)[8]) {
  const float sc = ROT_SC;
  V4 r;
  r.x = (u32)f2h(f[0] * sc) | ((u32)f2h(f[1] * sc) << 16);
  r.y = (u32)f2h(f[2] * sc) | ((u32)f2h(f[3] * sc) << 16);
  r.z = (u32)f2h(f[4] * sc) | ((u32)f2h(f[5] * sc) << 16);
  r.w = (u32)f2h(f[6] * sc) | ((u32)f2h(f[7] * sc) << 16);
  return r;
}
__device__ __forceinline__ void rot_put(float* scr, int i, const float (&f)[8]) {
  float4* d = (float4*)(scr + 8 * i);
  d[0] = make_float4(f[0], f[1], f[2], f[3]);
  d[1] = make_float4(f[4], f[5], f[6], f[7]);
}
/* a staging loop's vector v (column vector c of a row that has nvr to rotate; sg: the row's signs) rotated as
   ROT_MODE says: returns the value to stage (mode 1), or puts it in the scratch at vector q (mode 2) */
__device__ __forceinline__ V4 rot_stage(const V4& v, int c, int nvr, const signed char* sg, float* scr, int q,
                                        u32 lane) {
  float f[8];
  if (c < nvr) {
    rot_in(f, v, sg + 8 * c);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = 0.0f;
  }
  rot_low(f, lane);
#if ROT_MODE == 2
  rot_put(scr, q, f);
  return v;
#else
  (void)scr; (void)q;
  return c < nvr ? rot_pack(f) : v;
#endif
}
#if ROT > 256
/* the second pass over nq blocks (blocks q0 .. of the staged rows, nbr a row; scratch block b = block q0 + b):
   the stages 256 .. b/2 across a block's chunks, the scale, the store to the staged rows */
__device__ __forceinline__ void rot_high(V4* sx, int xv, int q0, int nq, int nbr, const float* scr, u32 tid) {
  constexpr int R2 = ROT / 256;  /* 256-column chunks a block */
  for (int j = (int)tid; j < nq * 256; j += (int)blockDim.x) {  /* column cc of block q's chunks */
    const int b = j >> 8, cc = j & 255, q = q0 + b, tok = q / nbr;
    float h[R2];
#pragma unroll
    for (int r = 0; r < R2; ++r) h[r] = scr[b * ROT + 256 * r + cc];
#pragma unroll
    for (int s = 1; s < R2; s <<= 1)
#pragma unroll
      for (int r = 0; r < R2; ++r)
        if (!(r & s)) {
          const float a = h[r], c = h[r + s];
          h[r] = a + c;
          h[r + s] = a - c;
        }
    u16* d = (u16*)(sx + tok * xv) + (q - tok * nbr) * ROT + cc;
#pragma unroll
    for (int r = 0; r < R2; ++r) d[256 * r] = f2h(h[r] * ROT_SC);
  }
}
#endif
#if ROT_MODE == 3
/* mode 3: x R in place on the M staged rows (row stride xv vectors), columns [0, ncols) (whole blocks), both
   passes a round of ROT_SCR / b blocks at a time; sg: the signs of the staged columns. Every thread of the CTA
   calls it; the caller syncs before (rows staged) and after (the MMA loop reads). */
__device__ __forceinline__ void rotate_staged(V4* sx, int xv, int M, int ncols, const signed char* sg, float* scr,
                                              u32 tid, u32 lane) {
  constexpr int VB = ROT / 8, BPR = ROT_SCR / ROT;  /* vectors a block, blocks a round */
  const int nbr = ncols / ROT, nblk = M * nbr;
  for (int q0 = 0; q0 < nblk; q0 += BPR) {
    const int nq = min(BPR, nblk - q0);
    if (q0) __syncthreads();  /* the previous round's second pass has read the scratch */
    for (int i = (int)tid; i < nq * VB; i += (int)blockDim.x) {  /* VB % 32 == 0: whole warps */
      const int q = q0 + i / VB, tok = q / nbr, c = (q - tok * nbr) * VB + i % VB;
      float f[8];
      rot_in(f, sx[tok * xv + c], sg + 8 * c);
      rot_low(f, lane);
      rot_put(scr, i, f);
    }
    __syncthreads();
    rot_high(sx, xv, q0, nq, nbr, scr, tid);
  }
}
#endif
#endif
