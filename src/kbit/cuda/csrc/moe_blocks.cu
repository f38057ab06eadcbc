/* The MoE block table and row order kernels (kbit.ops.grouped_mma), one CTA or one thread a row; no defines.
     kbit_moe_blocks      block table of rows grouped by expert id (runs)
     kbit_moe_blocks_off  block table from the groups' end offsets
     kbit_moe_split       each expert's rows split into a main part and a tail (kbit.ops.moe tail split)
     kbit_moe_split_rows  the new order's row lists */

/* ---------------------------------------------------------------------------------------------- block table
   Rows [0, P) in groups of equal expert id (runs; sorted rows: one run an expert). A block is at most BM
   consecutive rows of one run, cut from the run's start: blk[b] = first row of block b (b < nblk[0]),
   blk[nblk[0]] = P; block b is rows [blk[b], blk[b + 1]). Row r starts a run when r == 0 or
   eid[r] != eid[r - 1], and a block when (r - its run's start) % BM == 0.
   One CTA of NT_BLK threads; warp w owns rows [r0, r1) = [w CW, (w + 1) CW), read 32 a step (coalesced), BLK_B
   steps' loads in flight. Pass 1: per warp, its first and last run starts and the block starts from its first
   run start on (those do not depend on earlier warps). Then lane j of every warp derives warp j's entering run
   (the last start of warps < j), the block starts of its rows before its first run start (arithmetic), and an
   exclusive sum gives each warp its first slot. Pass 2 writes the block starts. */
#define NT_BLK 1024
#define BLK_B 8
__device__ __forceinline__ int run_start_of(const int* __restrict__ eid, int r, int r1) {
  return (r < r1 && (r == 0 || __ldg(eid + r) != __ldg(eid + r - 1))) ? r : -1;
}
/* block starts in rows [a, e) of a run starting at rs <= a */
__device__ __forceinline__ int starts_between(int rs, int a, int e, int BM) {
  return e > a ? (e - rs + BM - 1) / BM - (a - rs + BM - 1) / BM : 0;
}
extern "C" __global__ void __launch_bounds__(NT_BLK) kbit_moe_blocks(const int* __restrict__ eid, int P, int BM,
                                                                     int* __restrict__ blk, int* __restrict__ nblk) {
  __shared__ int s_first[NT_BLK / 32], s_last[NT_BLK / 32], s_cnt[NT_BLK / 32];
  const unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int CW = (P + NT_BLK - 1) / NT_BLK * 32;
  const int r0 = min(P, w * CW), r1 = min(P, r0 + CW);
  int run_in = -1, slot = 0;
  for (int pass = 0; pass < 2; ++pass) {
    int run = run_in, cnt = 0, first = r1;
    for (int b0 = r0; b0 < r1; b0 += 32 * BLK_B) {
      int s[BLK_B];
#pragma unroll
      for (int j = 0; j < BLK_B; ++j) s[j] = run_start_of(eid, b0 + 32 * j + lane, r1);
#pragma unroll
      for (int j = 0; j < BLK_B; ++j) {
        const int r = b0 + 32 * j + lane;
        int sc = s[j];
        if (sc >= 0) first = min(first, sc);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(FULL, sc, o);
          if (lane >= o) sc = max(sc, v);
        }
        const int rr = max(run, sc); /* pass 0: -1 before the warp's first run start (counted later) */
        const bool st = r < r1 && rr >= 0 && (r - rr) % BM == 0;
        const unsigned m = __ballot_sync(FULL, st);
        if (pass == 1 && st) blk[slot + cnt + __popc(m & ((1u << lane) - 1u))] = r;
        cnt += __popc(m);
        run = __shfl_sync(FULL, rr, 31);
      }
    }
    if (pass == 1) break;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(FULL, first, o));
    if (lane == 0) {
      s_first[w] = first;
      s_last[w] = run;
      s_cnt[w] = cnt;
    }
    __syncthreads();
    /* lane j: warp j */
    const int j0 = min(P, lane * CW), j1 = min(P, j0 + CW);
    int in = lane > 0 ? s_last[lane - 1] : -1; /* inclusive max-scan of the previous warps' last starts */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(FULL, in, o);
      if (lane >= o) in = max(in, v);
    }
    const int c = s_cnt[lane] + (in >= 0 ? starts_between(in, j0, min(s_first[lane], j1), BM) : 0);
    int before = c; /* inclusive sum-scan, then exclusive */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(FULL, before, o);
      if (lane >= o) before += v;
    }
    const int total = __shfl_sync(FULL, before, 31);
    before -= c;
    run_in = __shfl_sync(FULL, in, w);
    slot = __shfl_sync(FULL, before, w);
    if (threadIdx.x == 0) {
      blk[total] = P;
      nblk[0] = total;
    }
  }
}

