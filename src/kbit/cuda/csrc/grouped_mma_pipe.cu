/* kbit_grouped_mma_pipe: the grouped (MoE) twin of kbit_mma_pipe (mma_pipe.cu) for kbit.ops.grouped_mma:
   y[r] = x[rows[r]] @ W[e(r)].T over the blocks of a block table (moe_blocks.cu), the same D-stage cp.async
   shared-memory pipeline (pipe.cuh).

   Defines (-D options; kbit.ops.grouped_mma sets them):
     K_BITS       2, 3, 4, 5
     NG           8-row groups a block: 1, 2, 4, 8
     D            pipeline stages: 2..8
     MAXW, MINB   __launch_bounds__: warps a CTA, CTAs an SM
     RT           16-row tiles a warp: 1
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes */
#include "pipe.cuh"
#include "grouped.cuh"

/* grouped (MoE): y[r] = x[rows[r]] @ W[e(r)].T for the rows of a block table (kbit.ops.grouped_mma.block_table,
   blocks of <= 8 NG rows of one expert). Items (row block of MAXW x RT tiles, expert block), row-block major;
   CTA q takes items q, q + grid, ... and streams their (item, segment) steps through kernel 4's pipeline
   without draining between items; no split K (deterministic), each warp writes its tiles. */
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_grouped_mma_pipe(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    const int* __restrict__ rows, const int* __restrict__ eid, const int* __restrict__ blk,
    const int* __restrict__ nblk, u16* __restrict__ y, int N, int x_stride, int y_stride, int n_seg,
    int n_tiles) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + D * STAGE4 + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  /* the tables before the wait for the previous kernel: the block table and x are its outputs */
  build_tables(tab, cb, e_tab, tid);
  pdl_launch();
  pdl_wait();
  const int nb = ld_dep(nblk);
  const int n_rb = (n_tiles + MAXW * RT - 1) / (MAXW * RT);
  const int items = nb * n_rb;
  const int my_items = items > (int)blockIdx.x ? (items - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
  const int J = my_items * n_seg;
  const long long tile_words = (long long)n_seg * K_BITS * 32;
  const long long tile_sv = (long long)n_seg * 8 * SV;
  const u32 st0 = dsm_base;
  /* loader state: step jl of item li (rb, row0, n, e) */
  int l_it = -1, l_rb = 0, l_row0 = 0, l_n = 0, l_e = 0;
  auto locate = [&](int i, int& rb, int& row0, int& n, int& e) {
    const int it = (int)blockIdx.x + i * (int)gridDim.x;
    rb = it / nb;
    const int b = it - rb * nb;
    row0 = blk[b];
    n = blk[b + 1] - row0;
    e = eid[row0];
  };
  auto issue = [&](int j, int slot) {
    if (j < J) {
      const int i = j / n_seg, seg = j - i * n_seg;
      if (i != l_it) { l_it = i; locate(i, l_rb, l_row0, l_n, l_e); }
      const u32 sb = st0 + slot * STAGE4;
      for (int q = (int)tid; q < l_n * 32; q += MAXW * 32) {
        const int r = q >> 5, c = q & 31;
        cp_async16(sb + r * XROW + c * 16, x + (long long)rows[l_row0 + r] * x_stride + seg * SEG + c * 8);
      }
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int tile = (l_rb * MAXW + (int)warp) * RT + rt;
        if (tile < n_tiles) {
          const long long et = (long long)l_e * n_tiles + tile;
          const u32 cs = sb + XSTAGE + ((warp * RT + rt) * K_BITS) * 512 + lane * 16;
          const V4* cp = codes + et * tile_words + (long long)seg * (K_BITS * 32) + lane;
#pragma unroll
          for (int v = 0; v < K_BITS; ++v) cp_async16(cs + v * 512, cp + v * 32);
          if (lane < 8 * SV)
            cp_async16(sb + XSTAGE + CSTAGE + ((warp * RT + rt) * 8 * SV + lane) * 16,
                       scales + et * tile_sv + (long long)seg * 8 * SV + lane);
        }
      }
    }
  };
#pragma unroll
  for (int s = 0; s < D - 1; ++s) { issue(s, s); cp_commit(); }
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc2_base = smem_addr(s_sc2);
  float acc[RT][NG][4];
  int c_rb = 0, c_row0 = 0, c_n = 0, c_e = 0, ngv = 0, slot = 0;
  u32 xoff[NG];
  for (int j = 0; j < J; ++j) {
    const int seg = j % n_seg;
    if (seg == 0) {
      locate(j / n_seg, c_rb, c_row0, c_n, c_e);
      ngv = (c_n + 7) >> 3;
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        int tok = ng * 8 + g;
        tok = tok < c_n ? tok : c_n - 1;
        xoff[ng] = tok * XROW + t * 16;
      }
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) acc[rt][ng][0] = acc[rt][ng][1] = acc[rt][ng][2] = acc[rt][ng][3] = 0.0f;
    }
    cp_wait_d2();
    __syncthreads();
    {
      int ls = slot + D - 1;
      issue(j + D - 1, ls >= D ? ls - D : ls);
      cp_commit();
    }
    const u32 sb = st0 + slot * STAGE4;
    slot = slot + 1 == D ? 0 : slot + 1;
    const int tile0 = (c_rb * MAXW + (int)warp) * RT;
    if (tile0 < n_tiles) {
      u32 w[RT][NW];
      u32 sw[RT][4 * SV];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const u32 cs = sb + XSTAGE + ((warp * RT + rt) * K_BITS) * 512 + lane * 16;
#pragma unroll
        for (int v = 0; v < K_BITS; ++v) {
          V4 q = lds128(cs + v * 512);
          w[rt][4 * v] = q.x; w[rt][4 * v + 1] = q.y; w[rt][4 * v + 2] = q.z; w[rt][4 * v + 3] = q.w;
        }
#pragma unroll
        for (int v = 0; v < SV; ++v) {
          V4 q = lds128(sb + XSTAGE + CSTAGE + ((warp * RT + rt) * 8 * SV + g * SV + v) * 16);
          sw[rt][4 * v] = q.x; sw[rt][4 * v + 1] = q.y; sw[rt][4 * v + 2] = q.z; sw[rt][4 * v + 3] = q.w;
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        u32 A[RT][2][4];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          lookup(w[rt], u, lbb, A[rt]);
          const u32 s0 = scale2(sw[rt], u, 0, sc2_base), s1 = scale2(sw[rt], u, 1, sc2_base);
          fold_scales(A[rt], A[rt], s0, s1);
        }
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) {
          if (ng < ngv) {
            const V4 xb = lds128(sb + xoff[ng] + u * 64);
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
              mma(acc[rt][ng], A[rt][0], xb.x, xb.y, acc[rt][ng]);
              mma(acc[rt][ng], A[rt][1], xb.z, xb.w, acc[rt][ng]);
            }
          }
        }
      }
    }
    if (seg == n_seg - 1) {
      const float post = FP16_SCALES ? ts_ptr[c_e] : ts_ptr[c_e] * (1.0f / SPRE);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int tile = tile0 + rt;
        if (tile < n_tiles) {
#pragma unroll
          for (int ng = 0; ng < NG; ++ng)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int row = tile * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
              if (row < N && tok < c_n) y[(long long)(c_row0 + tok) * y_stride + row] = f2h(acc[rt][ng][c] * post);
            }
        }
      }
    }
  }
  cp_wait_all();
}

