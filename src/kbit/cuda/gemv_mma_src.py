"""CUDA source of the swap-AB tensor-core small-M kernel (``kbit.ops.gemv_mma``).

Compiled by NVRTC with ``#define``s: K_BITS (2..5), NG (8-token column groups: 1, 2, 4, 8), U (256-column
segments per warp step), BF16 (0/1: activation dtype), FP16_SCALES (0: log8 bytes, 1: fp16). No CUDA header
is included; PTX is inline.

Layout read (``kbit.ops.gemv_mma.repack``): per 16-row tile and 256-column segment, lane l = 4g + t of a warp
owns rows g, g + 8 and columns 32u + 8t .. 32u + 8t + 7 of each 32-column unit u = 0..7: 128 codes, stored as
a k-bit little-endian bit stream in 4k words (k 16-byte vectors, vector v of all 32 lanes contiguous). The
mma K index is permuted so that the B fragment of a lane is the 16 contiguous bytes x[token, 32u + 8t ..]:
mma h (0, 1) of unit u takes columns 8t + 4h + {0, 1} (b0 b1) and 8t + 4h + {2, 3} (b2 b3).
Scales per (tile, segment): [8 g][16] (byte / half 2u + r = row g + 8r, unit u), expanded to 32-column blocks.
"""

# The device helpers (types, loads, mma wrappers, code lookups, tables, programmatic dependent launch) that the
# grouped kernel source (``kbit.cuda.grouped_mma_src``) shares.
HELPERS = r"""
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
#define TAB_WORDS (32 * 32) /* k = 5: a 32-bit word (h, h) per (code, lane): lane l reads bank l */
#endif

/* the table lives in dynamic shared memory after the pipeline stages, aligned to TAB_ALIGN so that the
   lookup address is (field | lane bits | table address) in one LOP3 (k = 3, 5) */
#if K_BITS == 3
#define TAB_ALIGN 8192
#elif K_BITS == 5
#define TAB_ALIGN 4096
#elif K_BITS == 4
#define TAB_ALIGN 128 /* lane bits 2..6 are ORed in */
#else
#define TAB_ALIGN 16
#endif
__shared__ float s_sc[256];

/* Lab timeline (``TL`` define, ``KBIT_LAB_DEFINES=TL=1``; scripts/k3_timeline.py): lane 0 of each warp stamps
   %globaltimer at event e (0..7) into kbit_tl[global warp * 8 + e]; the host reads the module global. */
#ifdef TL
__device__ unsigned long long kbit_tl[1 << 16];
#define TLS(e) do { if ((threadIdx.x & 31) == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) :: "memory"); \
    kbit_tl[((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 8 + (e)] = t_; \
    if ((e) == 0) { u32 sm_; asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_)); \
      kbit_tl[((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 8 + 7] = sm_ + 1; } } } while (0)
#else
#define TLS(e) do {} while (0)
#endif

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
/* the codes (K_BITS vectors) and scales (SV) a lane holds of (tile, segment) pair j, in memory order (kernel 3's
   register ring, kbit_deq_mma) */
__device__ __forceinline__ void ld_seg(V4 (&b)[K_BITS + SV], const V4* __restrict__ codes,
                                       const V4* __restrict__ scales, long long j, u32 lane, int g) {
#pragma unroll
  for (int v = 0; v < K_BITS; ++v) b[v] = ld_stream(codes + (j * K_BITS + v) * 32 + lane);
#pragma unroll
  for (int v = 0; v < SV; ++v) b[K_BITS + v] = ld_stream(scales + (j * 8 + g) * SV + v);
}
#ifndef XS
#define XS 0
#endif
#ifndef XK /* kernel 3 with XS: K slices of XK segments, x[:, slice] staged a CTA (0: the whole of x) */
#define XK 0
#endif
#if XK && (PRO || DET || !XS)
#error "XK: K slices need XS and exclude PRO (a norm over the whole row) and DET (slots by memory order)"
#endif
#ifndef K1EARLY /* kernel 1: the first segment's loads before the table build, built by shuffles (1; M <= 8 below
                   BIG: faster there) or after it and the CTA barrier (0: 8192x28672 k = 3, 4 were 6-10% faster) */
#define K1EARLY 0
#endif
#ifndef M1 /* kernels 1 and 3: 1 = M is 1 (the segment skips the accumulators of token 2t + 1) */
#define M1 0
#endif
#ifndef DET /* kernels 1 and 3: 1 = split-K parts added in a fixed order (bit-identical runs), 0 = fp32 atomics */
#define DET 0
#endif
#ifndef PRO
#define PRO 0
#endif
#ifndef EPI
#define EPI 0
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
#ifdef LAB_NOLDS /* lab (kernel 7 diagnosis): the table address as the value, no shared load (wrong results) */
    A[h][r + 2 * j] = lbb.a + (byte_of(w[2 * u + (f >> 2)], f & 3) << 7);
#else
    A[h][r + 2 * j] = lds32(lbb.a + (byte_of(w[2 * u + (f >> 2)], f & 3) << 7));
#endif
  }
#elif K_BITS == 2 && defined(LAB_K2NOLUT) /* lab: the code word as every A register (wrong results) */
#pragma unroll
  for (int s = 0; s < 4; ++s) A[0][s] = A[1][s] = w[u];
#elif K_BITS == 2
  /* register lookup (no shared memory): word u holds code (h, j, r, e) at bit 16h + 8e + 4j + 2r, so the 2-bit
     slot s = 2j + r of bytes (2h, 2h + 1) is the pair (e = 0, 1) of A[h][r + 2j]. Each byte c becomes the
     selector nibbles (2c, 2c + 1) of the codebook's halves in lbb.a (entries 0, 1) and lbb.b (2, 3). (Session 20
     tried both registers' selectors from one IMAD.WIDE, m * 0x00220022 + 0x1010101010101010: 9% fewer
     instructions in kernel 3's loop, same GEMV speed, but kernel 1 grew from 94 to 128 registers and the
     Llama-3-8B k = 2 decode step was ~40 us slower; docs/notes/gemv.md, session 20.) */
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
#elif K_BITS == 5
  return LB{tab | (lane << 2), 0u};
#else
  return LB{tab | (lane << 2), 0u};
#endif
}

"""

