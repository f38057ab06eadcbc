/* kbit_grouped_mma: the grouped (MoE) swap-AB tensor-core kernel (kbit.ops.grouped_mma), layout "mma-v1":
   y[r] = x[rows[r]] @ W[e(r)].T over the blocks of a block table (moe_blocks.cu), persistent CTAs, no split K
   across CTAs (deterministic).

   Defines (-D options; kbit.ops.grouped_mma sets them):
     K_BITS       2, 3, 4, 5
     NG           8-row groups a block: 1, 2, 4, 8
     MAXW, MINB   __launch_bounds__: warps a CTA, CTAs an SM
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes */
#include "common.cuh"
#include "grouped.cuh"

/* one 256-column segment (columns off ..) of one 16-row tile for the first ngv (1..NG) 8-row groups -> acc */
__device__ __forceinline__ void segment_g(const u32* w, const V4* sw, const u16* const* xr, int off, LB lbb,
                                          u32 sc_base, float (&acc)[NG][4], int ngv) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    V4 xb[NG];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
      if (ng < ngv) xb[ng] = ld_x(xr[ng] + off + 32 * u);
    u32 A[2][4];
    lookup(w, u, lbb, A);
    const float s0v = scale_of(sw, u, 0, sc_base), s1v = scale_of(sw, u, 1, sc_base);
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      if (ng < ngv) {
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
}

/* Grouped swap-AB GEMM: persistent CTAs over items (row tile, block), the block fastest (CTAs that run at the
   same time share a tile: an expert's tile is read from memory once for all its blocks). Item: rows
   r = blk[b] .. blk[b + 1] - 1 (one expert e = eid[blk[b]], at most 8 NG rows), y[r, tile rows] =
   x[rows[r]] @ W_e[tile rows].T. The W warps take the segments round-robin (register double buffer; the
   first segment of the warp's next item is loaded before this item's last segment is computed), fp32
   partial sums reduced over the warps in a fixed order (deterministic). Weights: codes [E, Nt, S, k, 32, 4],
   scales [E, Nt, S, 8, 16 (x SV)], tensor scale per expert (applied after the sum). */
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_grouped_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    const int* __restrict__ rows, const int* __restrict__ eid, const int* __restrict__ blk,
    const int* __restrict__ nblk, u16* __restrict__ y, int N, int x_stride, int y_stride, int n_seg,
    int n_tiles) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2;
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  float* s_red = (float*)(dsm + (tab - dsm_base) + TAB_WORDS * 4);
  build_table((u32*)(dsm + (tab - dsm_base)), cb, tid, blockDim.x);
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i];
  __syncthreads();
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc_base = smem_addr(s_sc);
  pdl_launch();
  pdl_wait(); /* the table above reads only the codebook: built while the previous kernel ends */
  const int nb = ld_dep(nblk);
  const int items = nb * n_tiles;
  const long long tile_words = (long long)n_seg * K_BITS * 32;  /* V4s of codes per (expert, tile) */
  const long long tile_sv = (long long)n_seg * 8 * SV;           /* V4s of scales per (expert, tile) */
  /* item -> (tile, first row, rows, expert) */
  int item = blockIdx.x;
  int c_tile = 0, c_row0 = 0, c_n = 0, c_e = 0;
  auto locate = [&](int it, int& tile, int& row0, int& n, int& e) {
    tile = it / nb;
    const int b = it - tile * nb;
    row0 = blk[b];
    n = blk[b + 1] - row0;
    e = eid[row0];
  };
  V4 cw[K_BITS], sw[SV];
  auto load = [&](V4 (&dw)[K_BITS], V4 (&ds)[SV], int e, int tile, int seg) {
    const long long et = (long long)e * n_tiles + tile;
    const V4* cp = codes + et * tile_words + (long long)seg * (K_BITS * 32) + lane;
#pragma unroll
    for (int v = 0; v < K_BITS; ++v) dw[v] = ld_stream(cp + v * 32);
    const V4* sp = scales + et * tile_sv + ((long long)seg * 8 + g) * SV;
#pragma unroll
    for (int v = 0; v < SV; ++v) ds[v] = ld_stream(sp + v);
  };
  if (item < items) {
    locate(item, c_tile, c_row0, c_n, c_e);
    load(cw, sw, c_e, c_tile, (int)warp);  /* W <= n_seg: every warp has a segment in every item */
  }
  for (; item < items; item += gridDim.x) {
    const int nx = item + (int)gridDim.x;
    int n_tile = 0, n_row0 = 0, n_n = 0, n_e = 0;
    if (nx < items) locate(nx, n_tile, n_row0, n_n, n_e);
    const u16* xr[NG];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      int tok = ng * 8 + g;
      tok = tok < c_n ? tok : c_n - 1;
      xr[ng] = x + (long long)rows[c_row0 + tok] * x_stride + 8 * (lane & 3);
    }
    const int ngv = (c_n + 7) >> 3;
    float acc[NG][4];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
    for (int seg = (int)warp; seg < n_seg; seg += (int)W) {
      V4 nw[K_BITS], ns[SV];
      const int s2 = seg + (int)W;
      if (s2 < n_seg) load(nw, ns, c_e, c_tile, s2);
      else if (nx < items) load(nw, ns, n_e, n_tile, (int)warp);
      segment_g((const u32*)cw, sw, xr, seg * SEG, lbb, sc_base, acc, ngv);
#pragma unroll
      for (int v = 0; v < K_BITS; ++v) cw[v] = nw[v];
#pragma unroll
      for (int v = 0; v < SV; ++v) sw[v] = ns[v];
    }
    const float post = ts_ptr[c_e];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) s_red[(warp * NG + ng) * 128 + c * 32 + lane] = acc[ng][c];
    __syncthreads();
    for (u32 i = tid; i < NG * 128; i += blockDim.x) {
      float v = 0.0f;
      for (u32 w2 = 0; w2 < W; ++w2) v += s_red[w2 * (NG * 128) + i];
      const u32 c = (i >> 5) & 3, l = i & 31;
      const int row = c_tile * 16 + (int)(l >> 2) + 8 * (int)(c >> 1);
      const int tok = (int)(i >> 7) * 8 + 2 * (int)(l & 3) + (int)(c & 1);
      if (row < N && tok < c_n) y[(long long)(c_row0 + tok) * y_stride + row] = f2h(v * post);
    }
    __syncthreads();
    c_tile = n_tile; c_row0 = n_row0; c_n = n_n; c_e = n_e;
  }
}
