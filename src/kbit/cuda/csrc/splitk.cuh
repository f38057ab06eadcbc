/* The swap-AB kernels' shared parts: one segment's mma chain (segment), the output store (store_tile) and the
   split-K fix-up through the fp32 workspace (finish, add_partials, take_store4), the fast table build.

   Defines read here besides common.cuh's: WS4 (default 0; NG > 1 only) selects the workspace layout, M1
   (default 0) drops the accumulators of token 2t + 1 (M = 1). */
#pragma once
#include "common.cuh"

#ifndef M1 /* 1 = M is 1 (the segment skips the accumulators of token 2t + 1) */
#define M1 0
#endif

/* one 256-column segment of one 16-row tile: codes w (4k words), scales sw, x pointers xs (column 0 of the
   segment) -> acc; TAIL (the segment that holds column kx of an XT build reading x from global memory): lim =
   x's columns left from the segment's column 0, the lane's 8-column vectors from there on read as zero (x staged
   in shared memory was zeroed there). The other segments run the code of a build without XT. */
template <bool TAIL>
__device__ __forceinline__ void segment_t(const u32* w, const V4* sw, const u16* const* xs, LB lbb, u32 sc_base,
                                          float (&acc)[NG][4], int lim) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    V4 xb[NG];
    const bool in = !TAIL || 32 * u + 8 * (int)(threadIdx.x & 3) < lim;
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) xb[ng] = in ? ld_x(xs[ng] + 32 * u) : V4{0u, 0u, 0u, 0u};
    u32 A[2][4];
    lookup(w, u, lbb, A);
    const float s0v = scale_of(sw, u, 0, sc_base), s1v = scale_of(sw, u, 1, sc_base);
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      float d[4];
      mma0(d, A[0], xb[ng].x, xb[ng].y);
      mma(d, A[1], xb[ng].z, xb[ng].w, d);
      acc[ng][0] += d[0] * s0v;
#if !M1 /* M1: one token; d[1], d[3] are token 2t + 1 >= 1, never stored */
      acc[ng][1] += d[1] * s0v;
#endif
      acc[ng][2] += d[2] * s1v;
#if !M1
      acc[ng][3] += d[3] * s1v;
#endif
    }
  }
}

__device__ __forceinline__ void segment(const u32* w, const V4* sw, const u16* const* xs, LB lbb, u32 sc_base,
                                        float (&acc)[NG][4], int lim) {
#if XT && !XS
  if (lim < SEG) {
    segment_t<true>(w, sw, xs, lbb, sc_base, acc, lim);
    return;
  }
#endif
  segment_t<false>(w, sw, xs, lbb, sc_base, acc, lim);
}

/* bias[row] as float (bias_kind 0: none, 1: fp16, 2: bf16, 3: fp32) */
__device__ __forceinline__ float bias_of(const void* __restrict__ bias, int bias_kind, int row) {
  if (bias_kind == 1) return h2f_f16(((const u16*)bias)[row]);
  if (bias_kind == 2) return bits2f((u32)((const u16*)bias)[row] << 16);
  if (bias_kind == 3) return ((const float*)bias)[row];
  return 0.0f;
}

/* after a warp's partial sums are written: count its contrib segments on cnt[c_idx]; true in every lane of the warp
   whose count completes total (it then reads the sums back) */
__device__ __forceinline__ bool arrive(int* __restrict__ cnt, int c_idx, int contrib, int total, u32 lane) {
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(&cnt[c_idx], contrib) == total - contrib;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last) __threadfence();
  return last;
}

/* The fp32 workspace of split tiles (zero at rest). WS4 (NG > 1): a tile's partial sums are NG * 128 consecutive
   floats, the four accumulator values of (8-token group ng, lane) at ws_at(tile, ng, lane), so that one vector
   reduction (sm_90: red.global.add.v4.f32) adds a lane's four values and the reader takes them back with one
   16-byte load. A lane's values are rows g, g + 8 of the tile and tokens 8 ng + 2 t, + 1; entries of rows >= N or
   tokens >= M hold whatever the kernel computed there and are never written out. WS4 = 0: [M, N] (row stride
   ws_stride), one atomic a value. The vector form wins where many parts add to a tile (contention) and loses where
   few do (its read-back waits for one 16-byte load at a time) and at M = 1, where half a lane's values are past M. */
#ifndef WS4
#define WS4 0 /* kbit.ops.gemv_mma.plan sets it where a tile has many parts (WS4_PARTS); NG > 1 only */
#endif
#if WS4 && NG == 1
#error "WS4 needs NG > 1"
#endif
__device__ __forceinline__ float* ws_at(float* __restrict__ ws, int tile, int ng, u32 lane) {
  return ws + ((long long)tile * NG + ng) * 128 + lane * 4;
}
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}
/* the lane's four sums of (tile, ng), read back and zeroed by the warp that completed the tile's count */
__device__ __forceinline__ float4 take4(float* __restrict__ ws, int tile, int ng, u32 lane) {
  float4* p = (float4*)ws_at(ws, tile, ng, lane);
  const float4 v = __ldcg(p);
  __stcg(p, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
  return v;
}
/* take4 of (tile, ng) for lane, written to y (+ bias) where its rows / tokens are inside N / M */
__device__ __forceinline__ void take_store4(float* __restrict__ ws, int tile, int ng, u32 lane, int M, int N,
                                            u16* __restrict__ y, int y_stride, const void* __restrict__ bias,
                                            int bias_kind) {
  const int row0 = tile * 16 + (int)(lane >> 2), tok0 = ng * 8 + 2 * (int)(lane & 3);
  if (row0 >= N || tok0 >= M) return;
  const float4 v4 = take4(ws, tile, ng, lane);
  const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int row = row0 + 8 * (c >> 1), tok = tok0 + (c & 1);
    if (row < N && tok < M) y[(long long)tok * y_stride + row] = f2h(v[c] + bias_of(bias, bias_kind, row));
  }
}
/* add a task's partial sums (rows of tile) to the fp32 workspace and count its contrib segments on cnt[c];
   true in every lane of the warp whose count completes total (it then reads the sums back) */