SOURCE = HELPERS + r"""
__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(D - 1) : "memory"); }
__device__ __forceinline__ void cp_wait_d2() {
  asm volatile("cp.async.wait_group %0;" :: "n"(D >= 2 ? D - 2 : 0) : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ V4 lds128(u32 a) {
  V4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}

/* one 256-column segment of one 16-row tile: codes w (4k words), scales sw, x pointers xs (column 0 of the
   segment) -> acc */
__device__ __forceinline__ void segment(const u32* w, const V4* sw, const u16* const* xs, LB lbb, u32 sc_base,
                                        float (&acc)[NG][4]) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    V4 xb[NG];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) xb[ng] = ld_x(xs[ng] + 32 * u);
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

#define STAGE_BYTES ((K_BITS + SV) * 512)

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
   few do (its read-back waits for one 16-byte load at a time) and at M = 1, where half a lane's values are past M
   (2-3 us a call: benchmarks/results/h100/m1-s15-ws4-ab.log). */
#ifndef WS4
#define WS4 0 /* kbit.ops.gemv_mma.plan sets it where a tile has many parts (WS4_PARTS); NG > 1 only */
#endif
#if WS4 && NG == 1
#error "WS4 needs NG > 1"
#endif
#ifndef WS4U
#define WS4U 1 /* the read-back's loads in flight at once: 1 or NG (lab) */
#endif
#define KB_STR(x) #x
#define KB_XSTR(x) KB_STR(x)
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
#if defined(LAB_NOFIX) && (LAB_NOFIX & (XS ? 1 : 2)) /* lab: every part stores its partial sums as the tile's
  output (wrong results): the fix-up's cost; LAB_NOFIX bit 0: builds with x staged (XS), bit 1: the others */
  contrib = total;
#endif
  if (contrib == total) {
    store_tile(acc, tile, lane, M, N, y, y_stride, bias, bias_kind, post);
    return;
  }
  if (add_partials(acc, tile, lane, M, N, post, ws, cnt, tile, contrib, total, ws_stride)) {
#if WS4
    /* WS4U = 1: one 16-byte load in flight at a time: unrolled, the loads raised kernel 7 (NG = 4) from 127 to 139
       registers, one CTA an SM instead of two, and made big weights 15-35% slower at M = 32 */
    _Pragma(KB_XSTR(unroll WS4U))
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
#else
  for (u32 i = tid; i < 256; i += nt) {
    const u32 h = cbh(c, i >> 3);
    sts128(tab + i * 16, h | (h << 16), h | (h << 16));
  }
#endif
}
#if KERNEL == 1
/* CTA per (tile, K split): its W warps take the split's segments round-robin (register double buffer, the
   first segment of the warp's next item prefetched before this item's reduction), partial sums reduced in
   shared memory; split K across CTAs is fixed up in an fp32 workspace by the last CTA of the tile (DET: warps
   added in warp order, a workspace slot a split added in split order: deterministic). */
/* the warp's walk over (item, segment) pairs (first) and its segment loads (load); the first load issued.
   K1EARLY: before the table build, else after the CTA barrier (as before session 16: same SASS) */
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
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2;
  TLS(0);
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
  TLS(1);
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
  TLS(2);
#ifdef TL
  bool tl_first = true;
#endif
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
        segment((const u32*)cw, sw, xs, lbb, sc_base, acc);
#ifdef TL
        if (tl_first) { TLS(4); tl_first = false; }
#endif
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
    TLS(5);
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
  TLS(6);
}
#elif KERNEL == 3
/* stream-K over segments: the Nt x S (tile, segment) pairs, in memory order, are cut into equal contiguous
   ranges, one a warp (grid = CTAs that fit at once). A warp streams its range through a ring of PD register
   buffers (PD - 1 segments in flight while one is computed; no CTA barrier, no drain between tiles); a tile
   that lies wholly in the range is written directly, a part of one is added to the fp32 workspace (DET: goes
   to its own workspace slot) and the warp that completes the tile's segment count (counter) writes it (DET:
   adds the slots in a fixed order, finish_det: bit-identical outputs run to run). */
#if PRO || EPI
__device__ __forceinline__ float rnd(float f) { return h2f(f2h(f)); }
#endif
#if PRO
/* x prologues (kernel 3 with x in shared memory), in the arithmetic of transformers' eager code (every value it
   holds in the activation dtype rounded to it here too):
   PRO 1: RMSNorm  x' = w * (x * rsqrt(mean(x^2) + eps)), the mean over the first kin columns;
   PRO 2: residual add + RMSNorm: r = x + res (CTA 0 writes r to res_out), x' = RMSNorm(r).
   The norm weight w is staged in shared memory (sw) before the PDL wait. Columns from kin on are zero. */
__device__ __forceinline__ float vh(const V4& v, int e) {
  const u32 w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
  return h2f((w >> (16 * (e & 1))) & 0xFFFFu);
}
__device__ __forceinline__ V4 pack8(const float (&f)[8]) {
  V4 r;
  r.x = (u32)f2h(f[0]) | ((u32)f2h(f[1]) << 16);
  r.y = (u32)f2h(f[2]) | ((u32)f2h(f[3]) << 16);
  r.z = (u32)f2h(f[4]) | ((u32)f2h(f[5]) << 16);
  r.w = (u32)f2h(f[6]) | ((u32)f2h(f[7]) << 16);
  return r;
}
__shared__ float s_pro[32];
__device__ __forceinline__ void stage_w(V4* sw, const u16* __restrict__ nw, int kin, u32 tid) {
  for (int c = (int)tid; c < (kin >> 3); c += (int)blockDim.x) sw[c] = *(const V4*)(nw + 8 * c);
}
#define PRO_U 4 /* vectors a thread loads at once */
__device__ __forceinline__ void stage_x_prologue(V4* sx, const V4* sw, const u16* __restrict__ x, int x_stride,
                                                 int M, int xv, const u16* __restrict__ res,
                                                 u16* __restrict__ res_out, float eps, int kin, int r_stride,
                                                 u32 tid, u32 lane, u32 warp, u32 W) {
  const int nv = kin >> 3;  /* 8-column vectors that hold data (kin % 8 == 0) */
  const int bd = (int)blockDim.x;
  for (int tok = 0; tok < M; ++tok) {
    float ss = 0.0f;
    for (int c0 = (int)tid; c0 < xv; c0 += PRO_U * bd) {
      V4 v[PRO_U], r[PRO_U];
#pragma unroll
      for (int u = 0; u < PRO_U; ++u) {
        const int c = c0 + u * bd;
        v[u] = r[u] = V4{0u, 0u, 0u, 0u};
        if (c < nv) {
          v[u] = *(const V4*)(x + (long long)tok * x_stride + 8 * c);
#if PRO == 2
          r[u] = *(const V4*)(res + (long long)tok * r_stride + 8 * c);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < PRO_U; ++u) {
        const int c = c0 + u * bd;
        if (c < xv) {
#if PRO == 2
          float f[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] = vh(v[u], e) + vh(r[u], e);
          v[u] = pack8(f);
          if (blockIdx.x == 0 && c < nv) *(V4*)(res_out + (long long)tok * r_stride + 8 * c) = v[u];
#endif
#pragma unroll
          for (int e = 0; e < 8; ++e) { const float f = vh(v[u], e); ss += f * f; }
          sx[tok * xv + c] = v[u];
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) s_pro[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (u32 w = 0; w < W; ++w) tot += s_pro[w];
    const float rs = rsqrtf(tot / (float)kin + eps);
    __syncthreads();  /* s_pro is reused by the next token */
    for (int c = (int)tid; c < nv; c += bd) {  /* the vectors this thread wrote above */
      const V4 v = sx[tok * xv + c], wv = sw[c];
      float f[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = vh(wv, e) * rnd(vh(v, e) * rs);
      sx[tok * xv + c] = pack8(f);
    }
  }
}
#endif
#if EPI
/* EPI 1: SiLU * up epilogue of a fused gate/up GEMV: rows [0, N/2) are the gate, [N/2, N) the up projection
   (N/2 % 16 == 0); y [M, N/2] = silu(gate) * up, rounded as transformers rounds (gate, up, silu(gate), the
   product). Every task adds its partial sums to the fp32 workspace; the warp that completes both tiles of a pair
   (counter of the gate tile) writes y. */
/* silu(gate) * up of the rounded gate and up values, rounded as transformers rounds */
__device__ __forceinline__ u16 silu_up(float gv, float uv) { return f2h(rnd(gv / (1.0f + __expf(-gv))) * uv); }
/* y of unit (pair) u from its gate (val) and up (uval) sums, rounded as transformers rounds */
__device__ __forceinline__ void store_pair(const float (&val)[NG][4], const float (&uval)[NG][4], int u, u32 lane,
                                           int M, int N, u16* __restrict__ y, int y_stride,
                                           const void* __restrict__ bias, int bias_kind) {
  const int g = lane >> 2, t = lane & 3, half = N >> 1;
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = u * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (tok < M) {
        const float gv = rnd(val[ng][c] + bias_of(bias, bias_kind, row));
        const float uv = rnd(uval[ng][c] + bias_of(bias, bias_kind, half + row));
        y[(long long)tok * y_stride + row] = silu_up(gv, uv);
      }
    }
}
__device__ __forceinline__ void finish_silu(float (&acc)[NG][4], int tile, u32 lane, int M, int N,
                                            u16* __restrict__ y, int y_stride, const void* __restrict__ bias,
                                            int bias_kind, float post, float* __restrict__ ws,
                                            int* __restrict__ cnt, int contrib, int total, int ws_stride) {
  const int g = lane >> 2, t = lane & 3, half = N >> 1, pair = tile < (half >> 4) ? tile : tile - (half >> 4);
#if defined(LAB_NOFIX) && (LAB_NOFIX & (XS ? 1 : 2)) /* lab: the part's sums stored as y rows (wrong results) */
  store_tile(acc, pair, lane, M, half, y, y_stride, bias, bias_kind, post);
  return;
#endif
  if (!add_partials(acc, tile, lane, M, N, post, ws, cnt, pair, contrib, 2 * total, ws_stride)) return;
#if WS4
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    if (ng * 8 + 2 * t >= M) continue;
    const float4 g4 = take4(ws, pair, ng, lane), u4 = take4(ws, pair + (half >> 4), ng, lane);
    const float gs[4] = {g4.x, g4.y, g4.z, g4.w}, us[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = pair * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (tok < M) {
        const float gv = rnd(gs[c] + bias_of(bias, bias_kind, row));
        const float uv = rnd(us[c] + bias_of(bias, bias_kind, half + row));
        y[(long long)tok * y_stride + row] = silu_up(gv, uv);
      }
    }
  }
#else
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = pair * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (tok < M) {
        float* w = ws + (long long)tok * ws_stride;
        const float gv = rnd(atomicExch(w + row, 0.0f) + bias_of(bias, bias_kind, row));
        const float uv = rnd(atomicExch(w + half + row, 0.0f) + bias_of(bias, bias_kind, half + row));
        y[(long long)tok * y_stride + row] = silu_up(gv, uv);
      }
    }
#endif
  if (lane == 0) atomicExch(&cnt[pair], 0);
}
#endif
/* Deterministic fix-up of a tile split over several warps: each part writes its partial sums (128 NG floats, element
   (ng, c, lane)) to its own slot of the tile, slot ceil(seg_first / L) with L the shortest warp range (so that two
   parts of a tile never share one), and the warp that completes the tile's count adds the tile's spt slots in
   slot order and zeroes them (unused slots are zero at rest, and adding them changes nothing). A sum therefore
   does not depend on which warp arrived first: outputs are bit-identical run to run. */
__device__ __forceinline__ bool slot_arrive(const float (&acc)[NG][4], float* __restrict__ slot, u32 lane,
                                            float post, int* __restrict__ cnt, int c_idx, int contrib, int total) {
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 4; ++c) __stcg(slot + (ng * 4 + c) * 32 + lane, acc[ng][c] * post);
  return arrive(cnt, c_idx, contrib, total, lane);
}
/* the sums of a tile's spt slots (in slot order) for this lane's elements; the slots are zeroed */
__device__ __forceinline__ void slot_sum(float* __restrict__ base, int spt, u32 lane, float (&v)[NG][4]) {
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) v[ng][0] = v[ng][1] = v[ng][2] = v[ng][3] = 0.0f;
#pragma unroll 8 /* the loads of 8 slots in flight at once, not one L2 round trip a slot */
  for (int q = 0; q < spt; ++q)
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) v[ng][c] += __ldcg(base + q * (NG * 128) + (ng * 4 + c) * 32 + lane);
  for (int q = 0; q < spt; ++q)
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) __stcg(base + q * (NG * 128) + (ng * 4 + c) * 32 + lane, 0.0f);
}
/* finish() with the slot fix-up */
__device__ __forceinline__ void finish_det(float (&acc)[NG][4], int tile, int seg_first, int L, int spt, u32 lane,
                                           int M, int N, u16* __restrict__ y, int y_stride,
                                           const void* __restrict__ bias, int bias_kind, float post,
                                           float* __restrict__ ws, int* __restrict__ cnt, int contrib, int total) {
  float* base = ws + (long long)tile * spt * (NG * 128);
  if (contrib != total) {
    if (!slot_arrive(acc, base + ((seg_first + L - 1) / L) * (NG * 128), lane, post, cnt, tile, contrib, total))
      return;
    slot_sum(base, spt, lane, acc);  /* the tile's sums, in place of this part's */
    post = 1.0f;
    if (lane == 0) atomicExch(&cnt[tile], 0);
  }
  store_tile(acc, tile, lane, M, N, y, y_stride, bias, bias_kind, post);
}
#if EPI
/* finish_silu() with the slot fix-up: the warp that completes both tiles of a (gate, up) pair adds each tile's
   slots */
__device__ __forceinline__ void finish_silu_det(float (&acc)[NG][4], int tile, int seg_first, int L, int spt,
                                                u32 lane, int M, int N, u16* __restrict__ y, int y_stride,
                                                const void* __restrict__ bias, int bias_kind, float post,
                                                float* __restrict__ ws, int* __restrict__ cnt, int contrib,
                                                int total) {
  const int half = N >> 1, pair = tile < (half >> 4) ? tile : tile - (half >> 4);
  float* own = ws + (long long)tile * spt * (NG * 128);
  if (!slot_arrive(acc, own + ((seg_first + L - 1) / L) * (NG * 128), lane, post, cnt, pair, contrib, 2 * total))
    return;
  float (&gs)[NG][4] = acc, us[NG][4];  /* the gate tile's sums in place of this part's */
  slot_sum(ws + (long long)pair * spt * (NG * 128), spt, lane, gs);
  slot_sum(ws + (long long)(pair + (half >> 4)) * spt * (NG * 128), spt, lane, us);
  store_pair(gs, us, pair, lane, M, N, y, y_stride, bias, bias_kind);
  if (lane == 0) atomicExch(&cnt[pair], 0);
}
#endif
#ifndef LFX
#define LFX 0
#endif
#ifndef CAU /* kernel 3: CTA-aligned units, the split-K sums in shared memory only (see cau_part) */
#define CAU 0
#endif
#if LFX && CAU
#error "LFX and CAU exclude each other"
#endif
struct Lfx { int half_t, cj0, cj1, u_lo; };
#if LFX || CAU
#if DET || XK
#error "LFX, CAU: not with DET or XK"
#endif
/* What LFX and CAU share: LFW shared-memory slots a warp, each a part of a tile's sums tagged with its (virtual)
   tile; units of TPU tiles (EPI: a gate / up pair, walked in pair order: virtual tile 2p is gate tile p, 2p + 1
   up tile p). */
__shared__ float4 s_slot[MAXW * LFW * NG * 32];
__shared__ int s_stile[MAXW * LFW];
#define TPU (EPI ? 2 : 1) /* tiles a unit */
__device__ __forceinline__ int vphys(int v, int half_t) { return EPI ? ((v & 1) ? (v >> 1) + half_t : v >> 1) : v; }
/* slot si of the CTA <- this lane's part (acc * post) of virtual tile v */
__device__ __forceinline__ void put_slot(const float (&acc)[NG][4], int v, float post, int si, u32 lane) {
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
    s_slot[(si * NG + ng) * 32 + lane] = make_float4(acc[ng][0] * post, acc[ng][1] * post, acc[ng][2] * post,
                                                     acc[ng][3] * post);
  if (lane == 0) s_stile[si] = v;
}
#endif
#if LFX
/* LFX: the CTA-local fix-up. A warp's part of a tile (EPI: every part; the unit of a fix-up is a tile, EPI a gate /
   up pair of tiles) goes to one of its LFW slots in shared memory, and the warp that completes the count of the
   unit's segments in the CTA's range (a shared counter a unit, LFU of them) adds the unit's slots in warp order
   and writes y (the unit lies wholly in the CTA) or adds the CTA's share to the fp32 workspace and counts it as
   finish() does (the unit crosses a CTA edge). A warp that ends inside the CTA's last unit, when that unit
   crosses the CTA's end, takes that part first (its range rotated), so that no warp ends on a global round trip.
   EPI walks the tiles in pair order (virtual tile 2p: gate tile p, 2p + 1: up tile p), so a pair's two tiles are
   neighbours in the warps' ranges. No fence between the slot stores and the counter: a warp's shared-memory
   operations are performed in issue order (the relaxed atomic is asm volatile with a memory clobber, and the
   reader loads the slots only after its atomic returned); a fence would wait for the ring's loads in flight. */
__shared__ int s_ucnt[LFU];
__device__ __forceinline__ int atoms_add(int* p, int v) {
  int r;
  asm volatile("atom.shared.add.s32 %0, [%1], %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(v) : "memory");
  return r;
}
__device__ __forceinline__ void add_only(const float (&acc)[NG][4], int tile, u32 lane, int M, int N,
                                         float* __restrict__ ws, int ws_stride) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#if WS4
    if (tile * 16 + g < N && ng * 8 + 2 * t < M)
      red_add4(ws_at(ws, tile, ng, lane), acc[ng][0], acc[ng][1], acc[ng][2], acc[ng][3]);
#else
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = tile * 16 + g + 8 * (c >> 1), tok = ng * 8 + 2 * t + (c & 1);
      if (row < N && tok < M) atomicAdd(&ws[(long long)tok * ws_stride + row], acc[ng][c]);
    }
#endif
}
/* a warp's part: contrib segments of virtual tile v; ns segments a tile; nslot: the warp's slots used */
__device__ __forceinline__ void lfx_finish(float (&acc)[NG][4], int v, int contrib, int ns, u32 lane, int M, int N,
                                           u16* __restrict__ y, int y_stride, const void* __restrict__ bias,
                                           int bias_kind, float post, float* __restrict__ ws,
                                           int* __restrict__ cnt, int ws_stride, const Lfx& lf, int& nslot) {
  const int u = EPI ? v >> 1 : v, U = TPU * ns;
  const u32 warp = threadIdx.x >> 5;
#if !EPI
  if (contrib == ns) {
    store_tile(acc, v, lane, M, N, y, y_stride, bias, bias_kind, post);
    return;
  }
#endif
  put_slot(acc, v, post, (int)warp * LFW + nslot++, lane);
  __syncwarp();
  const int loc = min(lf.cj1, (u + 1) * U) - max(lf.cj0, u * U);  /* the unit's segments in this CTA's range */
  int last = 0;
  if (lane == 0) last = atoms_add(&s_ucnt[u - lf.u_lo], contrib) + contrib == loc;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  float val[NG][4], uval[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 4; ++c) val[ng][c] = uval[ng][c] = 0.0f;
  const int v0 = u * TPU;
  for (int i = 0; i < (int)(blockDim.x >> 5) * LFW; ++i) {  /* warp order: the same sums every run */
    const int tv = *(volatile int*)&s_stile[i];
    if (tv == v0 || (EPI && tv == v0 + 1)) {
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        float4 q;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(q.x), "=f"(q.y), "=f"(q.z), "=f"(q.w)
                     : "r"(smem_addr(&s_slot[(i * NG + ng) * 32 + lane])) : "memory");
        float (&d)[4] = tv == v0 ? val[ng] : uval[ng];
        d[0] += q.x; d[1] += q.y; d[2] += q.z; d[3] += q.w;
      }
    }
  }
#if EPI
  if (loc == U) {
    store_pair(val, uval, u, lane, M, N, y, y_stride, bias, bias_kind);
    return;
  }
  add_only(val, u, lane, M, N, ws, ws_stride);  /* the gate tile's share; the up tile's share counts the pair */
  finish_silu(uval, u + lf.half_t, lane, M, N, y, y_stride, bias, bias_kind, 1.0f, ws, cnt, loc, ns, ws_stride);
#else
  if (loc == U) {
    store_tile(val, v, lane, M, N, y, y_stride, bias, bias_kind, 1.0f);
    return;
  }
  finish(val, v, lane, M, N, y, y_stride, bias, bias_kind, 1.0f, ws, cnt, loc, ns, ws_stride);
#endif
}
#elif CAU
/* CAU: CTA-aligned units. CTA b owns the units [b * sps, (b + 1) * sps) (tiles; EPI: gate / up pairs, walked in
   pair order as LFX does) and its warps split their segments evenly. A warp's full tile is written out at once
   (not EPI); every other part goes to one of the warp's LFW slots in shared memory, and after one CTA barrier at
   the end each unit's slots are added in warp order (run-to-run identical sums) and written out. No workspace, no
   counters, no global round trip. */
/* a warp's part: contrib segments of virtual tile v */
__device__ __forceinline__ void cau_part(const float (&acc)[NG][4], int v, int contrib, int ns, u32 lane, int M,
                                         int N, u16* __restrict__ y, int y_stride, const void* __restrict__ bias,
                                         int bias_kind, float post, int& nslot) {
#if !EPI
  if (contrib == ns) {
    store_tile(acc, v, lane, M, N, y, y_stride, bias, bias_kind, post);
    return;
  }
#endif
  put_slot(acc, v, post, (int)(threadIdx.x >> 5) * LFW + nslot++, lane);
}
/* after the CTA barrier: warp w adds up and writes units u_lo + w, + W, ... of [u_lo, u_hi) */
__device__ __forceinline__ void cau_reduce(int u_lo, int u_hi, u32 lane, int M, int N, u16* __restrict__ y,
                                           int y_stride, const void* __restrict__ bias, int bias_kind) {
  const int W = (int)(blockDim.x >> 5);
  for (int u = u_lo + (int)(threadIdx.x >> 5); u < u_hi; u += W) {
    const int v0 = u * TPU;
    float val[NG][4], uval[NG][4];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 4; ++c) val[ng][c] = uval[ng][c] = 0.0f;
    bool any = false;
    for (int i = 0; i < W * LFW; ++i) {  /* warp order */
      const int tv = s_stile[i];
      if (tv == v0 || (EPI && tv == v0 + 1)) {
        any = true;
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) {
          const float4 q = s_slot[(i * NG + ng) * 32 + lane];
          if (tv == v0) {
            val[ng][0] += q.x; val[ng][1] += q.y; val[ng][2] += q.z; val[ng][3] += q.w;
          } else {
            uval[ng][0] += q.x; uval[ng][1] += q.y; uval[ng][2] += q.z; uval[ng][3] += q.w;
          }
        }
      }
    }
#if EPI
    (void)any;
    store_pair(val, uval, u, lane, M, N, y, y_stride, bias, bias_kind);
#else
    if (any) store_tile(val, v0, lane, M, N, y, y_stride, bias, bias_kind, 1.0f);
#endif
  }
}
#endif
/* a warp's range [j0, j1) of (tile, segment) pairs through the register ring buf (its first PD - 1 segments
   already loaded); x rows xr (segment 0 of each 8-token group); epi: the SiLU * up epilogue (EPI builds) */
__device__ __forceinline__ void stream_range(V4 (&buf)[PD][K_BITS + SV], const V4* __restrict__ codes,
                                             const V4* __restrict__ scales, int j0, int j1, int n_seg,
                                             const u16* const (&xr)[NG], LB lbb, u32 sc_base, u32 lane, int g,
                                             int M, int N, u16* __restrict__ y, int y_stride,
                                             const void* __restrict__ bias, int bias_kind, float post,
                                             float* __restrict__ ws, int* __restrict__ cnt, int ws_stride, int L,
                                             int spt, bool epi, int ns, int s_lo, const Lfx& lf, int& nslot) {
  /* j counts (tile, segment) pairs of the warp's K slice [s_lo, s_lo + ns) (XK; else the whole K: ns = n_seg) */
  int tile = j0 / ns, seg = j0 - tile * ns, seg_first = seg;
#if XK || ((LFX || CAU) && EPI) /* the next segment the ring loads (j0 + PD - 1), as (tile, segment of the slice) */
  int pt = tile, ps = seg;
#pragma unroll
  for (int p = 0; p < PD - 1; ++p)
    if (++ps == ns) { ps = 0; ++pt; }
#endif
  float acc[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
  for (int jb = j0; jb < j1; jb += PD) {
#pragma unroll
    for (int p = 0; p < PD; ++p) {
      const int j = jb + p;
      if (j < j1) {
        if (j + PD - 1 < j1) {
#if XK
          ld_seg(buf[(p + PD - 1) % PD], codes, scales, pt * n_seg + s_lo + ps, lane, g);
          if (++ps == ns) { ps = 0; ++pt; }
#elif (LFX || CAU) && EPI /* virtual tile pt */
          ld_seg(buf[(p + PD - 1) % PD], codes, scales, vphys(pt, lf.half_t) * n_seg + ps, lane, g);
          if (++ps == ns) { ps = 0; ++pt; }
#else
          ld_seg(buf[(p + PD - 1) % PD], codes, scales, j + PD - 1, lane, g);
#endif
        }
        const u16* xs[NG];
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) xs[ng] = xr[ng] + seg * SEG;
        segment((const u32*)buf[p], buf[p] + K_BITS, xs, lbb, sc_base, acc);
#ifdef TL
        if (j == j0) TLS(4);
        if (j + 1 == j1) TLS(5);
#endif
        ++seg;
        if (seg == ns || j + 1 == j1) {
#if LFX
          lfx_finish(acc, tile, seg - seg_first, ns, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt,
                     ws_stride, lf, nslot);
#elif CAU
          cau_part(acc, tile, seg - seg_first, ns, lane, M, N, y, y_stride, bias, bias_kind, post, nslot);
#elif DET
#if EPI
          if (epi)
            finish_silu_det(acc, tile, seg_first, L, spt, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt,
                            seg - seg_first, n_seg);
          else
#endif
            finish_det(acc, tile, seg_first, L, spt, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt,
                       seg - seg_first, n_seg);
#else
#if EPI
          if (epi)
            finish_silu(acc, tile, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt, seg - seg_first, n_seg,
                        ws_stride);
          else
#endif
            finish(acc, tile, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt, seg - seg_first, n_seg,
                   ws_stride);
#endif
#pragma unroll
          for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
          if (seg == ns) { seg = 0; ++tile; }
          seg_first = seg;
        }
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride
#if PRO
    , const u16* __restrict__ p_res, u16* __restrict__ p_res_out, const u16* __restrict__ p_nw, float eps,
    int kin, int r_stride
#endif
    ) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2;
  TLS(0);
#if XK /* gridDim.x / n_sl CTAs a K slice, CTA-consecutive; a slice's pairs in memory order over its warps */
  const int n_sl = (n_seg + XK - 1) / XK, cps = (int)gridDim.x / n_sl, sl = (int)blockIdx.x / cps;
  if (sl >= n_sl) return;
  const int s_lo = sl * XK, ns = min(XK, n_seg - s_lo);
  const long long T = (long long)n_tiles * ns, TW = (long long)cps * W;
  const long long gw = (long long)(blockIdx.x - sl * cps) * W + warp;
#else
  const int s_lo = 0, ns = n_seg;
  const long long T = (long long)n_tiles * n_seg, TW = (long long)gridDim.x * W;
  const long long gw = (long long)blockIdx.x * W + warp;
#endif
#if CAU /* the CTA's units [u_lo, u_hi) (sps a CTA), their segments split evenly over its warps */
  const int cu_lo = (int)blockIdx.x * sps, cu_hi = min(cu_lo + sps, n_tiles / TPU);
  const int cc0 = cu_lo * TPU * ns, cn = max(cu_hi - cu_lo, 0) * TPU * ns;
  const int j0 = cc0 + (int)((long long)cn * warp / W), j1 = cc0 + (int)((long long)cn * (warp + 1) / W);
#else
  const int j0 = (int)(T * gw / TW), j1 = (int)(T * (gw + 1) / TW);
#endif
  V4 buf[PD][K_BITS + SV];
#if LFX
  /* the CTA's range [cj0, cj1) and units; a warp that ends inside the CTA's last unit, when that unit crosses the
     CTA's end, starts at that unit (js): [js, j1) first, then [j0, js) */
  Lfx lf;
  lf.half_t = EPI ? n_tiles >> 1 : 0;
  const int U = TPU * ns;
  lf.cj0 = (int)(T * ((long long)blockIdx.x * W) / TW);
  lf.cj1 = (int)(T * ((long long)blockIdx.x * W + W) / TW);
  lf.u_lo = lf.cj0 / U;
  const int u_hi = lf.cj1 > lf.cj0 ? (lf.cj1 - 1) / U : 0;
  const int js = (lf.cj1 < (u_hi + 1) * U && j0 < u_hi * U && j1 > u_hi * U) ? u_hi * U : j0;
  int nslot = 0;
#pragma unroll
  for (int p = 0; p < PD - 1; ++p)  /* in flight while the tables are built */
    if (js + p < j1) ld_seg(buf[p], codes, scales, vphys((js + p) / ns, lf.half_t) * ns + (js + p) % ns, lane, g);
  for (int i = (int)tid; i < MAXW * LFW; i += (int)blockDim.x) s_stile[i] = -1;
  for (int i = (int)tid; i < LFU; i += (int)blockDim.x) s_ucnt[i] = 0;
#elif CAU
  Lfx lf;
  lf.half_t = EPI ? n_tiles >> 1 : 0;
  int nslot = 0;
#pragma unroll
  for (int p = 0; p < PD - 1; ++p)  /* in flight while the tables are built */
    if (j0 + p < j1) ld_seg(buf[p], codes, scales, vphys((j0 + p) / ns, lf.half_t) * ns + (j0 + p) % ns, lane, g);
  for (int i = (int)tid; i < MAXW * LFW; i += (int)blockDim.x) s_stile[i] = -1;
#else
#pragma unroll
  for (int p = 0; p < PD - 1; ++p)  /* in flight while the tables are built */
    if (j0 + p < j1) ld_seg(buf[p], codes, scales, XK ? (j0 + p) / ns * n_seg + s_lo + (j0 + p) % ns : j0 + p, lane, g);
#endif
#if !XK && !LFX && !CAU
  if (lane == 0 && j0 + PD - 1 < j1) { /* the rest of the warp's range, from its start */
    l2_prefetch(codes + (long long)(j0 + PD - 1) * K_BITS * 32, (long long)(j1 - j0 - PD + 1) * K_BITS * 512);
    l2_prefetch(scales + (long long)(j0 + PD - 1) * 8 * SV, (long long)(j1 - j0 - PD + 1) * SV * 128);
  }
#endif
  const float ts = *ts_ptr;
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  build_table_fast(tab, cb, tid, blockDim.x);
  const float post = FP16_SCALES ? ts : 1.0f;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i] * ts;
#if XS /* x rows [M][n_seg * 256] after the table (PRO: then the norm weight); XK: [M][XK * 256 + 32], the 64
          pad bytes put 8-token rows' B-fragment loads in alternate bank halves */
  u16* sx = (u16*)(dsm + (tab - dsm_base) + TAB_WORDS * 4);
  const int xv = XK ? XK * (SEG / 8) + 4 : n_seg * (SEG / 8);
#if PRO
  V4* sw_ = (V4*)sx + M * xv;
  stage_w(sw_, p_nw, kin, tid);  /* a weight: before the wait */
#endif
#endif
  TLS(1);
  pdl_launch();
  pdl_wait();
  TLS(2);
#if XS
#if PRO
  stage_x_prologue((V4*)sx, sw_, x, x_stride, M, xv, p_res, p_res_out, eps, kin, r_stride, tid, lane, warp, W);
#elif XK
  for (int i = (int)tid, nv = ns * (SEG / 8); i < M * nv; i += (int)blockDim.x) {
    const int tok = i / nv, c = i - tok * nv;
    ((V4*)sx)[tok * xv + c] = *(const V4*)(x + (long long)tok * x_stride + s_lo * SEG + 8 * c);
  }
#else
  for (int i = (int)tid; i < M * xv; i += (int)blockDim.x) {
    const int tok = i / xv, c = i - tok * xv;
    ((V4*)sx)[i] = *(const V4*)(x + (long long)tok * x_stride + 8 * c);
  }
#endif
#endif
  __syncthreads();
  TLS(3);
#if !CAU /* (CAU: every warp meets the CTA barrier at the end) */
  if (j0 >= j1) return;
#endif
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc_base = smem_addr(s_sc);
  const u16* xr[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    int tok = ng * 8 + g;
    tok = tok < M ? tok : M - 1;
#if XS
    xr[ng] = sx + (long long)tok * (8 * xv) + 8 * (lane & 3);
#else
    xr[ng] = x + (long long)tok * x_stride + 8 * (lane & 3);
#endif
  }
  const long long Lq = T / TW;  /* the shortest warp range: parts of a tile start at least this far apart */
  const int L = Lq > 0 ? (int)Lq : 1, spt = (n_seg + L - 2) / L + 1;  /* slots a tile (see finish_det) */
#if LFX
  /* [js, j1), then (a rotated warp) [j0, js) through a fresh ring; one copy of the loop (not unrolled: two copies
     in flight on an SM cost instruction-cache misses) */
  int r0 = js, r1 = j1;
#pragma unroll 1
  for (int part = 0; part < 2; ++part) {
    if (part) {
      r0 = j0;
      r1 = js;
#pragma unroll
      for (int p = 0; p < PD - 1; ++p)
        if (r0 + p < r1) ld_seg(buf[p], codes, scales, vphys((r0 + p) / ns, lf.half_t) * ns + (r0 + p) % ns, lane, g);
    }
    if (r0 < r1)
      stream_range(buf, codes, scales, r0, r1, n_seg, xr, lbb, sc_base, lane, g, M, N, y, y_stride, bias,
                   bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot);
  }
#elif CAU
  if (j0 < j1)
    stream_range(buf, codes, scales, j0, j1, n_seg, xr, lbb, sc_base, lane, g, M, N, y, y_stride, bias,
                 bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot);
  __syncthreads();
  cau_reduce(cu_lo, cu_hi, lane, M, N, y, y_stride, bias, bias_kind);
#else
  Lfx lf;
  int nslot = 0;
  stream_range(buf, codes, scales, j0, j1, n_seg, xr, lbb, sc_base, lane, g, M, N, y, y_stride, bias,
               bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot);
#endif
  TLS(6);
}
#elif KERNEL == 4 || KERNEL == 5 || KERNEL == 6 || KERNEL == 7
/* mid M (9..64 tokens): a CTA = MAXW warps x RT row tiles (16 rows each) x one K split. Every 256-column
   segment's x[M][256], codes and scales go through a D-stage cp.async shared-memory pipeline (one CTA barrier a
   segment). x B fragments are read once per unit and used by the warp's RT tiles; block scales are folded into
   the A fragments (packed half2 multiply after the lookup), so every (tile, 8-token group) accumulates straight
   through its mma chain and the per-token-group cost is one LDS.128 and 2 mma per tile. */
#define XROW 576   /* bytes of one x row in a stage: 512 + 64 pad, conflict-free LDS.128 B fragments */
#if KERNEL == 6
#define XSTAGE (8 * NG * 512)  /* wgmma B: core matrices of 8 tokens x 16 bytes, no padding */
#else
#define XSTAGE (8 * NG * XROW)
#endif
#define CSTAGE (MAXW * RT * K_BITS * 512)
#define SSTAGE (MAXW * RT * SV * 128)
#define STAGE4 (XSTAGE + CSTAGE + SSTAGE)
#if BF16
#define SPRE 1.0f
#else
#define SPRE 256.0f   /* log8 scales reach 2^-15.9: pre-scaled so that codebook x scale stays a normal half */
#endif
__shared__ u32 s_sc2[256];
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
#if BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}
/* packed (s, s) of unit u, row half r */
__device__ __forceinline__ u32 scale2(const u32* s, int u, int r, u32 sc2_base) {
#if FP16_SCALES
#if BF16
  const float f = h2f_f16((s[u] >> (16 * r)) & 0xFFFFu);
  u32 d; asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f)); return d;
#else
  u32 d; asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(s[u]), "r"(r ? 0x3232 : 0x1010)); return d;
#endif
#else
  return lds32(sc2_base + (byte_of(s[u >> 1], 2 * (u & 1) + r) << 2));
#endif
}
/* A = T with the block scales folded in: s0 on the rows g (registers 0, 2), s1 on the rows g + 8 (1, 3), both
   mma halves; A may be T */
__device__ __forceinline__ void fold_scales(u32 (&A)[2][4], const u32 (&T)[2][4], u32 s0, u32 s1) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    A[h][0] = hmul2(T[h][0], s0);
    A[h][2] = hmul2(T[h][2], s0);
    A[h][1] = hmul2(T[h][1], s1);
    A[h][3] = hmul2(T[h][3], s1);
  }
}
/* kernels 4-7: the code lookup table and the packed log8 scales (s, s), pre-multiplied by SPRE */
__device__ __forceinline__ void build_tables(u32 tab, const float* __restrict__ cb, const float* __restrict__ e_tab,
                                             u32 tid) {
  build_table_fast(tab, cb, tid, MAXW * 32);
  for (u32 i = tid; i < 256; i += MAXW * 32) {
    const u16 h = f2h(e_tab[i] * SPRE);
    s_sc2[i] = (u32)h | ((u32)h << 16);
  }
}
#if KERNEL == 4
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride) {
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
        cp_async16(sb + row * XROW + c * 16, x + (long long)row * x_stride + seg * SEG + c * 8);
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
#elif KERNEL == 5
/* grouped (MoE): y[r] = x[rows[r]] @ W[e(r)].T for the rows of a block table (kbit.ops.grouped_mma.block_table,
   blocks of <= 8 NG rows of one expert). Items (row block of MAXW x RT tiles, expert block), row-block major;
   CTA q takes items q, q + grid, ... and streams their (item, segment) steps through kernel 4's pipeline
   without draining between items; no split K (deterministic), each warp writes its tiles. */
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_grouped_mma4(
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
  const int nb = *nblk;
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
#else
#ifndef AB
#define AB 4 /* A register buffers (units in flight) */
#endif
/* kernel 6 (sm_90a): kernel 4 with Hopper wgmma. A warpgroup (4 warps, 16 rows each: the mma.sync A fragment of
   a warp is its slice of the m64 wgmma A operand) looks its codes up into registers, folds the block scales, and
   issues wgmma.m64n(8 NG)k16 with B = the x tile read by the tensor cores from shared memory: no x LDS, one
   instruction per 64 rows x 8 NG tokens x 16 columns. x must be pre-permuted to the "mma-v1" K order
   (kbit.ops.gemv_mma._permute_x) so that its 16-byte chunks land in wgmma's no-swizzle K-major core matrices:
   stage byte (c * NG + tok / 8) * 128 + (tok % 8) * 16 holds the 16-byte chunk c (0..31) of token tok. */
__device__ __forceinline__ u64 wg_desc(u32 saddr) {
  /* no swizzle; LBO: K-direction core-matrix stride (NG * 128 B), SBO: N-direction (128 B) */
  u64 d = (u64)((saddr & 0x3FFFF) >> 4);
  d |= (u64)(((NG * 128) >> 4) & 0x3FFF) << 16;
  d |= (u64)((128 >> 4) & 0x3FFF) << 32;
  return d;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
/*WGMMA_FUNCS*/
#if KERNEL == 6
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int n_rb = (n_tiles + MAXW - 1) / MAXW;
  const long long T = (long long)n_rb * n_seg;
  const int j0 = (int)(T * blockIdx.x / gridDim.x), j1 = (int)(T * (blockIdx.x + 1) / gridDim.x);
  extern __shared__ __align__(128) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + D * STAGE4 + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  const u32 st0 = dsm_base;
  auto issue = [&](int j, int slot) {
    if (j < j1) {
      const int rb = j / n_seg, seg = j - rb * n_seg;
      const u32 sb = st0 + slot * STAGE4;
      for (int i = (int)tid; i < M * 32; i += MAXW * 32) {
        const int row = i >> 5, c = i & 31;
        cp_async16(sb + (c * NG + (row >> 3)) * 128 + (row & 7) * 16,
                   x + (long long)row * x_stride + seg * SEG + c * 8);
      }
      const int tile = rb * MAXW + (int)warp;
      if (tile < n_tiles) {
        const long long ts_ = (long long)tile * n_seg + seg;
        const u32 cs = sb + XSTAGE + (warp * K_BITS) * 512 + lane * 16;
#pragma unroll
        for (int v = 0; v < K_BITS; ++v) cp_async16(cs + v * 512, codes + (ts_ * K_BITS + v) * 32 + lane);
        if (lane < 8 * SV)
          cp_async16(sb + XSTAGE + CSTAGE + (warp * 8 * SV + lane) * 16, scales + ts_ * 8 * SV + lane);
      }
    }
  };
  pdl_launch();
  pdl_wait();
#pragma unroll
  for (int s = 0; s < D - 2; ++s) { issue(j0 + s, s); cp_commit(); }  /* D - 2 ahead: a slot is refilled two
                                                                          segments after its wgmmas were issued */
  const float ts = *ts_ptr;
  build_tables(tab, cb, e_tab, tid);
  const float post = FP16_SCALES ? ts : ts * (1.0f / SPRE);
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc2_base = smem_addr(s_sc2);
  float acc[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
  int rb = j0 / n_seg, seg = j0 - rb * n_seg, seg_first = seg, slot = 0;
  for (int j = j0; j < j1; ++j) {
    asm volatile("cp.async.wait_group %0;" :: "n"(D - 3) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    {
      /* slot of segment j - 2: its wgmma groups completed (at most AB - 1 < 8 groups are ever outstanding) */
      int ls = slot + D - 2;
      issue(j + D - 2, ls >= D ? ls - D : ls);
      cp_commit();
    }
    const u32 sb = st0 + slot * STAGE4;
    slot = slot + 1 == D ? 0 : slot + 1;
    const int tile0 = rb * MAXW + (int)warp;
    /* every warp of a warpgroup issues its wgmmas (they are warpgroup-wide): a tile past N computes on stale
       codes, its rows are never written */
    u32 w[NW];
    u32 sw[4 * SV];
    {
      const u32 cs = sb + XSTAGE + (warp * K_BITS) * 512 + lane * 16;
#pragma unroll
      for (int v = 0; v < K_BITS; ++v) {
        V4 q = lds128(cs + v * 512);
        w[4 * v] = q.x; w[4 * v + 1] = q.y; w[4 * v + 2] = q.z; w[4 * v + 3] = q.w;
      }
#pragma unroll
      for (int v = 0; v < SV; ++v) {
        V4 q = lds128(sb + XSTAGE + CSTAGE + (warp * 8 * SV + g * SV + v) * 16);
        sw[4 * v] = q.x; sw[4 * v + 1] = q.y; sw[4 * v + 2] = q.z; sw[4 * v + 3] = q.w;
      }
    }
    u32 A[AB][2][4];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      u32 (&Au)[2][4] = A[u % AB];
      wg_wait<AB - 1>();  /* the group that read A[u % AB] (unit u - AB, maybe of the last segment) is done */
      lookup(w, u, lbb, Au);
      const u32 s0 = scale2(sw, u, 0, sc2_base), s1 = scale2(sw, u, 1, sc2_base);
      fold_scales(Au, Au, s0, s1);
      wg_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h) wg_mma(acc, Au[h], wg_desc(sb + (u * 2 + h) * 2 * NG * 128));
      wg_commit();
    }
    ++seg;
    if (seg == n_seg || j + 1 == j1) {
      wg_wait<0>();  /* accumulators final */
      if (tile0 < n_tiles)
        finish(acc, tile0, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt, seg - seg_first, n_seg,
               ws_stride);
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
      if (seg == n_seg) { seg = 0; ++rb; }
      seg_first = seg;
    }
  }
  wg_wait<0>();
  cp_wait_all();
}
#else
/* kernel 7 (sm_90a, large M): output tiles of MAXW x 16 weight rows x 8 NG tokens (NG = 16, 32), one tile a task,
   K split into `splits` tasks when the tiles are too few for the GPU. Persistent CTAs take tasks blockIdx.x,
   + gridDim.x, ...; tasks are rastered in groups of GM token blocks (the x and the codes that CTAs running at
   once touch stay in L2). Each warpgroup (4 warps x 16 rows) looks its codes up into the m64 wgmma A operand as
   kernel 6 does; B = x chunks of 64 columns (x permuted to the "mma-v1" K order on the host) through a D-stage
   cp.async ring read by the tensor cores. Codes and scales of the next segment are prefetched into registers. */
#define XC (8 * NG * 128)   /* one 64-column chunk of 8 NG tokens: 8 K-direction core matrices x NG */
#if XB == 2 && defined(XLAG)
#define LAG XLAG            /* XB = 2: the producer waits for the stage's empty barrier instead */
#else
#define LAG (AB / 2 + 1)    /* a stage is refilled LAG chunks after the chunk that last read it */
#endif
#ifndef GM
#define GM 8
#endif
#ifndef LKH
/* 1: a chunk's first lookups before the chunk's barrier and TMA wait (they need only the codes, so they overlap
   the wait); 2: also its block scales. H100, k = 4 (benchmarks/results/h100/k7-s13-lkh.log): 2-9% faster than 0 */
#define LKH 2
#endif
#ifndef XSW
#define XSW 1 /* x chunks in wgmma's 128-byte swizzled K-major layout (0: no swizzle, core matrices) */
#endif
#ifndef SK
#define SK 0 /* 1: stream-K over (task, segment) pairs instead of whole tasks (split K) */
#endif
#ifndef XB
#define XB 0 /* 1: x pre-tiled and swizzled on the device (kbit_x_tiles): one bulk copy a chunk, mbarrier */
#endif
#ifndef GRP
#define GRP 0 /* 1: grouped (MoE): token blocks are the blocks of a device block table, each of one expert */
#endif
#if GRP && (SK || !XB)
#error "GRP: x must be pre-tiled (XB) and stream-K is not supported"
#endif
#if XB
__shared__ __align__(8) u64 s_full[8];  /* a chunk's bulk copy landed in stage s */
__shared__ __align__(8) u64 s_empty[8]; /* XB = 2: every warp's wgmmas that read stage s retired */
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
#ifdef MBAR_TRAP /* lab: a wait that fails ~4M times (try_wait suspends a while before it fails) is a deadlock */
  for (u32 n = 0; !mbar_try(bar, parity); ++n)
    if (n == (1u << 22)) asm volatile("trap;");
#else
  while (!mbar_try(bar, parity)) {}
#endif
}
/* one thread: stage `dst` <- `bytes` contiguous global bytes at `src`, completion counted on `bar` */
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
#endif
/* the B descriptor of the k16 step kk (0..3) of an x chunk at shared address sb */
__device__ __forceinline__ u64 x_desc(u32 sb, int kk) {
#if XSW
  /* token rows of 128 bytes, 16-byte chunk c of row r at (c ^ (r % 8)) * 16; 8-row groups 1024 bytes apart
     (SBO); K steps advance the start address by 32 bytes inside the swizzle atom; LBO unused (1) */
  const u32 a = sb + kk * 32;
  return (u64)((a & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
#else
  return wg_desc(sb + kk * 2 * NG * 128);
#endif
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
extern "C" __global__ void __launch_bounds__(MAXW * 32, 1) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride
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
  const int n_rb = (n_tiles + MAXW - 1) / MAXW, n_tb = min(*nblk, M); /* M: the tiles' block count */
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
#if XB == 2
  int l_q = 0;       /* chunks issued (thread 0) */
  u32 ephase = 0;    /* bit s: parity of the next completion of s_empty[s] */
#endif
  auto issue = [&](int slot) {
#if XB
    /* x_stride = 64-column chunks a token block; chunk (tb, c) is XC contiguous bytes */
    if (tid == 0 && l_p < p_end) {
#if XB == 2
      if (l_q >= D) {  /* chunk l_q - D, the stage's last reader, retired in every warp */
        mbar_wait(smem_addr(&s_empty[slot]), (ephase >> slot) & 1);
        ephase ^= 1u << slot;
      }
      ++l_q;
#endif
      bulk_load(dsm_base + slot * XC, x + ((long long)lt.tb * x_stride + lt.s0 * 4 + l_c) * (XC / 2), XC,
                smem_addr(&s_full[slot]));
#else
    if (l_p < p_end) {
      const u32 sb = dsm_base + slot * XC;
      const long long col = (long long)(lt.s0 * 4 + l_c) * 64;
      const int tok0 = lt.tb * BT;
#pragma unroll
      for (int i = (int)tid; i < BT * 8; i += MAXW * 32) {
        /* lanes 0-7: 8 tokens of one core matrix (128 contiguous shared bytes a phase: no bank conflict); lane
           bit 3: the next 16 bytes of the same rows (full 32-byte global sectors); bit 4: the next 8 tokens */
#if XSW
        const int tok = i >> 3, c8 = i & 7;  /* a phase (8 lanes) writes one 128-byte row */
        int row = tok0 + tok;
        row = row < M ? row : M - 1;
        cp_async16(sb + tok * 128 + ((c8 ^ (tok & 7)) << 4), x + (long long)row * x_stride + col + c8 * 8);
#else
        const int rest = i >> 5;  /* = warp + MAXW j: rest % 4 is the warp's (MAXW % 4 == 0), tokens step by 32 */
        const int tok = ((rest >> 2) * 2 + ((i >> 4) & 1)) * 8 + (i & 7);
        const int c8 = (rest & 3) * 2 + ((i >> 3) & 1);
        int row = tok0 + tok;
        row = row < M ? row : M - 1;
        cp_async16(sb + (c8 * NG + (tok >> 3)) * 128 + (tok & 7) * 16, x + (long long)row * x_stride + col + c8 * 8);
#endif
      }
#endif
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
#if XB
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      mbar_init(smem_addr(&s_full[s]), 1);
#if XB == 2
      mbar_init(smem_addr(&s_empty[s]), MAXW);
#endif
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  u32 phase = 0;  /* bit s: parity of the next completion of stage s */
#endif
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
#if XB == 2
  int prev_slot = 0, n_used = 0;
#endif
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
#if LKH && !defined(LAB_NOLOOKUP)
      /* the chunk's first lookups before its barrier: they need only the codes, and overlap the wait */
      lookup(w, 2 * cc, lbb, T);
#endif
#if LKH >= 2
      const u32 s0h = scale2(sw, 2 * cc, 0, sc2_base), s1h = scale2(sw, 2 * cc, 1, sc2_base);
#endif
#if XB
#if XB == 1
      /* every warp is past the wgmma wait that retired chunk c - 2: its stage may be refilled below */
      __syncthreads();
#endif
      mbar_wait(smem_addr(&s_full[slot]), (phase >> slot) & 1);
      phase ^= 1u << slot;
#else
      asm volatile("cp.async.wait_group %0;" :: "n"(D - LAG - 1) : "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
#endif
      const u32 sb = dsm_base + slot * XC;
      const int ls = slot + D - LAG;
      slot = slot + 1 == D ? 0 : slot + 1;
#pragma unroll
      for (int ul = 0; ul < 2; ++ul) {
        const int u = 2 * cc + ul;
        u32 (&Au)[2][4] = A[u % AB];
        /* the table lookups go into temporaries before the wait for the wgmmas that read A[u % AB]: their
           latency overlaps the tensor cores instead of following the wait */
#ifdef LAB_NOLOOKUP /* lab: the code words as A (wrong results): what the lookups cost */
#pragma unroll
        for (int i = 0; i < 8; ++i) T[i >> 2][i & 3] = w[(2 * u + (i >> 2)) % NW];
#else
        if (!LKH || ul == 1) lookup(w, u, lbb, T);
#endif
#if LKH >= 2
        const u32 s0 = ul == 0 ? s0h : scale2(sw, u, 0, sc2_base), s1 = ul == 0 ? s1h : scale2(sw, u, 1, sc2_base);
#else
        const u32 s0 = scale2(sw, u, 0, sc2_base), s1 = scale2(sw, u, 1, sc2_base);
#endif
        wg_wait<AB - 1>();
#if XB == 2
        /* before unit 1 of chunk c, every wgmma group of chunk c - 1 has retired (AB = 2) */
        if (ul == 1 && lane == 0 && n_used > 0) mbar_arrive(smem_addr(&s_empty[prev_slot]));
#endif
#ifdef LAB_NOFOLD /* lab: no block scales (wrong results): what the fold costs */
#pragma unroll
        for (int i = 0; i < 8; ++i) Au[i >> 2][i & 3] = T[i >> 2][i & 3] ^ (i == 0 ? s0 ^ s1 : 0u);
#else
        fold_scales(Au, T, s0, s1);
#endif
        wg_fence();
#pragma unroll
        for (int h = 0; h < 2; ++h) wg_mma(acc, Au[h], x_desc(sb, ul * 2 + h));
        wg_commit();
      }
#if XB == 2
      prev_slot = slot == 0 ? D - 1 : slot - 1;  /* slot has advanced: the stage this chunk read */
      ++n_used;
#endif
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
#endif
#endif
#else
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride) {
  pdl_launch();
  pdl_wait();
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float ts = *ts_ptr;
  /* ---- tables ---- */
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + W * (D * STAGE_BYTES) + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  build_table((u32*)(dsm + (tab - dsm_base)), cb, tid, blockDim.x);
  const float post = FP16_SCALES ? ts : 1.0f;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i] * ts;
  __syncthreads();

  /* ---- this warp's tasks: gw, gw + TW, ... (task = tile * splits + split; sps steps of one segment each) ---- */
  const int gw = (int)warp * (int)gridDim.x + (int)blockIdx.x, TW = (int)(W * gridDim.x);
  const int n_tasks = n_tiles * splits;
  const int my_tasks = n_tasks > gw ? (n_tasks - gw + TW - 1) / TW : 0;
  const int J = my_tasks * sps;
  if (J == 0) return;
  const u32 stage0 = dsm_base + warp * (D * STAGE_BYTES) + lane * 16;
  const LB lbb = lane_bits(tab, lane, cb);
  const u32 sc_base = smem_addr(s_sc);

  const u16* xr[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    int tok = ng * 8 + g;
    tok = tok < M ? tok : M - 1;
    xr[ng] = x + (long long)tok * x_stride + 8 * t;
  }
  /* loader state */
  int l_task = gw, l_step = 0, l_tile = gw / splits;
  int l_seg0 = (gw - l_tile * splits) * sps;
  int jl = 0;
  auto issue = [&](int slot) {
    const long long ts_ = (long long)l_tile * n_seg + l_seg0 + l_step;
    const V4* cp = codes + ts_ * (K_BITS * 32) + lane;
    const u32 sa = stage0 + slot * STAGE_BYTES;
#pragma unroll
    for (int v = 0; v < K_BITS; ++v) cp_async16(sa + v * 512, cp + v * 32);
    const V4* sp = scales + (ts_ * 8 + g) * SV;
#pragma unroll
    for (int v = 0; v < SV; ++v) cp_async16(sa + (K_BITS + v) * 512, sp + v);
    if (++l_step == sps) {
      l_step = 0;
      l_task += TW;
      l_tile = l_task / splits;
      l_seg0 = (l_task - l_tile * splits) * sps;
    }
    ++jl;
  };
#pragma unroll
  for (int i = 0; i < D - 1; ++i) {
    if (jl < J) issue(i);
    cp_commit();
  }
  /* consumer state */
  int c_task = gw, c_step = 0, c_tile = gw / splits;
  int c_seg = (gw - c_tile * splits) * sps;
  float acc[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
  int slot = 0;
  for (int j = 0; j < J; ++j) {
    {
      int ls = slot + D - 1;
      ls = ls >= D ? ls - D : ls;
      if (jl < J) issue(ls);
      cp_commit();
    }
    cp_wait();
    const u32 sa = stage0 + slot * STAGE_BYTES;
    u32 w[NW];
#pragma unroll
    for (int v = 0; v < K_BITS; ++v) {
      V4 q = lds128(sa + v * 512);
      w[4 * v] = q.x; w[4 * v + 1] = q.y; w[4 * v + 2] = q.z; w[4 * v + 3] = q.w;
    }
    V4 sw[SV];
#pragma unroll
    for (int v = 0; v < SV; ++v) sw[v] = lds128(sa + (K_BITS + v) * 512);
    const u16* xs[NG];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) xs[ng] = xr[ng] + c_seg * SEG;
    segment(w, sw, xs, lbb, sc_base, acc);
    slot = slot + 1 == D ? 0 : slot + 1;
    ++c_seg;
    if (++c_step == sps) {
      finish(acc, c_tile, lane, M, N, y, y_stride, bias, bias_kind, post, ws, cnt, 1, splits, ws_stride);
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) acc[ng][0] = acc[ng][1] = acc[ng][2] = acc[ng][3] = 0.0f;
      c_step = 0;
      c_task += TW;
      c_tile = c_task / splits;
      c_seg = (c_task - c_tile * splits) * sps;
    }
  }
}
#endif
"""


