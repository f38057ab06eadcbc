/* kbit_wgmma: the large-M tensor-core kernel for sm_90a (Hopper wgmma), layout "mma-v1" (kbit.ops.gemv_mma
   kernel 7; GRP = 1: the grouped MoE form of kbit.ops.grouped_mma). Compiled for sm_90a only.

   Defines (-D options; kbit.ops.gemv_mma.large_defines sets them):
     K_BITS       2, 3, 4, 5
     NG           8-token column groups a tile: 4, 8, 16, 32 (wgmma_mma.cuh's n32 .. n256 forms)
     D            x stages: 3..8
     MAXW         warps a CTA (a multiple of 4: warpgroups)
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     SK           0/1: stream-K over (task, segment) pairs (dense only)
     GRP          0/1: grouped: token blocks are the blocks of a device block table, each of one expert
     WS4          0/1: the split-K workspace a lane's four values at once (see splitk.cuh)
   The launch bounds are (MAXW * 32, 1). */
#include "pipe.cuh"
#include "wgmma_mma.cuh"
#if GRP
#include "grouped.cuh" /* ld_dep */
#endif

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
/* kernel 7 (sm_90a, large M): output tiles of MAXW x 16 weight rows x 8 NG tokens, one tile a task,
   K split into `splits` tasks when the tiles are too few for the GPU. Persistent CTAs take tasks blockIdx.x,
   + gridDim.x, ...; tasks are rastered in groups of GM token blocks (the x and the codes that CTAs running at
   once touch stay in L2). Each warpgroup (4 warps x 16 rows, a warp's mma.sync A fragment its slice of the m64
   wgmma A operand) looks its codes up into registers and folds the block scales; B = x chunks of 64 columns
   (pre-tiled and swizzled by kbit_x_tiles, x_tiles.cu) through a D-stage ring of bulk copies read by the tensor
   cores. Codes and scales of the next segment are prefetched into registers. */
