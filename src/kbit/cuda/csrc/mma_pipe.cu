/* kbit_mma_pipe: the mid-M swap-AB tensor-core kernel (kbit.ops.gemv_mma kernel 4, 9..64 tokens), y = x @ W.T with
   W k-bit in layout "mma-v1": every segment's x rows, codes and scales through a D-stage cp.async shared-memory
   pipeline, block scales folded into the A fragments (pipe.cuh). Its grouped (MoE) twin is grouped_mma_pipe.cu
   (a file of its own: NVRTC optimises a kernel a little differently when the module holds another one).

   Defines (-D options; kbit.ops.gemv_mma.plan sets them):
     K_BITS       2, 3, 4, 5
     NG           8-token column groups: 2, 4, 8
     D            pipeline stages: 2..8
     MAXW, MINB   __launch_bounds__: warps a CTA, CTAs an SM
     RT           16-row tiles a warp
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     WS4          0/1: the split-K workspace a lane's four values at once (see splitk.cuh)
     XT           0/1: x's columns from kx on read as zero (common.cuh) */
#include "pipe.cuh"

extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_mma_pipe(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride, int kx) {
  /* stream-K over (row block, segment) pairs in memory order: CTA c takes the contiguous range [j0, j1); a row
     block wholly in the range is written directly, a partial one goes through the fp32 workspace (the warp that
     completes a tile's segment count writes it) */
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_rb = (n_tiles + MAXW * RT - 1) / (MAXW * RT);
  const long long T = (long long)n_rb * n_seg;
  const int j0 = (int)(T * blockIdx.x / gridDim.x), j1 = (int)(T * (blockIdx.x + 1) / gridDim.x);
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + D * STAGE4 + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  const u32 st0 = dsm_base;
  auto issue_x = [&](int j, int slot) {
    if (j < j1) {
      const int seg = j % n_seg;
      const u32 sb = st0 + slot * STAGE4;
      for (int i = (int)tid; i < M * 32; i += MAXW * 32) {
        const int row = i >> 5, c = i & 31;
#if XT
        cp_async16_z(sb + row * XROW + c * 16, x + (long long)row * x_stride + seg * SEG + c * 8,
                     seg * SEG + c * 8 < kx);
#else
        cp_async16(sb + row * XROW + c * 16, x + (long long)row * x_stride + seg * SEG + c * 8);
#endif
      }
    }
  };
  auto issue_w = [&](int j, int slot) {
    if (j < j1) {
      const int rb = j / n_seg, seg = j - rb * n_seg;
      const u32 sb = st0 + slot * STAGE4;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int tile = (rb * MAXW + (int)warp) * RT + rt;
        if (tile < n_tiles) {
          const long long ts_ = (long long)tile * n_seg + seg;
          const u32 cs = sb + XSTAGE + ((warp * RT + rt) * K_BITS) * 512 + lane * 16;
#pragma unroll
          for (int v = 0; v < K_BITS; ++v) cp_async16(cs + v * 512, codes + (ts_ * K_BITS + v) * 32 + lane);
          if (lane < 8 * SV)
            cp_async16(sb + XSTAGE + CSTAGE + ((warp * RT + rt) * 8 * SV + lane) * 16, scales + ts_ * 8 * SV + lane);
        }
      }
    }
  };
  /* weights of the first D - 1 stages before the wait for the previous kernel, x after it (the first commit
     group holds them all) */
#pragma unroll
  for (int s = 0; s < D - 1; ++s) issue_w(j0 + s, s);
  const float ts = *ts_ptr;
  build_tables(tab, cb, e_tab, tid);
  const float post = FP16_SCALES ? ts : ts * (1.0f / SPRE);
  pdl_launch();
  pdl_wait();
#pragma unroll
  for (int s = 0; s < D - 1; ++s) { issue_x(j0 + s, s); cp_commit(); }
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc2_base = smem_addr(s_sc2);
  u32 xoff[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    int tok = ng * 8 + g;
    tok = tok < M ? tok : M - 1;
    xoff[ng] = tok * XROW + t * 16;
  }
  float acc[RT][NG][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) acc[rt][ng][0] = acc[rt][ng][1] = acc[rt][ng][2] = acc[rt][ng][3] = 0.0f;
  int rb = j0 / n_seg, seg = j0 - rb * n_seg, seg_first = seg, slot = 0;
  for (int j = j0; j < j1; ++j) {
    cp_wait_d2();
    __syncthreads();
    {
      int ls = slot + D - 1;
      ls = ls >= D ? ls - D : ls;
      issue_x(j + D - 1, ls);
      issue_w(j + D - 1, ls);
      cp_commit();
    }
    const u32 sb = st0 + slot * STAGE4;
    slot = slot + 1 == D ? 0 : slot + 1;
    const int tile0 = (rb * MAXW + (int)warp) * RT;
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
          const V4 xb = lds128(sb + xoff[ng] + u * 64);
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            mma(acc[rt][ng], A[rt][0], xb.x, xb.y, acc[rt][ng]);
            mma(acc[rt][ng], A[rt][1], xb.z, xb.w, acc[rt][ng]);
          }
        }
      }
    }
    ++seg;
    if (seg == n_seg || j + 1 == j1) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int tile = tile0 + rt;
        if (tile < n_tiles)
          finish(acc[rt], tile, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt, seg - seg_first, n_seg,
                 ws_stride);
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) acc[rt][ng][0] = acc[rt][ng][1] = acc[rt][ng][2] = acc[rt][ng][3] = 0.0f;
      }
      if (seg == n_seg) { seg = 0; ++rb; }
      seg_first = seg;
    }
  }
  cp_wait_all();
}

