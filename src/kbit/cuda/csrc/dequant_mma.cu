/* kbit_deq_mma: dequantize a weight held in layout "mma-v1" straight to [N, K] (kbit.ops.gemv_mma.dequant_repacked:
   the dequantize + cuBLAS route of large M without an unrepacked temporary). A warp takes (tile, segment) items
   grid-stride, the next item's codes and scales in flight while one is written. The lookup is the kernels' own
   (lookup(), with a table of code indices instead of codebook halves), the value codebook[c] * scale in float32
   in the reference's order (kbit.format.reference: codebook[c] * (tensor_scale * E[q]); fp16 scales: times the
   tensor scale after), so the result is bit-exact with kbit.ops.dequant. A lane holds 8 consecutive columns
   (32u + 8t .. + 7) of rows g and g + 8 of each 32-column unit u: one 16-byte store each (VEC), else element
   stores guarded by K.

   Defines (-D options):
     K_BITS       2, 3, 4, 5
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     BF16         1: bf16 output, 0: fp16
     VEC          1: 16-byte stores (K % 8 == 0 and the output 16-byte aligned), 0: element stores */
#include "common.cuh"

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
/* item j = (tile, segment) of the codes / scales in b -> out */
__device__ __forceinline__ void deq_item(const V4 (&b)[K_BITS + SV], long long j, int n_seg, LB lbb, u32 sc_base,
                                         const float* s_cb, float ts, u16* __restrict__ out, int N, int K, int g,
                                         int t) {
  const int tile = (int)(j / n_seg), seg = (int)(j - (long long)tile * n_seg);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    u32 A[2][4];
    lookup((const u32*)b, u, lbb, A);
    const int col = seg * SEG + 32 * u + 8 * t;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = tile * 16 + g + 8 * r;
      const float s = scale_of(b + K_BITS, u, r, sc_base);
      float v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) {  /* column 8t + q = 4h + 2j + e: half e of A[h][r + 2j] */
        const u32 a = A[q >> 2][r + 2 * ((q >> 1) & 1)];
        v[q] = s_cb[(a >> (16 * (q & 1))) & 0xFFFFu] * s;
        if (FP16_SCALES) v[q] *= ts;
      }
      if (row >= N) continue;
      u16* o = out + (long long)row * K + col;
      if (VEC && col + 8 <= K) {
        const V4 w = {pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7])};
        *(V4*)o = w;
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (col + q < K) o[q] = (u16)(pack2(v[q], 0.0f) & 0xFFFFu);
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(256) kbit_deq_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, u16* __restrict__ out, int N, int K,
    int n_seg, int n_tiles) {
  __shared__ float s_cb[1 << K_BITS];
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 tid = threadIdx.x, lane = tid & 31, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long T = (long long)n_tiles * n_seg, stride = (long long)gridDim.x * W;
  long long j = (long long)blockIdx.x * W + (tid >> 5);
  V4 b[2][K_BITS + SV];
  if (j < T) ld_seg(b[0], codes, scales, j, lane, g);
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  build_table<true>((u32*)(dsm + (tab - dsm_base)), cb, tid, blockDim.x);
  const float ts = *ts_ptr;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : ts * e_tab[i];
  if (tid < (1u << K_BITS)) s_cb[tid] = cb[tid];
  __syncthreads();
  const LB lbb = lane_bits<true>(tab, lane, cb);
  const u32 sc_base = smem_addr(s_sc);
  for (; j < T; j += 2 * stride) {  /* two items an iteration: the buffers' indices stay compile-time */
    if (j + stride < T) ld_seg(b[1], codes, scales, j + stride, lane, g);
    deq_item(b[0], j, n_seg, lbb, sc_base, s_cb, ts, out, N, K, g, t);
    if (j + stride >= T) break;
    if (j + 2 * stride < T) ld_seg(b[0], codes, scales, j + 2 * stride, lane, g);
    deq_item(b[1], j + stride, n_seg, lbb, sc_base, s_cb, ts, out, N, K, g, t);
  }
}