/* rows [start, end) of expert e's group (group ends offsets[E]; e >= E: an empty group) */
__device__ __forceinline__ void group_of(const int* __restrict__ offsets, int e, int E, int& start, int& end) {
  end = e < E ? offsets[e] : 0;
  start = e < E ? (e > 0 ? offsets[e - 1] : 0) : 0;
}
/* exclusive sums over the CTA (NT_BLK threads) of Q ints v[q] -> ex[q], totals -> tot[q]; s_sum: Q * 32 ints of
   shared memory, free again on return */
template <int Q>
__device__ __forceinline__ void cta_scan(const int (&v)[Q], int (&ex)[Q], int (&tot)[Q], int* s_sum) {
  const unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    int inc = v[q];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL, inc, o);
      if (lane >= o) inc += y;
    }
    if (lane == 31) s_sum[q * 32 + w] = inc;
    ex[q] = inc - v[q];
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    int before = lane < w ? s_sum[q * 32 + lane] : 0, all = s_sum[q * 32 + lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      before += __shfl_xor_sync(FULL, before, o);
      all += __shfl_xor_sync(FULL, all, o);
    }
    ex[q] += before;
    tot[q] = all;
  }
  __syncthreads();
}
/* The same table from the group ends of rows sorted by expert (offsets[e] = end row of expert e's group,
   kbit.ops.moe_align.align): work a group, not a row. One CTA of NT_BLK threads, experts NT_BLK at a time:
   thread e's group makes ceil(count / BM) blocks; an exclusive sum over the CTA (carried from chunk to chunk)
   gives its first slot. */
extern "C" __global__ void __launch_bounds__(NT_BLK) kbit_moe_blocks_off(const int* __restrict__ offsets, int E,
                                                                         int P, int BM, int* __restrict__ blk,
                                                                         int* __restrict__ nblk) {
  __shared__ int s_sum[32];
  int base = 0;
  for (int e0 = 0; e0 < E; e0 += NT_BLK) {
    int start, end;
    group_of(offsets, e0 + (int)threadIdx.x, E, start, end);
    const int nb[1] = {(end - start + BM - 1) / BM};
    int ex[1], tot[1];
    cta_scan<1>(nb, ex, tot, s_sum);
    for (int i = 0; i < nb[0]; ++i) blk[base + ex[0] + i] = start + i * BM;
    base += tot[0];
  }
  if (threadIdx.x == 0) {
    blk[base] = P;
    nblk[0] = base;
  }
}

/* ---------------------------------------------------------------------------------------------- tail split
   Rows sorted by expert (group ends offsets[E]) reordered so that each expert's short last block goes to a
   second kernel: an expert of c rows keeps m = c - t rows in the main part and t = c % BT rows in the tail part
   when 0 < c % BT <= TAIL (else t = 0). New order: the main parts of all experts (expert order), then the tail
   parts (expert order), so that both parts are plain sorted row ranges: [0, P_main) and [P_main, P).
   kbit_moe_split (one CTA): blk_m / nblk_m = the block table of the main part (BT rows a block, ends with
   P_main), blk_t / nblk_t = that of the tail part (one block an expert with a tail, t <= TAIL <= the tail
   kernel's rows a block; ends with P); base_m[e], base_t[e] = first new row of e's main / tail part, m_cnt[e] = m.
   Two passes over the experts (NT_BLK at a time): totals, then exclusive sums and the writes. */
