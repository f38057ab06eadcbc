"""CUDA source of the grouped (MoE) swap-AB tensor-core kernel (``kbit.ops.grouped_mma``).

A fork of ``kbit.cuda.gemv_mma_src`` (the dense small-M kernel, layout "mma-v1"): the device helpers (code
lookup tables, the mma wrappers, scale reads) are copied from it unchanged, the kernels are new:

- ``kbit_moe_blocks`` (no defines needed besides the helpers'): the block table of rows sorted (grouped) by
  expert, on the device, one CTA.
- ``kbit_grouped_mma`` (defines K_BITS, NG, MAXW, MINB, BF16, FP16_SCALES): ``y[r] = x[rows[r]] @ W[e(r)].T``
  over the blocks of that table, persistent CTAs, no split K across CTAs (deterministic).
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) V4 { u32 x, y, z, w; };
struct __align__(8) V2 { u32 x, y; };

#define SEG 256
#define NW (4 * K_BITS)        /* code words per lane per segment */
#define SV (FP16_SCALES ? 2 : 1) /* scale vectors per lane per segment */

#if K_BITS == 2
#define TAB_WORDS 4 /* unused: k = 2 looks up from registers */
#elif K_BITS == 3
#define TAB_WORDS (64 * 32)
#elif K_BITS == 4
#define TAB_WORDS (256 * 32)
#else
#define TAB_WORDS (32 * 32 / 2)
#endif

/* the table lives in dynamic shared memory after the pipeline stages, aligned to TAB_ALIGN so that the
   lookup address is (field | lane bits | table address) in one LOP3 (k = 3, 5) */
#if K_BITS == 3
#define TAB_ALIGN 8192
#elif K_BITS == 5
#define TAB_ALIGN 2048
#elif K_BITS == 4
#define TAB_ALIGN 128 /* lane bits 2..6 are ORed in */
#else
#define TAB_ALIGN 16
#endif
__shared__ float s_sc[256];

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
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u32 lds32(u32 a) {
  u32 v; asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a)); return v;
}
__device__ __forceinline__ V2 lds64(u32 a) {
  V2 v; asm("ld.shared.v2.b32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a)); return v;
}
__device__ __forceinline__ u32 lds16(u32 a) {
  u16 v; asm("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(a)); return v;
}
__device__ __forceinline__ float ldsf(u32 a) {
  float v; asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a)); return v;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel)); return r;
}
/* what lookup() reads the codebook from: k = 2, the four halves in two registers; else a (shared) address */
struct LB { u32 a, b; };
/* byte b of w, alone in the low byte (one PRMT) */
__device__ __forceinline__ u32 byte_of(u32 w, int b) {
  u32 r; asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(w), "r"(0x4440 | b)); return r;
}

/* A fragments of unit u (mma h = 0, 1) from the lane's code words w. Lane code order within a unit:
   i = 8h + 4j + 2r + e  <->  row g + 8r, column 32u + 8t + 4h + 2j + e; A[h][r + 2j] holds (e = 0, 1).
   lbb: shared address of the table plus the lane's copy offset. */
__device__ __forceinline__ void lookup(const u32* w, int u, LB lbb, u32 (&A)[2][4]) {
#if K_BITS == 4
#pragma unroll
  for (int f = 0; f < 8; ++f) {             /* f = 4h + 2j + r: byte f of words 2u, 2u + 1 */
    const int h = f >> 2, j = (f >> 1) & 1, r = f & 1;
    A[h][r + 2 * j] = lds32(lbb.a + (byte_of(w[2 * u + (f >> 2)], f & 3) << 7));
  }
#elif K_BITS == 2
  /* register lookup (no shared memory): word u holds code (h, j, r, e) at bit 16h + 8e + 4j + 2r, so the 2-bit
     slot s = 2j + r of bytes (2h, 2h + 1) is the pair (e = 0, 1) of A[h][r + 2j]. Each byte c becomes the
     selector nibbles (2c, 2c + 1) of the codebook's halves in lbb.a (entries 0, 1) and lbb.b (2, 3). */
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const u32 v = ((w[u] >> (2 * s)) & 0x03030303u) * 0x22u + 0x10101010u;
    A[0][(s & 1) + 2 * (s >> 1)] = prmt(lbb.a, lbb.b, v);
    A[1][(s & 1) + 2 * (s >> 1)] = prmt(lbb.a, lbb.b, v >> 16);
  }
#elif K_BITS == 3
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int h = f >> 2, j = (f >> 1) & 1, r = f & 1;
    A[h][r + 2 * j] = lds32(lbb.a | fld(w, (u * 16 + 2 * f) * 3, 6, 7));
  }
#else
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int h = f >> 2, j = (f >> 1) & 1, r = f & 1;
    const int c = u * 16 + 2 * f;
    u32 lo = lds16(lbb.a | fld(w, c * 5, 5, 6));
    u32 hi = lds16(lbb.a | fld(w, (c + 1) * 5, 5, 6));
    A[h][r + 2 * j] = lo | (hi << 16);
  }
#endif
}

__device__ __forceinline__ float scale_of(const V4* sv, int u, int r, u32 sc_base) {
  const u32* s = (const u32*)sv;
#if FP16_SCALES
  return h2f_f16((s[u] >> (16 * r)) & 0xFFFFu);       /* 16 halves: index 2u + r */
#else
  return ldsf(sc_base + (byte_of(s[u >> 1], 2 * (u & 1) + r) << 2));  /* 16 bytes: index 2u + r */
#endif
}

__device__ __forceinline__ void build_table(u32* s_tab, const float* __restrict__ cb, u32 tid, u32 nt) {
#if K_BITS == 4
  for (u32 i = tid; i < 256 * 32; i += nt) {
    const u32 e = i >> 5;
    s_tab[i] = (u32)f2h(cb[e & 15]) | ((u32)f2h(cb[e >> 4]) << 16);
  }
#elif K_BITS == 3
  for (u32 i = tid; i < 64 * 32; i += nt) {
    const u32 e = i >> 5;
    s_tab[i] = (u32)f2h(cb[e & 7]) | ((u32)f2h(cb[e >> 3]) << 16);
  }
#elif K_BITS == 2
  /* no table: lookup() reads the four codebook halves from registers (lane_bits) */
#else
  for (u32 i = tid; i < 32 * 32; i += nt) ((u16*)s_tab)[i] = f2h(cb[i >> 5]);
#endif
}

__device__ __forceinline__ LB lane_bits(u32 tab, u32 lane, const float* __restrict__ cb) {
#if K_BITS == 2
  return LB{(u32)f2h(cb[0]) | ((u32)f2h(cb[1]) << 16), (u32)f2h(cb[2]) | ((u32)f2h(cb[3]) << 16)};
#elif K_BITS == 5
  return LB{tab | (lane << 1), 0u};
#else
  return LB{tab | (lane << 2), 0u};
#endif
}


/* ---------------------------------------------------------------------------------------------- block table
   Rows [0, P) in groups of equal expert id (runs; sorted rows: one run an expert). A block is at most BM
   consecutive rows of one run, cut from the run's start: blk[b] = first row of block b (b < nblk[0]),
   blk[nblk[0]] = P; block b is rows [blk[b], blk[b + 1]). One CTA of NT threads, each a contiguous chunk;
   two scans in shared memory (max: the run start entering each chunk; sum: block starts before it). */
#define NT_BLK 1024
extern "C" __global__ void __launch_bounds__(NT_BLK) kbit_moe_blocks(const int* __restrict__ eid, int P, int BM,
                                                                     int* __restrict__ blk, int* __restrict__ nblk) {
  __shared__ int s_a[NT_BLK];
  const int tid = threadIdx.x;
  const int C = (P + NT_BLK - 1) / NT_BLK;
  const int r0 = min(P, tid * C), r1 = min(P, r0 + C);
  int lastb = -1;
  for (int r = r0; r < r1; ++r)
    if (r == 0 || eid[r] != eid[r - 1]) lastb = r;
  s_a[tid] = lastb;
  __syncthreads();
  for (int off = 1; off < NT_BLK; off <<= 1) {
    const int v = tid >= off ? s_a[tid - off] : -1;
    __syncthreads();
    s_a[tid] = max(s_a[tid], v);
    __syncthreads();
  }
  const int rs = tid > 0 ? s_a[tid - 1] : -1;
  __syncthreads();
  int cnt = 0, run = rs;
  for (int r = r0; r < r1; ++r) {
    if (r == 0 || eid[r] != eid[r - 1]) run = r;
    if ((r - run) % BM == 0) ++cnt;
  }
  s_a[tid] = cnt;
  __syncthreads();
  for (int off = 1; off < NT_BLK; off <<= 1) {
    const int v = tid >= off ? s_a[tid - off] : 0;
    __syncthreads();
    s_a[tid] += v;
    __syncthreads();
  }
  int b = tid > 0 ? s_a[tid - 1] : 0;
  const int total = s_a[NT_BLK - 1];
  run = rs;
  for (int r = r0; r < r1; ++r) {
    if (r == 0 || eid[r] != eid[r - 1]) run = r;
    if ((r - run) % BM == 0) blk[b++] = r;
  }
  if (tid == 0) {
    blk[total] = P;
    nblk[0] = total;
  }
}

#ifdef NG
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
  const int nb = *nblk;
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
#endif
"""