def _wgmma_funcs() -> str:
    """``wg_mma(acc, A, desc)``: ``wgmma.mma_async m64n(8 NG)k16``, fp32 accumulators ``acc[NG][4]`` (the n8 chunk j
    of the warp's 16 rows is ``acc[j]``, the layout of NG mma.sync tiles), A from 4 registers, B by descriptor."""
    out = []
    for ng in (1, 2, 4, 8, 16, 32):
        n = 8 * ng
        nacc = 4 * ng
        regs = ", ".join(f"%{i}" for i in range(nacc))
        a = ", ".join(f"%{nacc + i}" for i in range(4))
        cons_o = ", ".join(f'"+f"(acc[{i // 4}][{i % 4}])' for i in range(nacc))
        for bf, dt in ((1, "bf16"), (0, "f16")):
            out.append(f"#if NG == {ng} && BF16 == {bf}\n"
                       "__device__ __forceinline__ void wg_mma(float (&acc)[NG][4], const u32 (&a)[4], u64 desc) {\n"
                       f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt} {{{regs}}}, {{{a}}}, '
                       f'%{nacc + 4}, 1, 1, 1, 0;"\n'
                       f"               : {cons_o}\n"
                       f'               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc) : "memory");\n'
                       "}\n#endif\n")
    return "".join(out)


