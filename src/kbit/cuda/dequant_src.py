"""CUDA source of the dequantize kernel (``kbit.ops.dequant``): canonical layout -> float ``[..., N, K]``.

A thread takes U (row, 32-column) units: it first issues all their loads (code words: one 16-byte load at
k = 4, two at k = 3 and 5; the block scale), then per unit looks the 32 codes up in a shared-memory copy of
the codebook, multiplies in float32 in the reference's order (``codebook[c] * (tensor_scale * E[q])``, or
``* scale`` for fp16 scales) and writes the 32 outputs as 16-byte stores. Bit-exact with
``kbit.format.reference.dequantize_reference``.

Compiled by NVRTC with ``#define``s: K_BITS (2..5), BLOCKSIZE (32, 64, 128), FP16_SCALES (0/1), OUT (0 fp16,
1 bf16, 2 fp32), VEC (1: every row of the output starts 16-byte aligned and K is a multiple of 32, so all
stores are full vectors; 0: element stores guarded by K), U (units a thread), A16 (1: the plane-0 words of
every unit are aligned for one vector load: 16 bytes at k = 4, 5, 8 bytes at k = 2, 3).
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
struct __align__(16) V4 { u32 x, y, z, w; };
struct __align__(8) V2 { u32 x, y; };
struct __align__(16) F4 { float x, y, z, w; };

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if OUT == 1
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
__device__ __forceinline__ float half2float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

struct Unit { u32 pw[4]; u32 hi; u32 sraw; u32 row; int b; };

/* issue the loads of unit u (codes, plane-1 word, raw scale): nothing here waits on them */
__device__ __forceinline__ void load_unit(Unit& x, u32 u, const u32* __restrict__ codes,
                                          const u8* __restrict__ scales, int KP, int WROW, int NB, u32 UPR) {
  x.row = u / UPR;
  x.b = (int)(u - x.row * UPR);
  const int b = x.b;
  const u32* w = codes + (long long)x.row * WROW;
#if K_BITS <= 3
#if A16
  const V2 p = *(const V2*)(w + 2 * b);
  x.pw[0] = p.x; x.pw[1] = p.y;
#else
  x.pw[0] = w[2 * b]; x.pw[1] = w[2 * b + 1];
#endif
#if K_BITS == 3
  x.hi = w[KP / 16 + b];
#endif
#else
#if A16
  const V4 p = *(const V4*)(w + 4 * b);
  x.pw[0] = p.x; x.pw[1] = p.y; x.pw[2] = p.z; x.pw[3] = p.w;
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) x.pw[i] = w[4 * b + i];
#endif
#if K_BITS == 5
  x.hi = w[KP / 8 + b];
#endif
#endif
  const int blk = (b * 32) / BLOCKSIZE;
#if FP16_SCALES
  x.sraw = ((const u16*)scales)[(long long)x.row * NB + blk];
#else
  x.sraw = scales[(long long)x.row * NB + blk];
#endif
}

__device__ __forceinline__ u32 code_of(const Unit& x, int i) {
#if K_BITS == 2
  return (x.pw[i >> 4] >> (2 * (i & 15))) & 3u;
#elif K_BITS == 3
  return ((x.pw[i >> 4] >> (2 * (i & 15))) & 3u) | (((x.hi >> i) & 1u) << 2);
#elif K_BITS == 4
  return (x.pw[i >> 3] >> (4 * (i & 7))) & 15u;
#else
  return ((x.pw[i >> 3] >> (4 * (i & 7))) & 15u) | (((x.hi >> i) & 1u) << 4);
#endif
}

extern "C" __global__ void __launch_bounds__(256) kbit_dequant(
    const u32* __restrict__ codes, const u8* __restrict__ scales, const float* __restrict__ ts,
    const float* __restrict__ cb, const float* __restrict__ e_tab, void* __restrict__ out,
    u32 units, u32 N, int K, int KP, int WROW, int NB, u32 UPR) {
  __shared__ float s_cb[1 << K_BITS];
#if !FP16_SCALES
  __shared__ float s_e[256];
#endif
  /* U units a thread, consecutive threads on consecutive units (coalesced); loads first, then the tables */
  const u32 u0 = blockIdx.x * (blockDim.x * U) + threadIdx.x;
  Unit x[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const u32 u = u0 + j * blockDim.x;
    if (u < units) load_unit(x[j], u, codes, scales, KP, WROW, NB, UPR);
  }
#if !FP16_SCALES
  for (int i = threadIdx.x; i < 256; i += blockDim.x) s_e[i] = e_tab[i];
#endif
  for (int i = threadIdx.x; i < (1 << K_BITS); i += blockDim.x) s_cb[i] = cb[i];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const u32 u = u0 + j * blockDim.x;
    if (u >= units) break;
    const Unit& y = x[j];
#if FP16_SCALES
    const float s = half2float((u16)y.sraw);
#else
    const float s = ts[y.row / N] * s_e[y.sraw];
#endif
    const long long col0 = (long long)y.b * 32;
#if OUT == 2
    float* o = (float*)out + (long long)y.row * K + col0;
#if VEC
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
      F4 v = {s_cb[code_of(y, i)] * s, s_cb[code_of(y, i + 1)] * s, s_cb[code_of(y, i + 2)] * s,
              s_cb[code_of(y, i + 3)] * s};
      *(F4*)(o + i) = v;
    }
#else
#pragma unroll
    for (int i = 0; i < 32; ++i)
      if (col0 + i < K) o[i] = s_cb[code_of(y, i)] * s;
#endif
#else
    u16* o = (u16*)out + (long long)y.row * K + col0;
    u32 h[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) h[i] = pack2(s_cb[code_of(y, 2 * i)] * s, s_cb[code_of(y, 2 * i + 1)] * s);
#if VEC
#pragma unroll
    for (int i = 0; i < 16; i += 4) { V4 v = {h[i], h[i + 1], h[i + 2], h[i + 3]}; *(V4*)(o + 2 * i) = v; }
#else
#pragma unroll
    for (int i = 0; i < 32; ++i)
      if (col0 + i < K) o[i] = (u16)(h[i >> 1] >> (16 * (i & 1)));
#endif
#endif
  }
}
"""
