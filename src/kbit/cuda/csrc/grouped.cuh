/* Shared by the grouped (MoE) kernels (grouped_mma.cu, grouped_mma_pipe.cu, wgmma.cu with GRP) and the grouped x
   gathers (x_tiles.cu): the read of the block count. Needs no other header. */
#pragma once

/* A value that the kernel before wrote, read after pdl_wait() at an address that depends on no other load (the
   block count *nblk): a coherent load, never the read-only path. Read through a `const __restrict__` pointer it
   was ld.global.nc, which ptxas may move above griddepcontrol.wait (data read-only for the kernel's lifetime),
   and did in 47 of the 297 builds of lab/pdl_hoist_scan.py (NVRTC 12.9, 2026-11-29): the read then raced the
   launch that writes the table. A CUDA graph of a Qwen3-30B-A3B-shaped step with such a kernel 1 stopped on an
   illegal address. */
__device__ __forceinline__ int ld_dep(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
