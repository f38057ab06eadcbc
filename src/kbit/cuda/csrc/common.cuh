/* Device helpers of the k-bit tensor-core kernels (layout "mma-v1", kbit.ops.gemv_mma.repack): types, loads,
   the mma.sync wrappers, code lookups, lookup tables, scale reads and programmatic dependent launch.

   Layout read: per 16-row tile and 256-column segment, lane l = 4g + t of a warp owns rows g, g + 8 and columns
   32u + 8t .. 32u + 8t + 7 of each 32-column unit u = 0..7: 128 codes, stored as a k-bit little-endian bit stream
   in 4k words (k 16-byte vectors, vector v of all 32 lanes contiguous). The mma K index is permuted so that the B
   fragment of a lane is the 16 contiguous bytes x[token, 32u + 8t ..]: mma h (0, 1) of unit u takes columns
   8t + 4h + {0, 1} (b0 b1) and 8t + 4h + {2, 3} (b2 b3). Scales per (tile, segment): [8 g][16] (byte / half
   2u + r = row g + 8r, unit u), expanded to 32-column blocks.

   Defines read here (the including .cu documents the values its kernels take):
     K_BITS       bits a code: 2, 3, 4, 5
     NG           8-token column groups a tile (1, 2, 4, 8, ...)
     BF16         activations: 1 bf16, 0 fp16
     FP16_SCALES  block scales: 1 fp16, 0 log8 bytes
     XS           (optional, default 0) 1: x is staged in shared memory (kernel gemv_mma_streamk)
     XT           (optional, default 0) 1: K is not a multiple of 256: x's columns from kx (a kernel argument) on
                  read as zero, so x is read in place, not through a zero-padded copy (the weight's padding
                  columns between K and the block boundary hold codes of nonzero values)
     L2PF         (optional, default 0) bytes of weights l2_prefetch() pulls into L2 before the PDL wait
     P5           (optional, default 0; k = 5, kernel 3 only) 1: look up pairs of codes in one 1024-entry table
                  (128 KB: one CTA an SM), one shared load a pair instead of two */
#pragma once
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) V4 { u32 x, y, z, w; };
struct __align__(8) V2 { u32 x, y; };

#define SEG 256
#define NW (4 * K_BITS)        /* code words per lane per segment */
#define SV (FP16_SCALES ? 2 : 1) /* scale vectors per lane per segment */

#ifndef P5
#define P5 0
#endif
#if P5 && K_BITS != 5
#error "P5: the pair table is for K_BITS 5"
#endif
#if K_BITS == 2
#define TAB_WORDS 4 /* unused: k = 2 looks up from registers */
#elif K_BITS == 3
#define TAB_WORDS (64 * 32)
#elif K_BITS == 4
#define TAB_WORDS (256 * 32)
#elif P5
#define TAB_WORDS (1024 * 32) /* k = 5, P5: a word (lo, hi) per (code pair, lane), as k = 3, 4 */
#else
#define TAB_WORDS (32 * 32) /* k = 5: a 32-bit word (h, h) per (code, lane): lane l reads bank l */
#endif

/* the table lives in dynamic shared memory after the pipeline stages, aligned to TAB_ALIGN so that the
   lookup address is (field | lane bits | table address) in one LOP3 (k = 3, 5) */
#if K_BITS == 3
#define TAB_ALIGN 8192
#elif K_BITS == 5 && P5
#define TAB_ALIGN 128 /* a 128 KB alignment would waste up to 128 KB: the pair's field is added, not ORed */
#elif K_BITS == 5
#define TAB_ALIGN 4096
#elif K_BITS == 4
#define TAB_ALIGN 128 /* lane bits 2..6 are ORed in */
#else
#define TAB_ALIGN 16
#endif
__shared__ float s_sc[256];

/* Programmatic dependent launch (sm_90+; no-ops when the launch did not ask for it, and compiled out below
   sm_90). A kernel launched with the attribute may start while the previous kernel of the stream still runs:
   everything before pdl_wait() may read only weights (codes, scales, codebook, tensor scale, bias); x, the
   routing tables, y and the workspace are touched after it. pdl_launch() lets the next kernel start its own
   weight prologue as soon as every CTA of this one is resident. */
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Before pdl_wait(): pull the first L2PF bytes of this warp's (kernel 3) or CTA's (kernel 1) weight range into
   L2 with one bulk prefetch, so that they stream while the previous kernel finishes (sm_90; L2PF = 0: off). */
