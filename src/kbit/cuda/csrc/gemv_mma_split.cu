/* kbit_gemv_mma_split: the swap-AB tensor-core GEMV for small M (kbit.ops.gemv_mma, kernel 1), y = x @ W.T with
   W k-bit in layout "mma-v1". A CTA per (16-row tile, K split) (persistent: CTA b takes items b, b + grid, ...).

   Defines (-D options; kbit.ops.gemv_mma.plan sets them):
     K_BITS       2, 3, 4, 5
     NG           8-token column groups: 1, 2, 4, 8 (M <= 8 NG)
     MAXW, MINB   __launch_bounds__: warps a CTA (1..32), CTAs an SM
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     WS4          0/1 (NG > 1): the split-K workspace a lane's four values at once (see splitk.cuh)
     L2PF         0 or bytes: the CTA's first item's weights prefetched into L2 before the PDL wait
     K1EARLY      0/1: the first segment's loads before the table build (table built by shuffles)
     M1           0/1: M is 1
     K1WO         0/1: a warp's partial sums each, added in warp order (else shared-memory atomics)
     DET          0/1: fixed-order split-K sums (bit-identical runs)
     XT           0/1: x's columns from kx on read as zero (common.cuh) */
#include "splitk.cuh"

#ifndef K1EARLY
#define K1EARLY 0
#endif
#ifndef DET /* 1 = split-K parts added in a fixed order (bit-identical runs), 0 = fp32 atomics */
#define DET 0
#endif

/* CTA per (tile, K split): its W warps take the split's segments round-robin (register double buffer, the
   first segment of the warp's next item prefetched before this item's reduction), partial sums reduced in
   shared memory; split K across CTAs is fixed up in an fp32 workspace by the last CTA of the tile (DET: warps
   added in warp order, a workspace slot a split added in split order: deterministic). */
/* the warp's walk over (item, segment) pairs (first) and its segment loads (load); the first load issued.
   K1EARLY: before the table build, else after the CTA barrier */
#define K1_WALK \
  const int items = n_tiles * splits; \
  /* (item, segment) of this warp's next load; seg < 0: none */ \
  auto first = [&](int item, int& seg) { \
    if (item >= items) { seg = -1; return; } \
    const int sp = item - (item / splits) * splits; \
    const int s0 = sp * sps + (int)warp; \
    seg = s0 < min(sp * sps + sps, n_seg) ? s0 : -1; \
  }; \
  V4 cw[K_BITS], sw[SV]; \
  auto load = [&](int item, int seg) { \
    const int tile = item / splits; \
    const long long ts_ = (long long)tile * n_seg + seg; \
  _Pragma("unroll") \
    for (int v = 0; v < K_BITS; ++v) cw[v] = ld_stream(codes + (ts_ * K_BITS + v) * 32 + lane); \
  _Pragma("unroll") \
    for (int v = 0; v < SV; ++v) sw[v] = ld_stream(scales + (ts_ * 8 + g) * SV + v); \
  }; \
  int item = blockIdx.x, seg; \
  first(item, seg); \
  if (seg >= 0) load(item, seg);
/* WO (DET, and K1WO where the workspace takes a value an atomic): a warp's partial sums each, added in warp order
   (the CTA's sums are the same run to run); else one set, shared-memory atomics */
#ifndef K1WO
#define K1WO 0
#endif
#define WO (DET || (K1WO && !WS4))
__shared__ float s_red[(WO ? MAXW : 1) * NG * 128];
__shared__ int s_flag;
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma_split(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride, int kx) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2;
  if (tid == 0 && (int)blockIdx.x < n_tiles * splits) { /* the CTA's first item, codes then scales */
    const int it = blockIdx.x, tl_ = it / splits, sp_ = it - tl_ * splits;
    const int s0_ = sp_ * sps, s1_ = min(s0_ + sps, n_seg);
    const long long j = (long long)tl_ * n_seg + s0_;
    l2_prefetch(codes + j * K_BITS * 32, (long long)(s1_ - s0_) * K_BITS * 512);
    l2_prefetch(scales + j * 8 * SV, (long long)(s1_ - s0_) * SV * 128);
  }
#if K1EARLY /* the first segment in flight while the tables are built */
  K1_WALK
#endif
  const float ts = *ts_ptr;
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
#if K1EARLY
  build_table_fast(tab, cb, tid, blockDim.x);
#else
  build_table((u32*)(dsm + (tab - dsm_base)), cb, tid, blockDim.x);
#endif
  const float post = FP16_SCALES ? ts : 1.0f;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i] * ts;
#if !WO
  for (u32 i = tid; i < NG * 128; i += blockDim.x) s_red[i] = 0.0f;
#endif
  __syncthreads();
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc_base = smem_addr(s_sc);
  const u16* xr[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    int tok = ng * 8 + g;
    tok = tok < M ? tok : M - 1;
    xr[ng] = x + (long long)tok * x_stride + 8 * (lane & 3);
  }
#if !K1EARLY
  K1_WALK
