/* kbit_gemv_mma_streamk: the swap-AB tensor-core GEMV for small M (kbit.ops.gemv_mma, kernel 3), y = x @ W.T
   with W k-bit in layout "mma-v1": stream-K over the (tile, segment) pairs, a register ring a warp; optional x
   prologue (RMSNorm, residual add + RMSNorm) and SiLU * up epilogue (kbit.ops.prologue).

   Defines (-D options; kbit.ops.gemv_mma.plan sets them):
     K_BITS       2, 3, 4, 5
     NG           8-token column groups: 1, 2 (M <= 8 NG)
     MAXW, MINB   __launch_bounds__: warps a CTA, CTAs an SM
     PD           register ring depth (segments in flight + 1): 2..8
     BF16         1: bf16 activations, 0: fp16
     FP16_SCALES  1: fp16 block scales, 0: log8 bytes
     XS           0/1: x staged in shared memory
     XK           0 or segments a K slice (XS only; not with PRO or DET): x[:, slice] staged a CTA
     PRO          0, 1 (RMSNorm), 2 (residual add + RMSNorm): x prologue (XS only)
     EPI          0/1: SiLU * up epilogue of a fused gate/up weight
     XT           0/1: x's columns from kx on read as zero (common.cuh)
     LFX          0/1: CTA-local split-K fix-up (LFU: units a CTA's range touches, LFW: shared slots a warp)
     CAU          0/1: CTA-aligned units, split-K sums in shared memory (LFW: shared slots a warp); not with LFX
     M1           0/1: M is 1
     DET          0/1: fixed-order split-K sums (bit-identical runs)
     WS4          0/1 (NG > 1): the split-K workspace a lane's four values at once (see splitk.cuh)
     L2PF         0 or bytes: the warp's weight range prefetched into L2 before the PDL wait
     GRP          0/1: a few tokens' MoE pairs, the stacked tiles of their experts (common.cuh; M = 1, not with PRO,
                  EPI, XK or DET); the weight loads wait for the expert ids (after the PDL wait) */
#include "splitk.cuh"
#include "grouped.cuh" /* ld_dep: the expert ids after the wait */
#if GRP && (PRO || EPI || XK || DET || NG != 1)
#error "GRP: M = 1 (NG 1) without a prologue, epilogue, K slices or the slot fix-up"
#endif