#ifndef L2PF
#define L2PF 0
#endif
__device__ __forceinline__ void l2_prefetch(const void* p, long long bytes) {
#if __CUDA_ARCH__ >= 900
  bytes = bytes < (long long)L2PF ? bytes : (long long)L2PF;
  if (L2PF > 0 && bytes >= 16)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"((u32)(bytes & ~15LL)) : "memory");
#endif
}
__device__ __forceinline__ V4 ld_stream(const V4* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
#ifndef GRP
#define GRP 0
#endif
#if GRP
/* GRP (kernel 3 only): a few tokens' MoE pairs as one GEMV over their experts' stacked tiles
   (kbit.ops.gemv_mma.pairs_linear). Stacked tile t belongs to pair p = t / s_gnte and reads tile t - p s_gnte of
   expert e_p of the stack (s_goff); s_gets[s_geid[p]] is that expert's tensor scale, s_gxr[p] its x row, s_gxs x's
   row stride (in global memory, or of the rows staged in shared memory). The kernel fills s_goff, s_geid and s_gxr
   after its PDL wait (the expert ids and rows are the routing launch's output) and s_gets, the stack's tensor
   scales, before it (they are weights): so a pair's scale is not a load that waits for its expert id. */
#define GRP_MAXP 64  /* at most the threads of a CTA (4 warps and up) */
#define GRP_MAXE 512 /* experts of a stack (kbit.ops.gemv_mma.PAIRS_MAX_EXPERTS) */
__shared__ long long s_goff[GRP_MAXP]; /* (expert - pair) x the (tile, segment) pairs of an expert */
__shared__ int s_geid[GRP_MAXP];      /* expert of each pair */
__shared__ float s_gets[GRP_MAXE];    /* tensor scale of each expert of the stack */
__shared__ int s_gxr[GRP_MAXP];       /* x row of each pair */
__shared__ int s_gnte, s_gupe, s_gxs;  /* an expert's tiles and (tile, segment) pairs; x's row stride */
/* the stack's (tile, segment) pair of stacked pair j: pair p's run of s_gupe moved to its expert's */
__device__ __forceinline__ long long grp_unit(long long j) { return j + s_goff[(int)j / s_gupe]; }
/* x's offset for stacked tile t: its pair's row */
__device__ __forceinline__ long long grp_xoff(int t) { return (long long)s_gxr[t / s_gnte] * s_gxs; }
#else
__device__ __forceinline__ long long grp_xoff(int) { return 0; }
#endif
/* the codes (K_BITS vectors) and scales (SV) a lane holds of (tile, segment) pair j, in memory order (kernel 3's
   register ring, kbit_deq_mma) */
__device__ __forceinline__ void ld_seg(V4 (&b)[K_BITS + SV], const V4* __restrict__ codes,
                                       const V4* __restrict__ scales, long long j, u32 lane, int g) {
#if GRP
  j = grp_unit(j);
#endif
#pragma unroll
  for (int v = 0; v < K_BITS; ++v) b[v] = ld_stream(codes + (j * K_BITS + v) * 32 + lane);
#pragma unroll
  for (int v = 0; v < SV; ++v) b[K_BITS + v] = ld_stream(scales + (j * 8 + g) * SV + v);
}
#ifndef XS
#define XS 0
#endif
#ifndef XT
#define XT 0
#endif
__device__ __forceinline__ V4 ld_x(const void* p) {
  V4 r;
#if XS /* x staged in shared memory (kernel 3): p is a generic pointer into it */
  asm("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "r"((u32)__cvta_generic_to_shared(p)));
#elif NG >= 4 /* keep the loads next to their use: hoisting all 8 units' B fragments would spill */
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
     selector nibbles (2c, 2c + 1) of the codebook's halves in lbb.a (entries 0, 1) and lbb.b (2, 3). (Both registers'
     selectors from one IMAD.WIDE save a shift but cost registers: 1.15-1.19x slower at M = 1 on an H200.) */
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
#elif P5
  /* codes c, c + 1 are the 10 stream bits from 5c: one entry (lo, hi) of the pair table */
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int h = f >> 2, j = (f >> 1) & 1, r = f & 1;
    A[h][r + 2 * j] = lds32(lbb.a + fld(w, (u * 16 + 2 * f) * 5, 10, 7));
  }
#else
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int h = f >> 2, j = (f >> 1) & 1, r = f & 1;
    const int c = u * 16 + 2 * f;
    /* entries are (h, h) words at code * 128 + lane * 4: every lane its own bank, one wavefront a load */
    const u32 lo = lds32(lbb.a | fld(w, c * 5, 5, 7));
    const u32 hi = lds32(lbb.a | fld(w, (c + 1) * 5, 5, 7));
    A[h][r + 2 * j] = prmt(lo, hi, 0x7610u);
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

/* a table entry's half for code e: its codebook value, or (IDX: kbit_deq_mma) the code itself */
template <bool IDX>
__device__ __forceinline__ u32 cbv(const float* __restrict__ cb, u32 e) { return IDX ? e : (u32)f2h(cb[e]); }
template <bool IDX = false>
__device__ __forceinline__ void build_table(u32* s_tab, const float* __restrict__ cb, u32 tid, u32 nt) {
#if K_BITS == 4
  for (u32 i = tid; i < 256 * 32; i += nt) {
    const u32 e = i >> 5;
    s_tab[i] = cbv<IDX>(cb, e & 15) | (cbv<IDX>(cb, e >> 4) << 16);
  }
#elif K_BITS == 3
  for (u32 i = tid; i < 64 * 32; i += nt) {
    const u32 e = i >> 5;
    s_tab[i] = cbv<IDX>(cb, e & 7) | (cbv<IDX>(cb, e >> 3) << 16);
  }
#elif K_BITS == 2
  /* no table: lookup() reads the four codebook halves from registers (lane_bits) */
#elif P5
  for (u32 i = tid; i < 1024 * 32; i += nt) {
    const u32 e = i >> 5;
    s_tab[i] = cbv<IDX>(cb, e & 31) | (cbv<IDX>(cb, e >> 5) << 16);
  }
#else
  for (u32 i = tid; i < 32 * 32; i += nt) {
    const u32 v = cbv<IDX>(cb, i >> 5);
    s_tab[i] = v | (v << 16);
  }
#endif
}

template <bool IDX = false>
__device__ __forceinline__ LB lane_bits(u32 tab, u32 lane, const float* __restrict__ cb) {
#if K_BITS == 2
  return LB{cbv<IDX>(cb, 0) | (cbv<IDX>(cb, 1) << 16), cbv<IDX>(cb, 2) | (cbv<IDX>(cb, 3) << 16)};
#else
  return LB{tab | (lane << 2), 0u};
#endif
}