#define XC (8 * NG * 128)   /* one 64-column chunk of 8 NG tokens: 8 K-direction core matrices x NG */
#define AB 2                /* A register buffers (units in flight) */
#define LAG (AB / 2 + 1)    /* a stage is refilled LAG chunks after the chunk that last read it */
#define GM 8                /* token blocks a raster group */
#ifndef SK
#define SK 0 /* 1: stream-K over (task, segment) pairs instead of whole tasks (split K) */
#endif
#ifndef GRP
#define GRP 0 /* 1: grouped (MoE): token blocks are the blocks of a device block table, each of one expert */
#endif
#if GRP && SK
#error "GRP: stream-K is not supported"
#endif
__shared__ __align__(8) u64 s_full[8];  /* a chunk's bulk copy landed in stage s */
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ u32 mbar_try(u32 bar, u32 parity) {
  u32 ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try(bar, parity)) {}
}
/* one thread: stage `dst` <- `bytes` contiguous global bytes at `src`, completion counted on `bar` */
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
/* the B descriptor of the k16 step kk (0..3) of an x chunk at shared address sb */
__device__ __forceinline__ u64 x_desc(u32 sb, int kk) {
  /* token rows of 128 bytes, 16-byte chunk c of row r at (c ^ (r % 8)) * 16; 8-row groups 1024 bytes apart
     (SBO); K steps advance the start address by 32 bytes inside the swizzle atom; LBO unused (1) */
  const u32 a = sb + kk * 32;
  return (u64)((a & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
struct Task {
  int tb, rb, s0, s1;
#if GRP
  int e, r0, mb; /* the block's expert, first row and row count */
#endif
};
__device__ __forceinline__ Task task_of(int p, int n_rb, int n_tb, int splits, int sps, int n_seg) {
  Task r;
  const int q = p / splits, sp = p - q * splits;
  const int per = GM * n_rb, grp = q / per, first = grp * GM, rem = q - grp * per;
  const int gsz = min(n_tb - first, GM);
  r.tb = first + rem % gsz;
  r.rb = rem / gsz;
  r.s0 = sp * sps;
  r.s1 = min(n_seg, r.s0 + sps);
  return r;
}
__device__ __forceinline__ V4 ldg_nc(const V4* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
extern "C" __global__ void __launch_bounds__(MAXW * 32, 1) kbit_wgmma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride, int kx /* unused: x comes zero-padded (kbit_x_tiles) */
#if GRP
    , const int* __restrict__ blk, const int* __restrict__ nblk, const int* __restrict__ eid
#endif
    ) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int BT = 8 * NG;
#if GRP
  /* grouped: codes [E][n_tiles][n_seg], ts_ptr [E]; token block b = rows [blk[b], blk[b + 1]) of expert
     eid[blk[b]], x tiled per block (kbit_x_tiles_g), y rows in the same order. The block table is the previous
     kernels' output: wait first (no weight prologue before the wait). */
  pdl_launch();
  pdl_wait();
  const int n_rb = (n_tiles + MAXW - 1) / MAXW, n_tb = min(ld_dep(nblk), M); /* M: the tiles' block count */
#else
  const int n_rb = (n_tiles + MAXW - 1) / MAXW, n_tb = (M + BT - 1) / BT;
#endif
  const int n_tasks = n_rb * n_tb * splits;
#if SK
  /* stream-K: CTA b takes the (task, segment) pairs [T b / G, T (b + 1) / G) of the raster order; a task it
     covers in part is summed in the fp32 workspace (finish() counts its segments) */
  const long long Tw = (long long)n_rb * n_tb * n_seg;
  const long long sj0 = Tw * blockIdx.x / gridDim.x, sj1 = Tw * (blockIdx.x + 1) / gridDim.x;
  const int p_first = (int)(sj0 / n_seg), p_end = sj1 > sj0 ? (int)((sj1 - 1) / n_seg) + 1 : p_first;
  const int p_step = 1;
  auto get_task = [&](int p) {
    Task t = task_of(p, n_rb, n_tb, 1, n_seg, n_seg);
    if (p == p_first) t.s0 = (int)(sj0 - (long long)p_first * n_seg);
    if (p == p_end - 1) t.s1 = (int)(sj1 - (long long)(p_end - 1) * n_seg);
    return t;
  };
#else
  const int p_first = blockIdx.x, p_end = n_tasks, p_step = gridDim.x;
  auto get_task = [&](int p) {
    Task t = task_of(p, n_rb, n_tb, splits, sps, n_seg);
#if GRP
    t.r0 = blk[t.tb];
    t.mb = blk[t.tb + 1] - t.r0;
    t.e = eid[t.r0];
#endif
    return t;
  };
#endif
  if (p_first >= p_end) return;
  extern __shared__ __align__(128) unsigned char dsm[];
  const u32 dsm_base = (smem_addr(dsm) + 1023) & ~1023u;  /* swizzle atoms are 1024-byte aligned */
  const u32 tab = (dsm_base + D * XC + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  /* x loader: chunk l_c of task l_p */
  int l_p = p_first, l_c = 0;
  Task lt = get_task(l_p);
  int l_nc = (lt.s1 - lt.s0) * 4;
  auto issue = [&](int slot) {
    /* x_stride = 64-column chunks a token block; chunk (tb, c) is XC contiguous bytes */
    if (tid == 0 && l_p < p_end) {
      bulk_load(dsm_base + slot * XC, x + ((long long)lt.tb * x_stride + lt.s0 * 4 + l_c) * (XC / 2), XC,
                smem_addr(&s_full[slot]));
      if (++l_c == l_nc) {
        l_c = 0;
        l_p += p_step;
        if (l_p < p_end) {
          lt = get_task(l_p);
          l_nc = (lt.s1 - lt.s0) * 4;
        }
      }
    }
  };
  /* codes / scales prefetch: segment f_s of task f_p */
  int f_p = p_first;
  Task ft = get_task(f_p);
  int f_s = ft.s0;
  u32 wn[NW], swn[4 * SV];
  auto fetch = [&]() {
    if (f_p < p_end) {
      const int tile = ft.rb * MAXW + (int)warp;
      if (tile < n_tiles) {
#if GRP
        const long long ts_ = ((long long)ft.e * n_tiles + tile) * n_seg + f_s;
#else
        const long long ts_ = (long long)tile * n_seg + f_s;
#endif
#pragma unroll
        for (int v = 0; v < K_BITS; ++v) {
          V4 q = ldg_nc(codes + (ts_ * K_BITS + v) * 32 + lane);
          wn[4 * v] = q.x; wn[4 * v + 1] = q.y; wn[4 * v + 2] = q.z; wn[4 * v + 3] = q.w;
        }
#pragma unroll
        for (int v = 0; v < SV; ++v) {
          V4 q = ldg_nc(scales + ts_ * 8 * SV + g * SV + v);
          swn[4 * v] = q.x; swn[4 * v + 1] = q.y; swn[4 * v + 2] = q.z; swn[4 * v + 3] = q.w;
        }
      }
      if (++f_s == ft.s1) {
        f_p += p_step;
        if (f_p < p_end) {
          ft = get_task(f_p);
          f_s = ft.s0;
        }
      }
    }
  };
  fetch();
  const float ts = *ts_ptr;
  build_tables(tab, cb, e_tab, tid);
  const float post = FP16_SCALES ? ts : ts * (1.0f / SPRE);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      mbar_init(smem_addr(&s_full[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  u32 phase = 0;  /* bit s: parity of the next completion of stage s */
#if !GRP
  /* x (the previous kernel's output) after the wait; the first codes are in flight */
  pdl_launch();
  pdl_wait();
#endif
#pragma unroll
  for (int s = 0; s < D - LAG; ++s) { issue(s); cp_commit(); }
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc2_base = smem_addr(s_sc2);
  float acc[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
  int c_p = p_first;
  Task ct = get_task(c_p);
  int c_s = ct.s0, slot = 0;
  u32 A[AB][2][4];
  while (c_p < p_end) {
    u32 w[NW], sw[4 * SV];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = wn[i];
#pragma unroll
    for (int i = 0; i < 4 * SV; ++i) sw[i] = swn[i];
    fetch();
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      u32 T[2][4];
      /* the chunk's first lookups before its barrier: they need only the codes, and overlap the wait */
      lookup(w, 2 * cc, lbb, T);
      const u32 s0h = scale2(sw, 2 * cc, 0, sc2_base), s1h = scale2(sw, 2 * cc, 1, sc2_base);
      /* every warp is past the wgmma wait that retired chunk c - 2: its stage may be refilled below */
      __syncthreads();
      mbar_wait(smem_addr(&s_full[slot]), (phase >> slot) & 1);
      phase ^= 1u << slot;
      const u32 sb = dsm_base + slot * XC;
      const int ls = slot + D - LAG;
      slot = slot + 1 == D ? 0 : slot + 1;
#pragma unroll
      for (int ul = 0; ul < 2; ++ul) {
        const int u = 2 * cc + ul;
        u32 (&Au)[2][4] = A[u % AB];
        /* the table lookups go into temporaries before the wait for the wgmmas that read A[u % AB]: their
           latency overlaps the tensor cores instead of following the wait */
        if (ul == 1) lookup(w, u, lbb, T);
        const u32 s0 = ul == 0 ? s0h : scale2(sw, u, 0, sc2_base), s1 = ul == 0 ? s1h : scale2(sw, u, 1, sc2_base);
        wg_wait<AB - 1>();
        fold_scales(Au, T, s0, s1);
        wg_fence();
#pragma unroll
        for (int h = 0; h < 2; ++h) wg_mma(acc, Au[h], x_desc(sb, ul * 2 + h));
        wg_commit();
      }
      /* refill after this chunk's wgmmas are issued: the copies' address registers are not needed by the
         lookups that follow the barrier */
      issue(ls >= D ? ls - D : ls);
      cp_commit();
    }
    if (++c_s == ct.s1) {
      wg_wait<0>();
      const int tile = ct.rb * MAXW + (int)warp;
#if GRP
      const int tok0 = ct.r0, mb = ct.mb;
      const float post_t = ts_ptr[ct.e] * (FP16_SCALES ? 1.0f : 1.0f / SPRE);
#else
      const int tok0 = ct.tb * BT;
      const int mb = min(BT, M - tok0);
      const float post_t = post;
#endif
      if (tile < n_tiles)
        finish(acc, tile, lane, mb, N, y + (long long)tok0 * y_stride, y_stride, bias, bias_kind, post_t,
               ws + (long long)tok0 * ws_stride, cnt + ct.tb * n_tiles, SK ? c_s - ct.s0 : 1, SK ? n_seg : splits,
               ws_stride);
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
      c_p += p_step;
      if (c_p < p_end) {
        ct = get_task(c_p);
        c_s = ct.s0;
      }
    }
  }
  wg_wait<0>();
  cp_wait_all();
}