#endif
  pdl_launch();
  pdl_wait();
  for (; item < items; item += gridDim.x) {
    const int tile = item / splits, sp = item - tile * splits;
    const int s1 = min(sp * sps + sps, n_seg);
    float acc[NG][4];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
    if (seg >= 0) {
      while (true) {
        /* next load: the next segment of this item, else the first one of the warp's next item */
        int n_item = item, n_seg_ = seg + (int)W;
        if (n_seg_ >= s1) { n_item = item + gridDim.x; first(n_item, n_seg_); }
        V4 nw[K_BITS], ns[SV];
        if (n_seg_ >= 0) {
          const long long ts_ = (long long)(n_item / splits) * n_seg + n_seg_;
#pragma unroll
          for (int v = 0; v < K_BITS; ++v) nw[v] = ld_stream(codes + (ts_ * K_BITS + v) * 32 + lane);
#pragma unroll
          for (int v = 0; v < SV; ++v) ns[v] = ld_stream(scales + (ts_ * 8 + g) * SV + v);
        }
        const u16* xs[NG];
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) xs[ng] = xr[ng] + seg * SEG;
        segment((const u32*)cw, sw, xs, lbb, sc_base, acc, kx - seg * SEG);
#pragma unroll
        for (int v = 0; v < K_BITS; ++v) cw[v] = nw[v];
#pragma unroll
        for (int v = 0; v < SV; ++v) sw[v] = ns[v];
        const bool done = n_item != item;
        seg = n_seg_;
        if (done) break;
      }
#if !WO
#pragma unroll
      for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(&s_red[(ng * 4 + c) * 32 + lane], acc[ng][c]);
#endif
    } else {
      int n_item = item + gridDim.x;  /* this warp had no segment in this item: look at the next one */
      first(n_item, seg);
      if (seg >= 0) load(n_item, seg);
    }
#if WO
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) s_red[warp * (NG * 128) + (ng * 4 + c) * 32 + lane] = acc[ng][c];
#endif
    __syncthreads();
    const bool last = splits == 1;
    /* split K across CTAs: the CTA's sums go to slot sp of the tile; the CTA that completes the tile's count adds
       the slots in split order and zeroes them (deterministic: no sum depends on the order of arrival) */
#if DET || !WS4
    float* slots = ws + (long long)tile * splits * (NG * 128);
    for (u32 e = tid; e < NG * 128; e += blockDim.x) {
      const u32 c = (e >> 5) & 3, l = e & 31;
      const int row = tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
      const int tok = (int)(e >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
#if DET
      float v = 0.0f;
      for (u32 w = 0; w < W; ++w) v += s_red[w * (NG * 128) + e];
      v *= post;
      if (!last) {
        __stcg(slots + sp * (NG * 128) + e, v);
      } else if (row < N && tok < M) {
        y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
      }
#else
#if WO
      float v = 0.0f;
      for (u32 w = 0; w < W; ++w) v += s_red[w * (NG * 128) + e];
      v *= post;
#else
      const float v = s_red[e] * post;
      s_red[e] = 0.0f;
#endif
      if (row < N && tok < M) {
        if (last) y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
        else atomicAdd(&ws[(long long)tok * ws_stride + row], v);
      }
#endif
    }
#else
    if (last) {
      for (u32 e = tid; e < NG * 128; e += blockDim.x) {
        const u32 c = (e >> 5) & 3, l = e & 31;
        const int row = tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
        const int tok = (int)(e >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
        const float v = s_red[e] * post;
        s_red[e] = 0.0f;
        if (row < N && tok < M) y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
      }
    } else {  /* the CTA's sums into the workspace (see ws_at): a lane's four values by one reduction */
      for (u32 q = tid; q < NG * 32; q += blockDim.x) {
        const u32 l = q & 31, ng = q >> 5;
        float* r = s_red + ng * 128 + l;
        const float v0 = r[0] * post, v1 = r[32] * post, v2 = r[64] * post, v3 = r[96] * post;
        r[0] = r[32] = r[64] = r[96] = 0.0f;
        if (tile * 16 + (int)(l >> 2) < N && (int)(ng * 8 + 2 * (l & 3)) < M)
          red_add4(ws_at(ws, tile, (int)ng, l), v0, v1, v2, v3);
      }
    }
#endif
    if (!last) {
      __threadfence();
      __syncthreads();
      if (tid == 0) s_flag = atomicAdd(&cnt[tile], 1) == splits - 1;
      __syncthreads();
      if (s_flag) {
        __threadfence();
#if DET || !WS4
        for (u32 e = tid; e < NG * 128; e += blockDim.x) {
          const u32 c = (e >> 5) & 3, l = e & 31;
          const int row = tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
          const int tok = (int)(e >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
#if DET
          float v = 0.0f;
#pragma unroll 8
          for (int q = 0; q < splits; ++q) v += __ldcg(slots + q * (NG * 128) + e);
          for (int q = 0; q < splits; ++q) __stcg(slots + q * (NG * 128) + e, 0.0f);
          if (row < N && tok < M) y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
#else
          if (row < N && tok < M) {
            const float v = atomicExch(&ws[(long long)tok * ws_stride + row], 0.0f);
            y[(long long)tok * y_stride + row] = f2h(v + bias_of(bias, bias_kind, row));
          }
#endif
        }
#else
        for (u32 q = tid; q < NG * 32; q += blockDim.x)
          take_store4(ws, tile, (int)(q >> 5), q & 31, M, N, y, y_stride, bias, bias_kind);
#endif
        if (tid == 0) atomicExch(&cnt[tile], 0);
      }
    }
    __syncthreads();
  }
}