SOURCE = SOURCE.replace("/*WGMMA_FUNCS*/", _wgmma_funcs())

# x for kernel 7 with XB = 1: the "mma-v1" K permutation, token blocks of BT rows, 64-column chunks, each chunk
# a contiguous [BT][128 bytes] tile in wgmma's 128-byte swizzle (16-byte piece c of row r at (c ^ (r % 8)) * 16),
# rows past M zero. One thread a 16-byte piece: four 4-byte column pairs of one row.
X_TILES_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) V4 { u32 x, y, z, w; };
__device__ __forceinline__ void pdl() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/* the first original column of the 16-byte piece at position pos of row r of chunk ch; its four column pairs
   start there and 8, 16, 24 further on. Piece c of the chunk = permuted columns 8c .. 8c + 7 = original
   32 (c / 4) + 8t + 4h + 2p + e. */
__device__ __forceinline__ int piece_col(int ch, int r, int pos) {
  const int c = pos ^ (r & 7);
  return ch * 64 + (c >> 2) * 32 + 4 * ((c >> 1) & 1) + 2 * (c & 1);
}
/* the 16-byte piece at position pos of row r of chunk ch, from x row `row` (< 0: zeros) */
__device__ __forceinline__ V4 piece(const u16* __restrict__ x, int row, int x_stride, int ch, int r, int pos) {
  V4 v = {0u, 0u, 0u, 0u};
  if (row >= 0) {
    const u32* src = (const u32*)(x + (long long)row * x_stride + piece_col(ch, r, pos));
    v.x = src[0]; v.y = src[4]; v.z = src[8]; v.w = src[12];
  }
  return v;
}
/* the thread's place in the tiles (grid: x = token block, y = 256-thread groups of its threads): 16-byte piece
   pos of row r of the XT_CPT 64-column chunks ch0 .. ch0 + XT_CPT - 1 of token block tb (n_ch is a multiple of
   4), o0 = the element of the first; false past the block. A thread copies XT_CPT pieces (loads in flight
   together, the row lookup paid once); 32-bit index math (a 64-bit division costs ~70 instructions, which
   made these copies ALU-bound). */
