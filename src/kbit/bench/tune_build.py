"""Builds ahead of ``kbit tune``: the CUDA kernels its candidates will launch, compiled by a pool of CPU processes
into the on-disk CUBIN cache (``kbit.cuda.runtime.compile_cached``) while the GPU process times what is built.

A tuning run is bound by NVRTC, not by the GPU: each kernel 7 config is a separate wgmma build of many seconds of
one CPU core, per k (the plan's build is the launch's: bf16 activations). The timing process compiles one kernel
at a time; the pool compiles the same builds, in the order the tuner will reach them, on the other cores, so that
the tuner mostly loads them from the cache. A build the pool has not reached yet is compiled by the tuner itself,
as without the pool; the cache's atomic writes make the duplicate harmless.

Which builds a candidate needs comes from its plan (``kbit.tuning.mma_plan.make_plan``) with a fake build whose
occupancy is the launch bounds' (``MINB``) within the threads and shared memory of an SM: where the real occupancy
differs, the plan may ask for a variant that was not built ahead, and the tuner compiles it.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
from collections.abc import Iterable

from kbit.cuda import runtime, sources
from kbit.tuning.mma_plan import KERNELS, make_plan
from kbit.tuning.space import Candidate, search_space

__all__ = ["Prebuilder", "candidate_builds"]


class _FakeKernel:
    """What :func:`~kbit.tuning.mma_plan.make_plan` reads of a build, without building."""

    num_regs = 64

    def __init__(self, defines: dict):
        self.defines = defines

    def occupancy(self, threads: int, shared: int) -> int:
        return max(1, min(self.defines.get("MINB", 1), 2048 // threads, (228 * 1024) // (shared + 1024)))


def candidate_builds(cand: Candidate, k: int, M: int, N: int, K: int, sms: int) -> list[tuple[str, tuple]]:
    """(``.cu`` file, sorted define items) of every build a launch of ``cand`` makes for ``M`` rows on a k-bit
    ``[N, K]`` weight (bf16 activations): the plan's builds and the launch's. Empty for the Triton and cuBLAS
    families, and for a config the plan refuses."""
    if cand.family not in ("mma", "large"):
        return []
    out: list[tuple[str, tuple]] = []

    def build(kernel: int, defines: dict) -> _FakeKernel:
        out.append((KERNELS[kernel][0], tuple(sorted(defines.items()))))
        return _FakeKernel(defines)

    rows = [M] if cand.family == "large" else sorted({min(M, 64)} | ({M % 64} if M > 64 and M % 64 else set()))
    try:
        for m in rows:
            p = make_plan(k, m, N, K, "log8", cand.config, sms=sms, build=build, bf16=True)
            out.append((p.source[0], tuple(sorted(p.defines.items()))))
    except ValueError:
        return []
    return list(dict.fromkeys(out))


def _compile(file: str, defines: tuple, arch: str) -> str:
    """In a pool process: one build into the on-disk cache."""
    sources.compile_source(file, dict(defines), arch)
    return file


class Prebuilder:
    """A pool of ``workers`` processes compiling the tuner's builds ahead (see the module docstring); a context
    manager: leaving it drops what is not started yet."""

    def __init__(self, device, sms: int, sm90: bool, workers: int | None = None):
        self.arch = {f: runtime.device_arch(device, f in sources.ARCH_SPECIFIC) for f, _ in KERNELS.values()}
        self.sms, self.sm90 = sms, sm90
        self.workers = workers if workers is not None else max(1, (os.cpu_count() or 2) - 2)
        self.submitted: set = set()
        self.futures: list[cf.Future] = []
        # spawn: the parent holds a CUDA context, which a forked child must not inherit
        self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def submit(self, shapes: Iterable[tuple[int, int]], ks: Iterable[int], ms: Iterable[int], *,
               families: tuple[str, ...] | None = None, quick: bool = False) -> int:
        """Queues the builds of every candidate of every (shape, k, M), in the tuner's order; returns how many new
        builds were queued."""
        n = 0
        for N, K in shapes:
            for k in ks:
                for M in ms:
                    for cand in search_space(k, M, N, K, cuda=True, sm90=self.sm90,
                                             families=families, quick=quick):
                        for file, defines in candidate_builds(cand, k, M, N, K, self.sms):
                            if (file, defines) not in self.submitted:
                                self.submitted.add((file, defines))
                                self.futures.append(self.pool.submit(_compile, file, defines, self.arch[file]))
                                n += 1
        return n

    def done(self) -> int:
        return sum(f.done() for f in self.futures)

    def close(self) -> None:
        failed = sum(1 for f in self.futures if f.done() and not f.cancelled() and f.exception() is not None)
        if failed:
            print(f"prebuild: {failed} builds failed (the tuner reports each candidate's own error)", file=sys.stderr)
        procs = list(getattr(self.pool, "_processes", {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        # builds still running are for entries the tuner will not reach: end them rather than wait (a build cut
        # short leaves only its temporary file; the cache's writes are atomic renames)
        for proc in procs:
            proc.terminate()

    def __enter__(self) -> Prebuilder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
