/* x for kbit_wgmma (wgmma.cu): the "mma-v1" K permutation, token blocks of BT rows, 64-column chunks, each chunk
   a contiguous [BT][128 bytes] tile in wgmma's 128-byte swizzle (16-byte piece c of row r at (c ^ (r % 8)) * 16),
   rows past M zero. One thread a 16-byte piece: four 4-byte column pairs of one row.
     kbit_x_tiles         dense x
     kbit_x_tiles_g       grouped: x rows per block of a block table
     kbit_x_tiles_silu_g  grouped: SiLU * up of a gate_up product per block of a block table
   No defines. */
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) V4 { u32 x, y, z, w; };
#include "grouped.cuh" /* ld_dep: the block count after the wait */
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
  if ((int)blockIdx.x >= ld_dep(nblk) || !locate(l, bt, n_ch)) return;
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
  if ((int)blockIdx.x >= ld_dep(nblk) || !locate(l, bt, n_ch)) return;
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