#define XT_CPT 4
struct Loc { int pos, r, ch0, tb; long long o0; };
__device__ __forceinline__ bool locate(Loc& l, int bt, int n_ch) {
  const int q = blockIdx.y * blockDim.x + threadIdx.x;
  if (q >= n_ch / XT_CPT * bt * 8) return false;
  l.tb = blockIdx.x;
  l.pos = q & 7;
  l.r = (q >> 3) % bt;
  l.ch0 = (q >> 3) / bt * XT_CPT;
  l.o0 = (long long)l.tb * n_ch * bt * 8 + ((long long)l.ch0 * bt + l.r) * 8 + l.pos;
  return true;
}
extern "C" __global__ void kbit_x_tiles(const u16* __restrict__ x, V4* __restrict__ xt, int M, int x_stride,
                                         int n_ch, int bt) {
  pdl();
  Loc l;
  if (!locate(l, bt, n_ch)) return;
  const int row = l.tb * bt + l.r;
  V4 v[XT_CPT];
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) v[j] = piece(x, row < M ? row : -1, x_stride, l.ch0 + j, l.r, l.pos);
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) xt[l.o0 + (long long)j * bt * 8] = v[j];
}
/* grouped: token block b = rows [blk[b], blk[b + 1]) (b < nblk[0]; later blocks are not written), x row
   rows[i] of row i (rows == 0: row i itself); -1 past the block's end: those tile rows are not written (left
   as they were: each output row of kernel 7 depends on its own x row only, and finish() stores none of them) */
