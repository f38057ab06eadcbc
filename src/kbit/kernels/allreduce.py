"""Triton kernel of the barrier-free one-shot all-reduce (launcher and reference in :mod:`kbit.ops.allreduce`).

- :func:`lamport_all_reduce_kernel`: every rank stores its bf16 partial product straight into each peer's
  symmetric buffer (remote stores over NVLink), then polls its own buffer until no element of a peer's region still
  holds the sentinel (bf16 -0.0; a payload's -0.0 travels as +0.0, the same number), sums in float32 and rounds
  once (for two ranks: NCCL's bf16 sum, bit for bit), and clears the slot of the call before. No barrier: the data
  is its own arrival flag.

Three slots in turn: during call c a peer may write slots c and c + 1 of this rank's buffer, never c - 1 (to start
c + 2 it needs this rank's data of c + 1, sent after this call ends), so slot c - 1 is cleared now. Each of the
``P`` programs owns the chunks ``pid, pid + P, ...`` of ``BLOCK`` elements, and keeps its own slot (its call
count modulo 3) and last message size in ``state`` (``[2P]`` int32, device memory), so replays of a CUDA graph
go on counting. Each poll stops after ``limit`` loads (the launcher passes a limit of hours: a late peer must not
turn into a wrong sum).

``PDL``: launched with programmatic dependent launch (sm_90), the kernel lets the next one launch at once (a k-bit
GEMV, which reads only weights before its own wait) and waits for the previous one (the row-parallel GEMV that
wrote ``x``) before it reads anything: its launch and the next kernel's weight loads overlap their neighbours.
"""

import triton
import triton.language as tl

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL is never requested there (see kbit.ops.pdl)
    gdc_launch_dependents = gdc_wait = None

#: bf16 -0.0 as int16 bits: an empty element of a receive buffer
SENTINEL = tl.constexpr(-32768)


@triton.jit
def lamport_all_reduce_kernel(x, bufs, out, state, n, max_n, limit, rank: tl.constexpr, world: tl.constexpr,
                              P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # everything below may read what the kernel before wrote (x, and state through the call before)
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    slot = tl.load(state + pid)  # this call's slot, 0..2 (the count modulo 3: it never overflows)
    prev_n = tl.load(state + P + pid)
    old = (slot + 2) % 3  # the slot of the call before: no peer writes it now
    ptrs = bufs.to(tl.pointer_type(tl.uint64))
    mine = tl.multiple_of(tl.load(ptrs + rank).to(tl.pointer_type(tl.int16)), 16)
    offs = tl.arange(0, BLOCK)
    # 1. this rank's partial product into region `rank` of slot `slot` of every peer's buffer
    for start in range(pid * BLOCK, n, P * BLOCK):
        m = start + offs < n
        v = tl.load(x.to(tl.pointer_type(tl.int16)) + start + offs, mask=m, other=0)
        v = tl.where(v == SENTINEL, 0, v)  # -0.0 -> +0.0: the sentinel never travels as data
        for peer in tl.static_range(world):
            if peer != rank:
                theirs = tl.multiple_of(tl.load(ptrs + peer).to(tl.pointer_type(tl.int16)), 16)
                tl.store(theirs + (slot * world + rank) * max_n + start + offs, v, mask=m)
    # 2. every peer's data from this rank's buffer (polled until it has arrived), summed with this rank's own
    for start in range(pid * BLOCK, n, P * BLOCK):
        m = start + offs < n
        acc = tl.load(x + start + offs, mask=m, other=0.0).to(tl.float32)
        for peer in tl.static_range(world):
            if peer != rank:
                src = mine + (slot * world + peer) * max_n + start + offs
                v = tl.load(src, mask=m, other=0, volatile=True)
                k = 0
                while (tl.max(((v == SENTINEL) & m).to(tl.int32), axis=0) != 0) & (k < limit):
                    v = tl.load(src, mask=m, other=0, volatile=True)
                    k += 1
                acc += v.to(tl.bfloat16, bitcast=True).to(tl.float32)
        tl.store(out + start + offs, acc.to(tl.bfloat16), mask=m)
    # 3. clear the slot of the call before (every peer's region, whole chunks: max_n is a multiple of BLOCK)
    for start in range(pid * BLOCK, prev_n, P * BLOCK):
        for peer in tl.static_range(world):
            if peer != rank:
                tl.store(mine + (old * world + peer) * max_n + start + offs, tl.full([BLOCK], SENTINEL, tl.int16))
    tl.store(state + pid, (slot + 1) % 3)
    tl.store(state + P + pid, n)