#ifndef XK /* K slices of XK segments, x[:, slice] staged a CTA (0: the whole of x) */
#define XK 0
#endif
#ifndef DET /* 1 = split-K parts added in a fixed order (bit-identical runs), 0 = fp32 atomics */
#define DET 0
#endif
#ifndef PRO
#define PRO 0
#endif
#ifndef EPI
#define EPI 0
#endif
#if XK && (PRO || DET || !XS)
#error "XK: K slices need XS and exclude PRO (a norm over the whole row) and DET (slots by memory order)"
#endif

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
template <bool ONE>
__device__ __forceinline__ void stage_x_prologue(V4* sx, const V4* sw, const u16* __restrict__ x, int x_stride,
                                                 int M, int xv, const u16* __restrict__ res,
                                                 u16* __restrict__ res_out, float eps, int kin, int r_stride,
                                                 u32 tid, u32 lane, u32 warp, u32 W) {
  /* The tokens are staged side by side, not one after another: warp group q (wpt warps) takes the tokens q,
     q + groups, ... and leaves each token's sum of squares in s_pro (one partial a warp); one CTA barrier, then
     every thread normalises. So the prologue costs about one x load whatever M is (a loop over the tokens with a
     barrier pair each cost M round trips to L2 before the first mma). ONE (M == 1, every warp on the token): the
     groups folded to constants; the generic build made the batch-1 decode step 0.5-1.7% slower (H100, 2026-11-27). */
  const int nv = kin >> 3;  /* 8-column vectors that hold data (kin % 8 == 0) */
  const int wpt = ONE ? (int)W : (int)W >= M ? (int)W / M : 1, groups = ONE ? 1 : (int)W / wpt;  /* M wpt <= 32 */
  const int grp = ONE ? 0 : (int)warp / wpt, gt = ONE ? (int)blockDim.x : wpt * 32;
  const int sub = ONE ? (int)tid : ((int)warp - grp * wpt) * 32 + (int)lane, nt = ONE ? 1 : M;
  for (int tok = grp; grp < groups && tok < nt; tok += groups) {
    float ss = 0.0f;
    for (int c0 = sub; c0 < xv; c0 += PRO_U * gt) {
      V4 v[PRO_U], r[PRO_U];
#pragma unroll
      for (int u = 0; u < PRO_U; ++u) {
        const int c = c0 + u * gt;
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
        const int c = c0 + u * gt;
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
    if (lane == 0) s_pro[tok * wpt + ((int)warp - grp * wpt)] = ss;
  }
  __syncthreads();
  for (int tok = 0; tok < nt; ++tok) {
    float tot = 0.0f;
    for (int q = 0; q < wpt; ++q) tot += s_pro[tok * wpt + q];
    const float rs = rsqrtf(tot / (float)kin + eps);
    for (int c = (int)tid; c < nv; c += (int)blockDim.x) {
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
                                             int spt, bool epi, int ns, int s_lo, const Lfx& lf, int& nslot,
                                             int kx) {
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
        for (int ng = 0; ng < NG; ++ng) xs[ng] = xr[ng] + seg * SEG + grp_xoff(tile);
        segment((const u32*)buf[p], buf[p] + K_BITS, xs, lbb, sc_base, acc, kx - seg * SEG);
        ++seg;
        if (seg == ns || j + 1 == j1) {
#if GRP /* the pair's expert's tensor scale (the sums are linear: parts of a tile may be scaled apart) */
          {
            const float s = s_gets[s_geid[tile / s_gnte]];
#pragma unroll
            for (int ng = 0; ng < NG; ++ng) acc[ng][0] *= s, acc[ng][1] *= s, acc[ng][2] *= s, acc[ng][3] *= s;
          }
#endif
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
extern "C" __global__ void __launch_bounds__(MAXW * 32, MINB) kbit_gemv_mma_streamk(
    const V4* __restrict__ codes, const V4* __restrict__ scales, const float* __restrict__ ts_ptr,
    const float* __restrict__ cb, const float* __restrict__ e_tab, const u16* __restrict__ x,
    u16* __restrict__ y, const void* __restrict__ bias, float* __restrict__ ws, int* __restrict__ cnt,
    int M, int N, int x_stride, int y_stride, int n_seg, int n_tiles, int splits, int sps,
    int bias_kind, int ws_stride, int kx
#if PRO
    , const u16* __restrict__ p_res, u16* __restrict__ p_res_out, const u16* __restrict__ p_nw, float eps,
    int kin, int r_stride
#endif
#if GRP /* the pairs' expert ids and x rows (int32 [n_tiles / gr_nte] each), an expert's tiles, x's rows, the stack's
           experts (ts_ptr: their tensor scales, float32 [gr_ne]) */
    , const int* __restrict__ gr_eid, const int* __restrict__ gr_xrow, int gr_nte, int gr_xn, int gr_ne
#endif
    ) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2;
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
#define K3_PRELOAD \
  _Pragma("unroll") for (int p = 0; p < PD - 1; ++p) \
    if (js + p < j1) ld_seg(buf[p], codes, scales, vphys((js + p) / ns, lf.half_t) * ns + (js + p) % ns, lane, g);
#if !GRP /* in flight while the tables are built (GRP: after the wait, which the expert ids need) */
  K3_PRELOAD
#endif
  for (int i = (int)tid; i < MAXW * LFW; i += (int)blockDim.x) s_stile[i] = -1;
  for (int i = (int)tid; i < LFU; i += (int)blockDim.x) s_ucnt[i] = 0;
#elif CAU
  Lfx lf;
  lf.half_t = EPI ? n_tiles >> 1 : 0;
  int nslot = 0;
#define K3_PRELOAD \
  _Pragma("unroll") for (int p = 0; p < PD - 1; ++p) \
    if (j0 + p < j1) ld_seg(buf[p], codes, scales, vphys((j0 + p) / ns, lf.half_t) * ns + (j0 + p) % ns, lane, g);
#if !GRP /* in flight while the tables are built */
  K3_PRELOAD
#endif
  for (int i = (int)tid; i < MAXW * LFW; i += (int)blockDim.x) s_stile[i] = -1;
#else
#define K3_PRELOAD \
  _Pragma("unroll") for (int p = 0; p < PD - 1; ++p) \
    if (j0 + p < j1) ld_seg(buf[p], codes, scales, XK ? (j0 + p) / ns * n_seg + s_lo + (j0 + p) % ns : j0 + p, lane, g);
#if !GRP /* in flight while the tables are built */
  K3_PRELOAD
#endif
#endif
#if !XK && !LFX && !CAU && !GRP
  if (lane == 0 && j0 + PD - 1 < j1) { /* the rest of the warp's range, from its start */
    l2_prefetch(codes + (long long)(j0 + PD - 1) * K_BITS * 32, (long long)(j1 - j0 - PD + 1) * K_BITS * 512);
    l2_prefetch(scales + (long long)(j0 + PD - 1) * 8 * SV, (long long)(j1 - j0 - PD + 1) * SV * 128);
  }
#endif
  const float ts = GRP ? 1.0f : *ts_ptr; /* GRP: each pair's own expert's (s_gets) */
  extern __shared__ __align__(16) unsigned char dsm[];
  const u32 dsm_base = smem_addr(dsm);
  const u32 tab = (dsm_base + TAB_ALIGN - 1) & ~(u32)(TAB_ALIGN - 1);
  build_table_fast(tab, cb, tid, blockDim.x);
  const float post = FP16_SCALES ? ts : 1.0f;
  for (u32 i = tid; i < 256; i += blockDim.x) s_sc[i] = FP16_SCALES ? 0.0f : e_tab[i] * ts;
#if XS /* x rows [M][n_seg * 256 + 32] after the table (PRO: then the norm weight); XK: [M][XK * 256 + 32]. A row of
          whole segments is a multiple of 128 bytes, so without the 64 pad bytes every token's 64-byte B fragment of
          a unit falls in the same 16 banks and an 8-token load takes 8 wavefronts, not 4 */
  u16* sx = (u16*)(dsm + (tab - dsm_base) + TAB_WORDS * 4);
  const int xv = (XK ? XK : n_seg) * (SEG / 8) + 4;
#if PRO
  V4* sw_ = (V4*)sx + M * xv;
  stage_w(sw_, p_nw, kin, tid);  /* a weight: before the wait */
#endif
#endif
#if GRP
  if (tid == 0) {
    s_gnte = gr_nte;
    s_gupe = gr_nte * n_seg;
#if XS /* x's gr_xn rows staged (the host sized the shared memory for them) */
    s_gxs = 8 * xv;
#else
    s_gxs = x_stride;
#endif
  }
#endif
#if GRP
  for (int i = (int)tid; i < gr_ne; i += (int)blockDim.x) s_gets[i] = ts_ptr[i]; /* weights: before the wait */
#endif
#if XS && GRP
  const int x_rows_n = gr_xn; /* x rows to stage */
#elif XS
  const int x_rows_n = M;
#endif
  pdl_launch();
  pdl_wait();
#if GRP
  /* thread i < pairs loads pair i's expert and x row; they are stored after x's staging below has issued its loads,
     so that the two round trips overlap (stored first, they made x's loads of that warp wait for them) */
  const bool g_pair = (int)tid < n_tiles / gr_nte; /* up to GRP_MAXP pairs, at most the CTA's threads */
  int g_e = 0, g_r = 0;
  if (g_pair) g_e = ld_dep(gr_eid + tid), g_r = ld_dep(gr_xrow + tid);
#endif
#if XS
#if PRO
  if (M == 1)
    stage_x_prologue<true>((V4*)sx, sw_, x, x_stride, M, xv, p_res, p_res_out, eps, kin, r_stride, tid, lane, warp, W);
  else
    stage_x_prologue<false>((V4*)sx, sw_, x, x_stride, M, xv, p_res, p_res_out, eps, kin, r_stride, tid, lane, warp, W);
#else
  /* x's vectors XU a thread at once, all loaded before any is stored: a plain strided loop (unrolled with its
     remainder first) made the remainder's loads one round trip each, in front of the barrier below, which every
     weight of the launch waits for */
#define XU 4
#if XK
  const int x_n = M * ns * (SEG / 8);
#else
  const int x_n = x_rows_n * xv;
#endif
  for (int i0 = (int)tid; i0 < x_n; i0 += XU * (int)blockDim.x) {
    V4 xv4[XU];
#pragma unroll
    for (int u = 0; u < XU; ++u) {
      const int i = i0 + u * (int)blockDim.x;
#if XK
      const int nv = ns * (SEG / 8), tok = i / nv, c = i - tok * nv;
      xv4[u] = (i >= x_n || (XT && s_lo * SEG + 8 * c >= kx)) ? V4{0u, 0u, 0u, 0u}
               : *(const V4*)(x + (long long)tok * x_stride + s_lo * SEG + 8 * c);
#else
      const int tok = i / xv, c = i - tok * xv;
      xv4[u] = (i >= x_n || c >= n_seg * (SEG / 8) || (XT && 8 * c >= kx)) ? V4{0u, 0u, 0u, 0u}
               : *(const V4*)(x + (long long)tok * x_stride + 8 * c);
#endif
    }
#pragma unroll
    for (int u = 0; u < XU; ++u) {
      const int i = i0 + u * (int)blockDim.x;
#if XK
      const int nv = ns * (SEG / 8), tok = i / nv;
      if (i < x_n) ((V4*)sx)[tok * xv + i - tok * nv] = xv4[u];
#else
      if (i < x_n) ((V4*)sx)[i] = xv4[u];
#endif
    }
  }
#undef XU
#endif
#endif
#if GRP
  if (g_pair) {
    s_goff[tid] = (long long)(g_e - (int)tid) * gr_nte * n_seg;
    s_geid[tid] = g_e;
    s_gxr[tid] = g_r;
  }
#endif
  __syncthreads();
#if GRP
  K3_PRELOAD
#endif
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
                   bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot, kx);
  }
#elif CAU
  /* j0, j1 are the same in every lane of a warp; redux.sync says so to ptxas (its result is a uniform register), so
     that the loop before the CTA barrier is not divergent */
  const int uj0 = (int)__reduce_min_sync(0xffffffffu, (unsigned)j0), uj1 = (int)__reduce_min_sync(0xffffffffu, (unsigned)j1);
  stream_range(buf, codes, scales, uj0, uj1, n_seg, xr, lbb, sc_base, lane, g, M, N, y, y_stride, bias,
               bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot, kx);
  __syncthreads();
  cau_reduce(cu_lo, cu_hi, lane, M, N, y, y_stride, bias, bias_kind);
#else
  Lfx lf;
  int nslot = 0;
  stream_range(buf, codes, scales, j0, j1, n_seg, xr, lbb, sc_base, lane, g, M, N, y, y_stride, bias,
               bias_kind, post, ws, cnt, ws_stride, L, spt, EPI, ns, s_lo, lf, nslot, kx);
#endif
}

