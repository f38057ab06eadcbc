/* kbit_dequant: dequantize the canonical layout to float [..., N, K] (kbit.ops.dequant).

   A thread takes U groups of 8 columns of a row (consecutive lanes on consecutive groups: a warp's store is 512
   contiguous bytes): it first issues all their loads (the word holding the 8 codes, the plane-1 byte at k = 3, 5,
   the block scale), then looks the codes up in a shared-memory copy of the codebook, multiplies in float32 in the
   reference's order (codebook[c] * (tensor_scale * E[q]), or * scale for fp16 scales) and writes one 16-byte
   vector (bf16/fp16). Bit-exact with kbit.format.reference.

   Defines (-D options; kbit.ops.dequant sets them):
     K_BITS       2, 3, 4, 5
     BLOCKSIZE    32, 64, 128
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     OUT          output dtype: 0 fp16, 1 bf16, 2 fp32
     VEC          1: every output row starts 16-byte aligned and K % 8 == 0 (full vector stores), 0: element
                  stores guarded by K
     U            8-column groups a thread (loads in flight) */
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

/* codes of 8-column group g (columns 8g .. 8g+7) of a row: 4 bits each in one word (low nibble first) */
__device__ __forceinline__ u32 group_codes(const u32* __restrict__ w, u32 g, int KP, u32& hi8) {
#if K_BITS == 2
  hi8 = 0;
  return w[g >> 1] >> (16 * (g & 1));            /* 8 x 2 bits in the low 16 */
#elif K_BITS == 3
  hi8 = (w[KP / 16 + (g >> 2)] >> (8 * (g & 3))) & 0xFFu;
  return w[g >> 1] >> (16 * (g & 1));
#elif K_BITS == 4
  hi8 = 0;
  return w[g];
#else
  hi8 = (w[KP / 8 + (g >> 2)] >> (8 * (g & 3))) & 0xFFu;
  return w[g];
#endif
}
__device__ __forceinline__ u32 code_at(u32 lo, u32 hi8, int i) {
#if K_BITS == 2
  return (lo >> (2 * i)) & 3u;
#elif K_BITS == 3
  return ((lo >> (2 * i)) & 3u) | (((hi8 >> i) & 1u) << 2);
#elif K_BITS == 4
  return (lo >> (4 * i)) & 15u;
#else
  return ((lo >> (4 * i)) & 15u) | (((hi8 >> i) & 1u) << 4);
#endif
}

/* Thread-per-8-column-group mapping: consecutive lanes take consecutive groups, so one warp store writes 512
   contiguous bytes (bf16) and one warp load reads contiguous words. U groups a thread, loads issued first. */
extern "C" __global__ void __launch_bounds__(256) kbit_dequant(
    const u32* __restrict__ codes, const u8* __restrict__ scales, const float* __restrict__ ts,
    const float* __restrict__ cb, const float* __restrict__ e_tab, void* __restrict__ out,
    u32 N, int K, int KP, int WROW, int NB, u32 GPR) {
  __shared__ float s_cb[1 << K_BITS];
#if !FP16_SCALES
  __shared__ float s_e[256];
#endif
  /* grid (rows, group chunks): no division per group */
  const u32 row = blockIdx.x;
  const u32 g0 = blockIdx.y * (blockDim.x * U) + threadIdx.x;
  const u32* w = codes + (long long)row * WROW;
  u32 lo[U], hi[U], sraw[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const u32 g = g0 + j * blockDim.x;
    lo[j] = 0; hi[j] = 0; sraw[j] = 0;
    if (g < GPR) {
      lo[j] = group_codes(w, g, KP, hi[j]);
      const int blk = (int)(g * 8) / BLOCKSIZE;
#if FP16_SCALES
      sraw[j] = ((const u16*)scales)[(long long)row * NB + blk];
#else
      sraw[j] = scales[(long long)row * NB + blk];
#endif
    }
  }
#if !FP16_SCALES
  for (int i = threadIdx.x; i < 256; i += blockDim.x) s_e[i] = e_tab[i];
#endif
  for (int i = threadIdx.x; i < (1 << K_BITS); i += blockDim.x) s_cb[i] = cb[i];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const u32 g = g0 + j * blockDim.x;
    if (g >= GPR) break;
#if FP16_SCALES
    const float s = half2float((u16)sraw[j]);
#else
    const float s = ts[row / N] * s_e[sraw[j]];
#endif
    const long long col0 = (long long)g * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = s_cb[code_at(lo[j], hi[j], i)] * s;
#if OUT == 2
    float* o = (float*)out + (long long)row * K + col0;
#if VEC
    F4 a = {v[0], v[1], v[2], v[3]}, b = {v[4], v[5], v[6], v[7]};
    *(F4*)o = a;
    *(F4*)(o + 4) = b;
#else
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (col0 + i < K) o[i] = v[i];
#endif
#else
    u16* o = (u16*)out + (long long)row * K + col0;
    const u32 h0 = pack2(v[0], v[1]), h1 = pack2(v[2], v[3]), h2 = pack2(v[4], v[5]), h3 = pack2(v[6], v[7]);
#if VEC
    V4 a = {h0, h1, h2, h3};
    *(V4*)o = a;
#else
    const u32 h[4] = {h0, h1, h2, h3};
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (col0 + i < K) o[i] = (u16)(h[i >> 1] >> (16 * (i & 1)));
#endif
#endif
  }
}