__device__ __forceinline__ int grouped_row(const Loc& l, const int* __restrict__ rows, const int* __restrict__ blk) {
  const int i = blk[l.tb] + l.r;
  return i < blk[l.tb + 1] ? (rows ? rows[i] : i) : -1;
}
extern "C" __global__ void kbit_x_tiles_g(const u16* __restrict__ x, V4* __restrict__ xt,
                                           const int* __restrict__ rows, const int* __restrict__ blk,
                                           const int* __restrict__ nblk, int x_stride, int n_ch, int bt) {
  pdl();
  Loc l;
  if ((int)blockIdx.x >= *nblk || !locate(l, bt, n_ch)) return;
  const int row = grouped_row(l, rows, blk);
  if (row < 0) return; /* past the block's end: not written (the kernel stores no output row for it) */
  V4 v[XT_CPT];
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) v[j] = piece(x, row, x_stride, l.ch0 + j, l.r, l.pos);
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) xt[l.o0 + (long long)j * bt * 8] = v[j];
}
/* SiLU * up of a gate_up product into the tiles: value (row, col) = silu(g) * u with g = gu[row][col],
   u = gu[row][I + col] (float32, rounded once to gu's dtype: kbit.ops.moe.silu_mul), zero at col >= I */
__device__ __forceinline__ float h2f_(u32 h, int bf16) {
  float f;
  if (bf16) asm("mov.b32 %0, %1;" : "=f"(f) : "r"(h << 16));
  else asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "r"(h));
  return f;
}
__device__ __forceinline__ u32 f2h_(float f, int bf16) {
  unsigned short h;
  if (bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ u32 silu_one(u32 gh, u32 uh, int bf16) {
  const float gv = h2f_(gh, bf16), uv = h2f_(uh, bf16);
  return f2h_(gv * (1.0f / (1.0f + __expf(-gv))) * uv, bf16);
}
/* two columns: gate pair gp, up pair up (low half first) -> their silu(g) * u pair */
__device__ __forceinline__ u32 silu_word(u32 gp, u32 up, int bf16) {
  return silu_one(gp & 0xffffu, up & 0xffffu, bf16) | (silu_one(gp >> 16, up >> 16, bf16) << 16);
}
/* columns col, col + 1 (col even); g's rows 4-byte aligned when I is even (one load of each pair) */
__device__ __forceinline__ u32 silu_pair(const u16* __restrict__ g, int I, int col, int bf16) {
  if ((I & 1) == 0 && col + 1 < I)
    return silu_word(__ldg((const unsigned int*)(g + col)), __ldg((const unsigned int*)(g + I + col)), bf16);
  u32 out = 0u;
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (col + e < I) out |= silu_one(g[col + e], g[I + col + e], bf16) << (16 * e);
  return out;
}
extern "C" __global__ void kbit_x_tiles_silu_g(const u16* __restrict__ gu, V4* __restrict__ xt,
                                                const int* __restrict__ rows, const int* __restrict__ blk,
                                                const int* __restrict__ nblk, int gu_stride, int I, int bf16,
                                                int n_ch, int bt, int vec) {
  pdl();
  Loc l;
  if ((int)blockIdx.x >= *nblk || !locate(l, bt, n_ch)) return;
  const int row = grouped_row(l, rows, blk);
  if (row < 0) return; /* past the block's end: not written */
  const u16* g = gu + (long long)row * gu_stride;
  if (vec) {
    /* gu rows and I 16-byte aligned: the thread's index m = l.pos among the row's 8 loads 16 bytes of gate and
       of up, columns 8m .. 8m + 7 of each chunk (= component m & 3 of pieces 4 (m >> 2) .. + 3; I % 8 == 0, so
       the 8 are all < I or all >= I), and stores each column pair as a 4-byte component */
    const int m = l.pos;
    V4 gq[XT_CPT], uq[XT_CPT];
#pragma unroll
    for (int j = 0; j < XT_CPT; ++j) {
      const int c0 = (l.ch0 + j) * 64 + 8 * m;
      if (c0 < I) {
        const uint4 a = __ldg((const uint4*)(g + c0)), b = __ldg((const uint4*)(g + I + c0));
        gq[j].x = a.x; gq[j].y = a.y; gq[j].z = a.z; gq[j].w = a.w;
        uq[j].x = b.x; uq[j].y = b.y; uq[j].z = b.z; uq[j].w = b.w;
      } else {
        gq[j].x = gq[j].y = gq[j].z = gq[j].w = 0u;
        uq[j] = gq[j];
      }
    }
    u32* out = (u32*)xt;
#pragma unroll
    for (int j = 0; j < XT_CPT; ++j) {
      const u32 gw[4] = {gq[j].x, gq[j].y, gq[j].z, gq[j].w}, uw[4] = {uq[j].x, uq[j].y, uq[j].z, uq[j].w};
      const long long row_base = (l.o0 - l.pos + (long long)j * bt * 8) * 4; /* u32 index of piece 0 of the row */
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int pos = (4 * (m >> 2) + p) ^ (l.r & 7);
        out[row_base + 4 * pos + (m & 3)] = silu_word(gw[p], uw[p], bf16);
      }
    }
    return;
  }
  V4 v[XT_CPT];
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) {
    const int col = piece_col(l.ch0 + j, l.r, l.pos);
    v[j].x = silu_pair(g, I, col, bf16);
    v[j].y = silu_pair(g, I, col + 8, bf16);
    v[j].z = silu_pair(g, I, col + 16, bf16);
    v[j].w = silu_pair(g, I, col + 24, bf16);
  }
#pragma unroll
  for (int j = 0; j < XT_CPT; ++j) xt[l.o0 + (long long)j * bt * 8] = v[j];
}
"""

# Dequantize a weight held in layout "mma-v1" straight to [N, K] (kbit.ops.gemv_mma.dequant_repacked: the
# dequantize + cuBLAS route of large M without an unrepacked temporary). A warp takes (tile, segment) items
# grid-stride, the next item's codes and scales in flight while one is written. The lookup is the kernels' own
# (lookup(), with a table of code indices instead of codebook halves), the value codebook[c] * scale in float32
# in the reference's order (kbit.format.reference: codebook[c] * (tensor_scale * E[q]); fp16 scales: times the
# tensor scale after), so the result is bit-exact with kbit.ops.dequant. A lane holds 8 consecutive columns
# (32u + 8t .. + 7) of rows g and g + 8 of each 32-column unit u: one 16-byte store each (VEC), else element
# stores guarded by K. Defines: K_BITS, FP16_SCALES, BF16 (output bf16, else fp16), VEC.
DEQ_SOURCE = HELPERS + r"""
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
"""