__device__ __forceinline__ bool add_partials(float (&acc)[NG][4], int tile, u32 lane, int M, int N, float post,
                                             float* __restrict__ ws, int* __restrict__ cnt, int c_idx, int contrib,
                                             int total, int ws_stride) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#if WS4
    if (tile * 16 + g < N && ng * 8 + 2 * t < M)
      red_add4(ws_at(ws, tile, ng, lane), acc[ng][0] * post, acc[ng][1] * post, acc[ng][2] * post,
               acc[ng][3] * post);
#else
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = tile * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (row < N && tok < M) atomicAdd(&ws[(long long)tok * ws_stride + row], acc[ng][c] * post);
    }
#endif
  return arrive(cnt, c_idx, contrib, total, lane);
}

/* y of the lane's elements of a tile: acc * post + bias */
__device__ __forceinline__ void store_tile(const float (&acc)[NG][4], int tile, u32 lane, int M, int N,
                                           u16* __restrict__ y, int y_stride, const void* __restrict__ bias,
                                           int bias_kind, float post) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = tile * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (row < N && tok < M) {
        const float v = acc[ng][c] * post + bias_of(bias, bias_kind, row);
        y[(long long)tok * y_stride + row] = f2h(v);
      }
    }
}

/* finish one (tile, K range) task: write y, or add to the fp32 workspace (the last of the tile's splits writes) */
__device__ __forceinline__ void finish(float (&acc)[NG][4], int tile, u32 lane, int M, int N, u16* __restrict__ y,
                                       int y_stride, const void* __restrict__ bias, int bias_kind, float post,
                                       float* __restrict__ ws, int* __restrict__ cnt, int contrib, int total,
                                       int ws_stride) {
  const int g = lane >> 2, t = lane & 3;
  if (contrib == total) {
    store_tile(acc, tile, lane, M, N, y, y_stride, bias, bias_kind, post);
    return;
  }
  if (add_partials(acc, tile, lane, M, N, post, ws, cnt, tile, contrib, total, ws_stride)) {
#if WS4
    /* one 16-byte load in flight at a time: unrolled, the loads cost kernel 7 (NG = 4) registers, one CTA an SM
       instead of two, and made big weights slower at M = 32 */
    #pragma unroll 1
    for (int ng = 0; ng < NG; ++ng) take_store4(ws, tile, ng, lane, M, N, y, y_stride, bias, bias_kind);
#else
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = tile * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
        if (row < N && tok < M) {
          const float v = atomicExch(&ws[(long long)tok * ws_stride + row], 0.0f);
          y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
        }
      }
#endif
    if (lane == 0) atomicExch(&cnt[tile], 0);
  }
}

__device__ __forceinline__ void sts128(u32 a, u32 v0, u32 v1) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%1,%2};" :: "r"(a), "r"(v0), "r"(v1) : "memory");
}
/* the lookup table from the codebook held one entry a lane (shuffles, 16-byte stores) */
__device__ __forceinline__ u32 cbh(float c, u32 e) { return f2h(__shfl_sync(0xffffffffu, c, e)); }
__device__ __forceinline__ void build_table_fast(u32 tab, const float* __restrict__ cb, u32 tid, u32 nt) {
  const float c = cb[(tid & 31) & ((1u << K_BITS) - 1u)];
  (void)c;
#if K_BITS == 4
  for (u32 i = tid; i < 2048; i += nt) {
    const u32 e = i >> 3;
    const u32 v = cbh(c, e & 15) | (cbh(c, e >> 4) << 16);
    sts128(tab + i * 16, v, v);
  }
#elif K_BITS == 3
  for (u32 i = tid; i < 512; i += nt) {
    const u32 e = i >> 3;
    const u32 v = cbh(c, e & 7) | (cbh(c, e >> 3) << 16);
    sts128(tab + i * 16, v, v);
  }
#elif K_BITS == 2
  /* no table: lookup() reads the four codebook halves from registers (lane_bits) */
#elif P5
  for (u32 i = tid; i < 8192; i += nt) {
    const u32 e = i >> 3;
    const u32 v = cbh(c, e & 31) | (cbh(c, e >> 5) << 16);
    sts128(tab + i * 16, v, v);
  }
#else
  for (u32 i = tid; i < 256; i += nt) {
    const u32 h = cbh(c, i >> 3);
    sts128(tab + i * 16, h | (h << 16), h | (h << 16));
  }
#endif
}
