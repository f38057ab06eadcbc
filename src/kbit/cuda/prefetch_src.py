"""CUDA source of ``kbit_l2_prefetch`` (launcher: :func:`kbit.ops.prefetch.prefetch_l2`).

Pulls up to four byte ranges into L2 with ``cp.async.bulk.prefetch.L2`` (sm_90; a no-op before): each thread
prefetches ``CHUNK``-byte pieces, grid-strided. The kernel lets the next kernel launch first (programmatic
dependent launch) and waits for the previous one last, so it keeps the dependency chain of the stream while the
bytes stream into L2 behind the kernels that follow (e.g. a decode step's attention while the next k-bit GEMV's
weights arrive).
"""

SOURCE = r"""
typedef unsigned int u32;
struct Ranges { const char* p[4]; long long n[4]; };

extern "C" __global__ void kbit_l2_prefetch(Ranges r, long long total, int chunk) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long step = (long long)gridDim.x * blockDim.x * chunk;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < total; i += step) {
    long long off = i;
    int j = 0;
    while (j < 3 && off >= r.n[j]) { off -= r.n[j]; ++j; }
    long long rem = r.n[j] - off;
    u32 n = (u32)((rem < chunk ? rem : chunk) & ~15LL);
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(r.p[j] + off), "r"(n) : "memory");
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"""
