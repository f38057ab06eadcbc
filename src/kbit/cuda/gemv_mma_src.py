"""CUDA source of the swap-AB tensor-core small-M kernel (``kbit.ops.gemv_mma``).

Compiled by NVRTC with ``#define``s: K_BITS (2..5), NG (8-token column groups: 1, 2, 4, 8), U (256-column
segments per warp step), BF16 (0/1: activation dtype), FP16_SCALES (0: log8 bytes, 1: fp16). No CUDA header
is included; PTX is inline.

Layout read (``kbit.ops.gemv_mma.repack``): per 16-row tile and 256-column segment, lane l = 4g + t of a warp
owns rows g, g + 8 and columns 32u + 8t .. 32u + 8t + 7 of each 32-column unit u = 0..7: 128 codes, stored as
a k-bit little-endian bit stream in 4k words (k 16-byte vectors, vector v of all 32 lanes contiguous). The
mma K index is permuted so that the B fragment of a lane is the 16 contiguous bytes x[token, 32u + 8t ..]:
mma h (0, 1) of unit u takes columns 8t + 4h + {0, 1} (b0 b1) and 8t + 4h + {2, 3} (b2 b3).
Scales per (tile, segment): [8 g][16] (byte / half 2u + r = row g + 8r, unit u), expanded to 32-column blocks.
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) V4 { u32 x, y, z, w; };
struct __align__(8) V2 { u32 x, y; };

#define SEG 256
#define MAXW 8
#define NW (4 * K_BITS)        /* code words per lane per segment */
#define SV (FP16_SCALES ? 2 : 1) /* scale vectors per lane per segment */

#if K_BITS == 2
#define TAB_WORDS (256 * 16 * 2)
#elif K_BITS == 3
#define TAB_WORDS (64 * 32)
#elif K_BITS == 4
#define TAB_WORDS (256 * 32)
#else
#define TAB_WORDS (32 * 32 / 2)
#endif

__shared__ __align__(16) u32 s_tab[TAB_WORDS];
__shared__ float s_sc[256];
__shared__ float s_red[NG * 128];
__shared__ int s_flag;

__device__ __forceinline__ V4 ld_stream(const V4* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ V4 ld_x(const void* p) {
  V4 r;
#if NG >= 4 /* keep the loads next to their use: hoisting all 8 units' B fragments would spill */
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#else
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#endif
  return r;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}
__device__ __forceinline__ float h2f_f16(u32 h) {
  float f; u16 s = (u16)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
  return f;
}
__device__ __forceinline__ float bits2f(u32 b) { float f; asm("mov.b32 %0, %1;" : "=f"(f) : "r"(b)); return f; }
__device__ __forceinline__ float h2f(u32 h) {
#if BF16
  return bits2f(h << 16);
#else
  return h2f_f16(h);
#endif
}

__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, const float (&c)[4]) {
#if BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#endif
               "{%10,%11,%12,%13};"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
                 "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
__device__ __forceinline__ void mma0(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#endif
               "{%10,%10,%10,%10};"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

/* F bits at stream bit P of w, moved to bit SH and masked (constant-folded after unrolling) */
__device__ __forceinline__ u32 fld(const u32* w, int P, int F, int SH) {
  const int j = P >> 5, o = P & 31;
  u32 v;
  if (o + F <= 32) v = (o >= SH) ? (w[j] >> (o - SH)) : (w[j] << (SH - o));
  else v = (u32)((((u64)w[j + 1] << 32) | (u64)w[j]) >> (o - SH));
  return v & (((1u << F) - 1u) << SH);
}
__device__ __forceinline__ u32 tab_base() { return (u32)__cvta_generic_to_shared(s_tab); }
__device__ __forceinline__ u32 lds32(u32 a) {
  u32 v; asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a + tab_base())); return v;
}
__device__ __forceinline__ V2 lds64(u32 a) {
  V2 v; asm("ld.shared.v2.b32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a + tab_base())); return v;
}
__device__ __forceinline__ u32 lds16(u32 a) {
  u16 v; asm("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(a + tab_base())); return v;
}

/* A fragments of unit u (mma h = 0, 1) from the lane's code words w */
__device__ __forceinline__ void lookup(const u32* w, int u, u32 lane, u32 (&A)[2][4]) {
#if K_BITS == 4
  const u32 lb = lane << 2;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int p = 0; p < 4; ++p)
      A[p >> 1][r + 2 * (p & 1)] = lds32(fld(w, (u * 16 + r * 8 + 2 * p) * 4, 8, 7) | lb);
#elif K_BITS == 3
  const u32 lb = lane << 2;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int p = 0; p < 4; ++p)
      A[p >> 1][r + 2 * (p & 1)] = lds32(fld(w, (u * 16 + r * 8 + 2 * p) * 3, 6, 7) | lb);
#elif K_BITS == 2
  const u32 lb = (lane & 15) << 3;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      V2 v = lds64(fld(w, (u * 16 + r * 8 + 4 * h) * 2, 8, 7) | lb);
      A[h][r] = v.x;
      A[h][r + 2] = v.y;
    }
#else
  const u32 lb = lane << 1;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int c = u * 16 + r * 8 + 2 * p;
      u32 lo = lds16(fld(w, c * 5, 5, 6) | lb);
      u32 hi = lds16(fld(w, (c + 1) * 5, 5, 6) | lb);
      A[p >> 1][r + 2 * (p & 1)] = lo | (hi << 16);
    }
#endif
}

__device__ __forceinline__ float scale_of(const V4* sv, int u, int r) {
#if FP16_SCALES
  const u32* s = (const u32*)sv;       /* 16 halves: index 2u + r */
  return h2f_f16((s[u] >> (16 * r)) & 0xFFFFu);
#else
  const u32* s = (const u32*)sv;       /* 16 bytes: index 2u + r */
  return s_sc[(s[u >> 1] >> (8 * (2 * (u & 1) + r))) & 0xFFu];
#endif
}

extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int steps_per_split,
    int bias_kind, int ws_stride) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float ts = *ts_ptr;
  /* ---- tables ---- */
#if K_BITS == 4
  for (u32 i = tid; i < 256 * 32; i += blockDim.x) {
    const u32 e = i >> 5;
    s_tab[i] = (u32)f2h(cb[e & 15]) | ((u32)f2h(cb[e >> 4]) << 16);
  }
#elif K_BITS == 3
  for (u32 i = tid; i < 64 * 32; i += blockDim.x) {
    const u32 e = i >> 5;
    s_tab[i] = (u32)f2h(cb[e & 7]) | ((u32)f2h(cb[e >> 3]) << 16);
  }
#elif K_BITS == 2
  for (u32 i = tid; i < 256 * 16; i += blockDim.x) {
    const u32 e = i >> 4;
    s_tab[2 * i] = (u32)f2h(cb[e & 3]) | ((u32)f2h(cb[(e >> 2) & 3]) << 16);
    s_tab[2 * i + 1] = (u32)f2h(cb[(e >> 4) & 3]) | ((u32)f2h(cb[e >> 6]) << 16);
  }
#else
  for (u32 i = tid; i < 32 * 32; i += blockDim.x) ((u16*)s_tab)[i] = f2h(cb[i >> 5]);
#endif
  const float post = FP16_SCALES ? ts : 1.0f;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i] * ts;
  for (u32 i = tid; i < NG * 128; i += blockDim.x) s_red[i] = 0.0f;
  __syncthreads();

  const int nsteps = n_seg / U;
  const int items = n_tiles * splits;
  /* x rows of this lane's B column per group (clamped: columns >= M are computed and dropped) */
  const u16* xr[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    int tok = ng * 8 + g;
    tok = tok < M ? tok : M - 1;
    xr[ng] = x + (long long)tok * x_stride + 8 * t;
  }
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / splits, sp = item - tile * splits;
    const int s0 = sp * steps_per_split;
    const int s1 = min(s0 + steps_per_split, nsteps);
    float acc[NG][4];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
    int st = s0 + (int)warp;
    if (st < s1) {
      const V4* cbase = codes + (long long)tile * n_seg * (K_BITS * 32) + lane;
      const V4* sbase = scales + ((long long)tile * n_seg * 8 + g) * SV;
      V4 cw[U][K_BITS], sw[U][SV];
#pragma unroll
      for (int uu = 0; uu < U; ++uu) {
#pragma unroll
        for (int v = 0; v < K_BITS; ++v) cw[uu][v] = ld_stream(cbase + ((long long)(st * U + uu) * K_BITS + v) * 32);
#pragma unroll
        for (int v = 0; v < SV; ++v) sw[uu][v] = ld_stream(sbase + (long long)(st * U + uu) * 8 * SV + v);
      }
      for (; st < s1; st += W) {
        int nx = st + (int)W;
        nx = nx < s1 ? nx : s1 - 1;
        V4 nw[U][K_BITS], ns[U][SV];
#pragma unroll
        for (int uu = 0; uu < U; ++uu) {
#pragma unroll
          for (int v = 0; v < K_BITS; ++v) nw[uu][v] = ld_stream(cbase + ((long long)(nx * U + uu) * K_BITS + v) * 32);
#pragma unroll
          for (int v = 0; v < SV; ++v) ns[uu][v] = ld_stream(sbase + (long long)(nx * U + uu) * 8 * SV + v);
        }
#pragma unroll
        for (int uu = 0; uu < U; ++uu) {
          const u32* w = (const u32*)cw[uu];
          const int col0 = (st * U + uu) * SEG;
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            V4 xb[NG];
#pragma unroll
            for (int ng = 0; ng < NG; ++ng) xb[ng] = ld_x(xr[ng] + col0 + 32 * u);
            u32 A[2][4];
            lookup(w, u, lane, A);
            const float s0v = scale_of(sw[uu], u, 0), s1v = scale_of(sw[uu], u, 1);
#pragma unroll
            for (int ng = 0; ng < NG; ++ng) {
              float d[4];
              mma0(d, A[0], xb[ng].x, xb[ng].y);
              mma(d, A[1], xb[ng].z, xb[ng].w, d);
              acc[ng][0] += d[0] * s0v;
              acc[ng][1] += d[1] * s0v;
              acc[ng][2] += d[2] * s1v;
              acc[ng][3] += d[3] * s1v;
            }
          }
        }
#pragma unroll
        for (int uu = 0; uu < U; ++uu) {
#pragma unroll
          for (int v = 0; v < K_BITS; ++v) cw[uu][v] = nw[uu][v];
#pragma unroll
          for (int v = 0; v < SV; ++v) sw[uu][v] = ns[uu][v];
        }
      }
      /* ---- reduce the warps of the CTA ---- */
#pragma unroll
      for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(&s_red[(ng * 4 + c) * 32 + lane], acc[ng][c]);
    }
    __syncthreads();
    bool last = splits == 1;
    for (u32 e = tid; e < NG * 128; e += blockDim.x) {
      const u32 c = (e >> 5) & 3, l = e & 31;
      const int row = tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
      const int tok = (int)(e >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
      float v = s_red[e] * post;
      s_red[e] = 0.0f;
      if (row < N && tok < M) {
        if (last) {
          if (bias_kind == 1) v += h2f_f16(((const u16*)bias)[row]);
          else if (bias_kind == 2) v += bits2f((u32)((const u16*)bias)[row] << 16);
          else if (bias_kind == 3) v += ((const float*)bias)[row];
          y[(long long)tok * y_stride + row] = f2h(v);
        } else {
          atomicAdd(&ws[(long long)tok * ws_stride + row], v);
        }
      }
    }
    if (!last) {
      __threadfence();
      __syncthreads();
      if (tid == 0) s_flag = atomicAdd(&cnt[tile], 1) == splits - 1;
      __syncthreads();
      if (s_flag) {
        __threadfence();
        for (u32 e = tid; e < NG * 128; e += blockDim.x) {
          const u32 c = (e >> 5) & 3, l = e & 31;
          const int row = tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
          const int tok = (int)(e >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
          if (row < N && tok < M) {
            float* p = &ws[(long long)tok * ws_stride + row];
            float v;
            asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
            *p = 0.0f;
            if (bias_kind == 1) v += h2f_f16(((const u16*)bias)[row]);
            else if (bias_kind == 2) v += bits2f((u32)((const u16*)bias)[row] << 16);
            else if (bias_kind == 3) v += ((const float*)bias)[row];
            y[(long long)tok * y_stride + row] = f2h(v);
          }
        }
        if (tid == 0) cnt[tile] = 0;
      }
    }
    __syncthreads();
  }
}
"""
