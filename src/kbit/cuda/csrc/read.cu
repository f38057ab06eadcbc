/* kbit_read: the read floor (kbit.bench.floor): a plain read of n 16-byte vectors, timed like every kernel.

   Defines (-D options): U (loads in flight a thread: 4, 8), PDL (0/1: programmatic dependent launch). */
typedef unsigned int u32;
struct __align__(16) V4 { u32 x, y, z, w; };
__device__ __forceinline__ V4 ld(const V4* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
/* XOR of n 16-byte vectors, grid-stride, U loads in flight a thread; out is written only if the XOR hits a
   magic value (keeps the loads). PDL = 1: lets the next launch start at once, and waits for the previous one
   before reading (the GEMVs' order: weights may be prefetched, nothing overlaps the previous kernel's end). */
extern "C" __global__ void kbit_read(const V4* __restrict__ p, long long n, u32* out) {
#if PDL && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  u32 acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    V4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) { const V4 v = ld(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x9E3779B9u) out[0] = acc;
}