__device__ __forceinline__ void split_counts(const int* __restrict__ offsets, int e, int E, int BT, int TAIL,
                                             int& m, int& t) {
  int start, end;
  group_of(offsets, e, E, start, end);
  const int c = end - start;
  t = c % BT;
  if (t > TAIL) t = 0;
  m = c - t;
}
extern "C" __global__ void __launch_bounds__(NT_BLK) kbit_moe_split(
    const int* __restrict__ offsets, int E, int P, int BT, int TAIL, int* __restrict__ blk_m,
    int* __restrict__ nblk_m, int* __restrict__ blk_t, int* __restrict__ nblk_t, int* __restrict__ base_m,
    int* __restrict__ base_t, int* __restrict__ m_cnt) {
  __shared__ int s_sum[4 * 32];
  /* pass 1: P_main */
  int p_main = 0;
  for (int e0 = 0; e0 < E; e0 += NT_BLK) {
    int m[1], t, ex[1], tot[1];
    split_counts(offsets, e0 + (int)threadIdx.x, E, BT, TAIL, m[0], t);
    cta_scan<1>(m, ex, tot, s_sum);
    p_main += tot[0];
  }
  /* pass 2: exclusive sums of m, t, main blocks and tail blocks (one an expert with t > 0), and the writes */
  int rm = 0, rt = 0, bm = 0, bt = 0;
  for (int e0 = 0; e0 < E; e0 += NT_BLK) {
    const int e = e0 + (int)threadIdx.x;
    int m, t;
    split_counts(offsets, e, E, BT, TAIL, m, t);
    const int nbm = (m + BT - 1) / BT;
    const int v[4] = {m, t, nbm, t > 0 ? 1 : 0};
    int ex[4], tot[4];
    cta_scan<4>(v, ex, tot, s_sum);
    if (e < E) {
      base_m[e] = rm + ex[0];
      base_t[e] = p_main + rt + ex[1];
      m_cnt[e] = m;
      for (int i = 0; i < nbm; ++i) blk_m[bm + ex[2] + i] = rm + ex[0] + i * BT;
      if (t > 0) blk_t[bt + ex[3]] = p_main + rt + ex[1];
    }
    rm += tot[0];
    rt += tot[1];
    bm += tot[2];
    bt += tot[3];
  }
  if (threadIdx.x == 0) {
    blk_m[bm] = p_main;
    nblk_m[0] = bm;
    blk_t[bt] = P;
    nblk_t[0] = bt;
  }
}
/* the new order's row lists, one thread a pair p: its old row i = pair_rows[p] (expert e, rank j in e's group)
   goes to new row n = base_m[e] + j (j < m_cnt[e]) or base_t[e] + j - m_cnt[e]; eid2[n] = e, tok2[n] = p / top_k,
   pair_rows2[p] = n, and rows_t[n] = n - (P - R) (clamped to 0): the row of a tail row in a buffer holding the
   last R rows. */
extern "C" __global__ void kbit_moe_split_rows(const int* __restrict__ pair_rows, const int* __restrict__ eid,
                                               const int* __restrict__ offsets, const int* __restrict__ base_m,
                                               const int* __restrict__ base_t, const int* __restrict__ m_cnt, int P,
                                               int top_k, int R, int* __restrict__ eid2, int* __restrict__ tok2,
                                               int* __restrict__ pair_rows2, int* __restrict__ rows_t) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const int i = pair_rows[p], e = eid[i];
  const int j = i - (e > 0 ? offsets[e - 1] : 0), m = m_cnt[e];
  const int n = j < m ? base_m[e] + j : base_t[e] + (j - m);
  eid2[n] = e;
  tok2[n] = p / top_k;
  pair_rows2[p] = n;
  rows_t[n] = max(0, n - (P - R));
}
