"""Small-M linear on k-bit weights with tensor cores (CUDA C++ through NVRTC): ``y = x @ W.T (+ bias)``, M <= 64.

Swap-AB: the weight is the A operand of ``mma.sync.m16n8k16`` (16 rows x 16 columns), the activations the B
operand (up to 8 tokens per mma), fp32 accumulation. Codes are looked up in a shared-memory table of
fp16/bf16 pairs (k = 3, 4), quads (k = 2) or single values (k = 5), stored once per lane (conflict-free).
The block scale multiplies each 32-column block's mma result (fp32) before it is added to the accumulator.

The kernel reads a **repacked layout** (:func:`repack`, format "mma-v1"), made from the canonical layout of
``docs/format.md``; :func:`unrepack` is its inverse. :func:`linear_small_m` takes canonical tensors and caches
their repacked copy per weight (:func:`repacked`: the weight is then held twice); :func:`linear_repacked` takes
a weight held in layout "mma-v1" only (what ``kbit.nn.KbitLinear`` holds after ``repack_for_kernels``), and
:func:`linear_mma_v1` (torch op ``kbit::linear_mma_v1``) serves any M from it (other kernels get an unrepacked
temporary). Where the CUDA path is not available (no GPU, no NVRTC, Triton interpreter), they fall back to
``kbit.ops.gemv.gemv`` (Triton).

Layout "mma-v1" of one matrix ``[N, K]`` (Nt = ceil(N / 16) row tiles, S = ceil(Kp / 256) segments):

- codes: int32 ``[Nt, S, k, 32, 4]``. Lane ``l = 4g + t`` of (tile, segment) holds the 128 codes of rows
  ``16 tile + g + 8r`` (r = 0, 1) and columns ``256 seg + 32u + 8t + 4h + 2j + e`` (u = 0..7; h, j, e = 0, 1),
  in the order (u, h, j, r, e) (k = 2: (u, h, e, j, r)), as a k-bit little-endian bit stream over its 4k
  words (so a byte holds the pair (e = 0, 1) of an mma A register at k = 4; at k = 2 the 2-bit slot 2j + r of
  bytes (2h, 2h + 1) of word u is that pair, looked up from registers by byte permutes); word j of the lane
  sits at
  ``[tile, seg, j // 4, l, j % 4]``. Rows >= N and columns >= Kp hold code 0.
- scales: uint8 (log8) or float16 ``[Nt, S, 8, 16]``: ``[tile, seg, g, 2u + r]`` is the scale of row
  ``16 tile + g + 8r``, 32-column block ``8 seg + u`` (a scale of blocksize 64 / 128 repeated); padding holds
  255 (log8, the zero block) or 0.0 (fp16), so padded weights are exactly 0.
"""

from __future__ import annotations

import math
import os
import weakref

import torch
import torch.nn.functional as F

__all__ = ["repack", "unrepack", "repacked", "linear_small_m", "linear_repacked", "linear_mma_v1", "serves",
           "dequant_repacked", "kbit_linear_small_m", "available", "MAX_M", "LAYOUT", "RepackedWeight"]

LAYOUT = "mma-v1"
MAX_M = 64
SEG = 256


#: kernel number of the swap-AB family -> (source file, kernel name) in kbit.cuda
MMA_KERNELS = {1: ("gemv_mma_split.cu", "kbit_gemv_mma_split"), 2: ("dead.cu", "kbit_kernel2"),
               3: ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk"), 4: ("mma_pipe.cu", "kbit_mma_pipe"),
               6: ("dead.cu", "kbit_kernel6"), 7: ("wgmma.cu", "kbit_wgmma")}


def available(device=None) -> bool:
    """True when the CUDA kernel can run on ``device`` (CUDA, NVRTC found, sm_80 or newer)."""
    from kbit.cuda import available as cuda_available

    if not cuda_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 8


# ------------------------------------------------------------------------------------------------ repack


def _geometry(N, K, blocksize):
    Kp = -(-K // blocksize) * blocksize
    return Kp, -(-N // 16), -(-Kp // SEG)


def repack(codes: torch.Tensor, scales: torch.Tensor, *, k: int, blocksize: int, scale_format: str, N: int,
           K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical ``(codes [N, Kp*k/32], scales [N, Kp/B])`` -> layout "mma-v1" ``(codes, scales)`` (new tensors).

    Plain torch, deterministic, on the tensors' device; byte-level ops on chunks of row tiles (:func:`_recode`).
    See the module docstring for the layout; :func:`unrepack` is the inverse.
    """
    if codes.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"codes, scales: expected 2-D tensors, got {tuple(codes.shape)}, {tuple(scales.shape)}")
    Kp, Nt, S = _geometry(N, K, blocksize)
    if tuple(codes.shape) != (N, Kp * k // 32) or codes.dtype != torch.int32:
        raise ValueError(f"codes: expected int32 {(N, Kp * k // 32)}, got {codes.dtype} {tuple(codes.shape)}")
    dev = codes.device
    words = torch.empty(Nt, S, k, 32, 4, dtype=torch.int32, device=dev)
    _recode(codes.contiguous(), words, k, Kp, N, to_mma=True)
    # scales: expand to 32-column blocks, pad, [Nt, r, g, S, u] -> [Nt, S, g, u, r]
    rs = torch.empty(Nt, S, 8, 16, dtype=scales.dtype, device=dev)
    if blocksize == 32 and N == 16 * Nt and Kp == S * SEG:
        src = scales  # nothing to expand or pad: permuted straight into rs
    else:
        src = torch.full((Nt * 16, S * 8), 255 if scale_format == "log8" else 0.0, dtype=scales.dtype, device=dev)
        src[:N, : Kp // 32] = scales.repeat_interleave(blocksize // 32, dim=1)  # [N, Kp/32]
    rs.view(Nt, S, 8, 8, 2).copy_(src.reshape(Nt, 2, 8, S, 8).permute(0, 3, 2, 4, 1))
    return words, rs


def unrepack(rcodes: torch.Tensor, rscales: torch.Tensor, *, k: int, blocksize: int, N: int,
             K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack`: layout "mma-v1" -> canonical ``(codes, scales)`` (bit-exact, new tensors)."""
    Kp, Nt, S = _geometry(N, K, blocksize)
    if tuple(rcodes.shape) != (Nt, S, k, 32, 4) or rcodes.dtype != torch.int32:
        raise ValueError(f"rcodes: expected int32 {(Nt, S, k, 32, 4)} (layout {LAYOUT}), got {rcodes.dtype} "
                         f"{tuple(rcodes.shape)}")
    if tuple(rscales.shape) != (Nt, S, 8, 16):
        raise ValueError(f"rscales: expected {(Nt, S, 8, 16)} (layout {LAYOUT}), got {tuple(rscales.shape)}")
    codes = torch.empty(N, Kp * k // 32, dtype=torch.int32, device=rcodes.device)
    _recode(codes, rcodes.contiguous(), k, Kp, N, to_mma=False)
    s = rscales.view(Nt, S, 8, 8, 2).permute(0, 4, 2, 1, 3).reshape(Nt * 16, S * 8)[:N, : Kp // 32]
    return codes, s[:, :: blocksize // 32].contiguous()


# Byte-level recoding between the canonical codes and layout "mma-v1", a chunk of T row tiles at a time.
# A lane's k-bit stream, as bytes, sits at ``rc.view(uint8)[tile, seg, a, lane, c]`` (stream byte 16a + c).
# k = 4: stream byte 8u + 4h + 2j + r holds the code pair (e = 0, 1) of row r: one canonical byte (a pure byte
# permutation, written in place when the chunk needs no padding). k = 2: stream byte 4u + 2h + e holds (j, r)
# (slot 2j + r), from the canonical bytes (j, e) of rows r = 0, 1: a 2-bit exchange then a permutation.
# k = 3, 5: codes as bytes in between.


def _chunk_tiles(S: int, k: int, device) -> int:
    """Row tiles a chunk: ~32M codes on a GPU at k = 2, 4 (temporaries <= 0.5 byte a code), ~8M at k = 3, 5
    (~6 bytes a code); ~4M on the CPU."""
    cuda = torch.device(device).type == "cuda"
    codes = 1 << ((25 if k in (2, 4) else 23) if cuda else 22)
    return max(1, codes // (S * SEG * 16))


def _recode(canon: torch.Tensor, rc: torch.Tensor, k: int, Kp: int, N: int, to_mma: bool) -> None:
    """Copy ``canon [N, Kp*k/32]`` into ``rc [Nt, S, k, 32, 4]`` (``to_mma``) or back, both preallocated."""
    Nt, S = rc.shape[:2]
    step = _chunk_tiles(S, k, rc.device)
    for t0 in range(0, Nt, step):
        t1 = min(Nt, t0 + step)
        T, r0, r1 = t1 - t0, t0 * 16, min(N, t1 * 16)
        direct = r1 - r0 == 16 * T and Kp == S * SEG  # no padding: permute straight into the destination
        if to_mma:
            src = canon[r0:r1] if direct else _pad_rows(canon[r0:r1], T, S, k)
            _to_mma(src, rc[t0:t1], k)
        elif direct:
            _from_mma(rc[t0:t1], canon[r0:r1], k)
        else:
            full = torch.empty(16 * T, S * SEG * k // 32, dtype=torch.int32, device=rc.device)
            _from_mma(rc[t0:t1], full, k)
            for a, b, n in _plane_spans(k, Kp, S * SEG):
                canon[r0:r1, a:a + n] = full[: r1 - r0, b:b + n]


def _plane_spans(k: int, Kp: int, Kfull: int):
    """(first word in rows of Kp codes, first word in rows of Kfull codes, words) of each bit plane."""
    from kbit.format.pack import PLANES

    a = b = 0
    for width, _ in PLANES[k]:
        yield a, b, Kp * width // 32
        a, b = a + Kp * width // 32, b + Kfull * width // 32


def _pad_rows(words: torch.Tensor, T: int, S: int, k: int) -> torch.Tensor:
    """Canonical rows ``[R <= 16T, Kp*k/32]`` -> ``[16T, S*256*k/32]``, zero codes in the padding (the planes
    of k = 3, 5 each padded)."""
    R, Kp = words.shape[0], words.shape[1] * 32 // k
    out = torch.zeros(16 * T, S * SEG * k // 32, dtype=torch.int32, device=words.device)
    for a, b, n in _plane_spans(k, Kp, S * SEG):
        out[:R, b:b + n] = words[:, a:a + n]
    return out


def _to_mma(canon: torch.Tensor, rc: torch.Tensor, k: int, general: bool = False) -> None:
    """Full canonical tiles ``[16T, S*256*k/32]`` -> ``rc [T, S, k, 32, 4]`` (written in place)."""
    T, S = rc.shape[:2]
    dst = rc.view(torch.uint8)
    src = canon.view(torch.uint8)
    if k == 4 and not general:
        # canonical byte [T, r, g, S, uh, ul, t, h, j] -> stream byte [T, S, a = uh, g, t, c = (ul, h, j, r)]
        src = src.view(T, 2, 8, S, 4, 2, 4, 2, 2)
        dst.view(T, S, 4, 8, 4, 2, 2, 2, 2).copy_(src.permute(0, 3, 4, 2, 6, 5, 7, 8, 1))
        return
    if k == 2 and not general:
        # canonical byte [T, r, g, S, uh, ul, t, h] holds (j, e); stream byte [T, S, uh, g, t, (ul, h, e)] (j, r)
        b = src.view(T, 2, 8, S, 2, 4, 4, 2)
        x0, x1 = b[:, 0], b[:, 1]
        lb = torch.stack([(x0 & 0x33) | ((x1 & 0x33) << 2), ((x0 >> 2) & 0x33) | (x1 & 0xCC)],
                         dim=-1)  # [T, g, S, uh, ul, t, h, e]
        dst.view(T, S, 2, 8, 4, 4, 2, 2).copy_(lb.permute(0, 2, 3, 1, 5, 4, 6, 7))
        return
    c = _unpack_bytes(canon, k)  # [16T, S*256] uint8
    # [T, r, g, S, u, t, h, j, e] -> [T, S, g, t, u, h, j, r, e] (k = 2: [.., h, e, j, r]): the lane's code order,
    # 16 groups of 8 codes
    order = (0, 3, 2, 5, 4, 6, 8, 7, 1) if k == 2 else (0, 3, 2, 5, 4, 6, 7, 1, 8)
    c = c.view(T, 2, 8, S, 8, 4, 2, 2, 2).permute(*order).reshape(T, S, 32, 16, 8)
    v = c[..., 0].to(torch.int64)
    for i in range(1, 8):
        v |= c[..., i].to(torch.int64) << (k * i)  # 8 codes = k bytes, little-endian
    del c
    lb = torch.stack([((v >> (8 * j)) & 255).to(torch.uint8) for j in range(k)], dim=-1)  # [T, S, 32, 16, k]
    dst.view(T, S, k, 32, 16).copy_(lb.view(T, S, 32, k, 16).permute(0, 1, 3, 2, 4))


def _from_mma(rc: torch.Tensor, canon: torch.Tensor, k: int, general: bool = False) -> None:
    """``rc [T, S, k, 32, 4]`` -> full canonical tiles ``[16T, S*256*k/32]`` (written in place)."""
    T, S = rc.shape[:2]
    src = rc.view(torch.uint8)
    dst = canon.view(torch.uint8)
    if k == 4 and not general:
        src = src.view(T, S, 4, 8, 4, 2, 2, 2, 2)
        dst.view(T, 2, 8, S, 4, 2, 4, 2, 2).copy_(src.permute(0, 8, 3, 1, 2, 5, 4, 6, 7))
        return
    if k == 2 and not general:
        b = src.view(T, S, 2, 8, 4, 4, 2, 2)
        n0, n1 = b[..., 0], b[..., 1]
        x = torch.stack([(n0 & 0x33) | ((n1 & 0x33) << 2), ((n0 >> 2) & 0x33) | (n1 & 0xCC)],
                        dim=-1)  # [T, S, uh, g, t, ul, h, r]
        dst.view(T, 2, 8, S, 2, 4, 4, 2).copy_(x.permute(0, 7, 3, 1, 2, 5, 4, 6))
        return
    # stream bytes [T, S, 32, 16k] -> codes: code i = stream bits ik .. ik + k - 1 (two bytes hold it)
    b = torch.nn.functional.pad(src.view(T, S, k, 32, 16).permute(0, 1, 3, 2, 4).reshape(T, S, 32, 16 * k), (0, 1))
    q = torch.arange(128, device=rc.device) * k
    lo, off = q // 8, (q % 8).to(torch.int16)
    v = b[..., lo].to(torch.int16) | (b[..., lo + 1].to(torch.int16) << 8)
    del b
    c = ((v >> off) & (2**k - 1)).to(torch.uint8)  # [T, S, 32, 128]
    del v
    # [T, S, g, t, u, h, j, r, e] (k = 2: [.., h, e, j, r]) -> [T, r, g, S, u, t, h, j, e]
    order = (0, 8, 2, 1, 4, 3, 5, 7, 6) if k == 2 else (0, 7, 2, 1, 4, 3, 5, 6, 8)
    c = c.view(T, S, 8, 4, 8, 2, 2, 2, 2).permute(*order).reshape(16 * T, S * SEG)
    _pack_bytes(c, k, out=canon)


def _unpack_bytes(words: torch.Tensor, k: int) -> torch.Tensor:
    """Canonical int32 words ``[R, Kp*k/32]`` -> uint8 codes ``[R, Kp]`` (``kbit.format.pack.unpack`` on bytes)."""
    from kbit.format.pack import PLANES

    R, Kp = words.shape[0], words.shape[1] * 32 // k
    b = words.view(torch.uint8)
    c, start = None, 0
    for width, shift in PLANES[k]:
        n = Kp * width // 8  # bytes of this plane
        plane = b[:, start:start + n, None] >> torch.arange(0, 8, width, device=b.device, dtype=torch.uint8)
        plane = (plane & ((1 << width) - 1)).reshape(R, Kp)
        c = plane if c is None else c | (plane << shift)
        start += n
    return c


def _pack_bytes(c: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """uint8 codes ``[R, Kp]`` -> canonical int32 words ``out [R, Kp*k/32]`` (``kbit.format.pack.pack`` on
    bytes)."""
    from kbit.format.pack import PLANES

    R, Kp = c.shape
    dst = out.view(torch.uint8)
    start = 0
    for width, shift in PLANES[k]:
        bits = c if (shift, width) == (0, k) else (c >> shift) & ((1 << width) - 1)
        per = 8 // width
        v = bits.view(R, Kp // per, per)
        byte = dst[:, start:start + Kp // per]
        byte.copy_(v[..., 0])
        for i in range(1, per):
            byte |= v[..., i] << (width * i)
        start += Kp // per


_CACHE: dict = {}


def cache_get(cache: dict, codes: torch.Tensor, scales: torch.Tensor):
    """The value ``cache`` holds for ``(codes, scales)``, or None: entries are keyed by the codes tensor (object
    and version, held weakly) and the scales tensor (object and version)."""
    hit = cache.get(id(codes))
    if (hit is not None and hit[0]() is codes and hit[1] == codes._version and hit[2]() is scales
            and hit[3] == scales._version):
        return hit[4]
    return None


def cache_put(cache: dict, codes: torch.Tensor, scales: torch.Tensor, val):
    """Store ``val`` for ``(codes, scales)`` (dropped when ``codes`` is freed); returns ``val``."""
    key = id(codes)
    cache[key] = (weakref.ref(codes), codes._version, weakref.ref(scales), scales._version, val)
    weakref.finalize(codes, cache.pop, key, None)
    return val


def repacked(codes: torch.Tensor, scales: torch.Tensor, *, k: int, blocksize: int, scale_format: str, N: int,
             K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`repack`, cached per ``codes`` tensor (object and version, held weakly) and ``scales`` version."""
    val = cache_get(_CACHE, codes, scales)
    if val is None:
        val = cache_put(_CACHE, codes, scales,
                        repack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K))
    return val


# ------------------------------------------------------------------------------------------------ launcher

_WS: dict = {}
_WS_OLD: list = []  # replaced workspaces, kept allocated (see _workspace)
_ETAB: dict = {}


def deterministic() -> bool:
    """Whether kernels 1 and 3 add the parts of a split tile in a fixed order (bit-identical outputs run to run and
    replay to replay) instead of with fp32 atomics in arrival order: when ``torch.use_deterministic_algorithms(True)``
    is on, or ``KBIT_DETERMINISTIC=1``. Off by default: it cost ~95 us of a 2.54 ms Llama-3-8B decode step at
    k = 4 on an H100 (``benchmarks/results/h100/step-timeline-s10-det.txt``, session 10). Kernel-3 builds with
    CTA-aligned units (``CAU``, session 19) are deterministic either way and take no DET slots."""
    return torch.are_deterministic_algorithms_enabled() or os.environ.get("KBIT_DETERMINISTIC") == "1"


def _workspace(device, n_floats, n_tiles):
    """fp32 partial sums (``n_floats``) and per-tile counters, zero at rest (the kernel re-zeroes what it used)."""
    key = device  # one per device: calls on concurrent streams must not use split K at the same time
    ws = _WS.get(key)
    if ws is None or ws[0].numel() < n_floats or ws[1].numel() < n_tiles:
        # each part only grows: a call that needs more counters must not shrink the partial sums (the size the
        # workspace settles at would depend on the order of the calls)
        # the replaced buffers stay allocated: CUDA graphs captured before and prepared launches
        # (prepare_repacked) hold their addresses; sizes double, so what is kept is at most the final size
        have = (0, 0) if ws is None else (ws[0].numel(), ws[1].numel())
        if ws is not None:
            _WS_OLD.append(ws)
        ws = (torch.zeros(_grown(have[0], n_floats, 1 << 16), dtype=torch.float32, device=device),
              torch.zeros(_grown(have[1], n_tiles, 4096), dtype=torch.int32, device=device))
        _WS[key] = ws
    return ws


def _grown(have, need, floor):
    """A workspace part's new size: kept if it holds ``need``, else at least doubled (and at least ``floor``)."""
    return have if have >= need else max(need, floor, 2 * have)


def _etab(device):
    t = _ETAB.get(device)
    if t is None:
        from kbit.format.spec import log8_values

        t = _ETAB[device] = log8_values(device).contiguous()
    return t


def _ng(M):
    """8-token groups of a launch (kernels 1-4 take M <= 64 a launch; kernel 6 up to 256)."""
    return 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8 if M <= 64 else 16 if M <= 128 else 32


def _permute_x(x2):
    """x columns in the K order of layout "mma-v1" (kernel 6's wgmma B operand): within each 32-column unit,
    column 8t + 4h + 2p + e moves to 16h + 8p + 2t + e."""
    M, Kw = x2.shape
    return x2.view(M, Kw // 32, 4, 2, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(M, Kw)


#: kernel 3: register pipeline depth (segments) per k
PIPE = {2: 2, 3: 3, 4: 2, 5: 2}
#: k values for which kernel 1 adds its warps' partial sums in warp order (``K1WO`` in the source) instead of with
#: shared-memory float atomics: a CTA's sums are then the same run to run (kernel 1's outputs too where K is not split
#: across CTAs). H100 (``benchmarks/results/h100/k1wo-s20-ab.log``, ``e2e-s20-k1wo*.md``): k = 4 4096x14336 M = 1
#: 14.1 -> 13.3 us, Llama-3-8B decode step 2.434 / 2.415 -> 2.402 / 2.384 ms; k = 2 GEMVs unchanged but its step
#: 2.079 / 2.059 -> 2.105 / 2.085 ms (not understood), so k = 2 keeps the atomics. Only at M <= 8 (one 8-token
#: group): with more groups the build spilled more (k = 4 M = 64: 16 -> 48 bytes of stack) and was not measured
K1WO_K = (3, 4, 5)
#: kernel 3 is the default from this many rows (M <= 8): it won on 28672 / 57344 rows, lost on 4096 / 8192
TALL = 16384
#: M = 1 on more rows than this (16-row tiles > 2 CTAs x 132 SMs) goes to kernel 3 with x in shared memory below
#: BIG: kernel 1 then splits K into pieces of one segment a warp (H100, ``benchmarks/results/h100/
#: m1-cfg-sweep-s7-*.log``: k = 4 6144x4096 15.5 -> 9.3 us, 14336x4096 33.6 -> 16.3, 10240x5120 27.4 -> 14.6;
#: at most 0.5 us slower on 8192x4096 / 12288x4096)
WIDE = 4224
#: kernel 3 with x staged in shared memory (config[4] = 1): dynamic shared bytes at most (2 CTAs an SM)
XS_MAX = 110 * 1024
#: kernels 1 / 3: bytes of a CTA's (1) / warp's (3) first weights bulk-prefetched into L2 before the PDL wait, on
#: weights under BIG elements (``KBIT_L2PF`` overrides, lab). H100, consecutive M = 1 calls
#: (``benchmarks/results/h100/m1-cfg-sweep-s7-l2pf.log``): kernel 1 4096x4096 k = 4 7.00 -> 6.47 us, 4096x14336
#: 15.09 -> 14.76; kernel 3 and kernel 1 on 8192x28672 only slower (up to +10% at 64 KB), so off there.
L2PF = {1: 16384, 3: 0}
#: kernel 2: cp.async pipeline depth (stages) per k; shared memory per CTA available on sm_90
DEPTH = {2: 8, 3: 6, 4: 4, 5: 4}
SMEM_MAX = 227 * 1024
#: N * K from which (many tiles or long K) 4-warp CTAs, 4 an SM, won in the H100 sweep (run 3)
BIG = 2 * 10**8


#: 9 <= M <= 16 on sm_90 with at least XK_MIN_N rows and XK_MIN_NK weights: kernel 3 with K slices of x in shared
#: memory (config[5] = XK segments a slice), 16 warps a CTA. H100, ``benchmarks/results/h100/m16-s14-xk-sweep1.log``,
#: ``k7-s14-k235.log``, M = 16, k = 4 (kernel 4 -> this): 28672x4096 44.3 -> 37.7 us, 8192x28672 71.5 -> 66.8,
#: 57344x8192 135.2 -> 129.0; 4096x14336 21.8 vs 22.0 and 4096x4096 8.9 vs 12.9 (kernel 1 / 4 kept there)
XK_MIN_N = 8192
XK_MIN_NK = 5 * 10**7
XK_CFG = (3, 16, 1, 3, 1, 8)


#: M <= 8 below BIG on WIDE < N <= 16 * ONE_TILE_CTAS * SMs: kernel 1 with 8 warps and 3 CTAs an SM (80 registers;
#: every 16-row tile its own CTA, K unsplit, no workspace) instead of kernel 3 (whose warps then split every tile
#: and add partial sums through the workspace). H100 (``benchmarks/results/h100/m1-cfg-sweep-s16-mid.log``, us,
#: M = 1 / 4): k = 4 6144x4096 9.29 / 11.25 -> 8.61 / 9.33, 5120x2048 6.57 / 7.22 -> 5.73 / 5.86; k = 2 6144x4096
#: 8.78 / 9.43 -> 6.24 / 6.39, 5120x2048 6.07 / 6.39 -> 3.71 / 3.74. k = 2..4 up to 16 * ONE_TILE_CTAS_4 * SMs rows
#: with 4 CTAs an SM (64 registers; k = 3 / 4: 8 / 16 bytes of stack), measured with kernel 1's early first loads
#: (K1EARLY; ``m1-cfg-sweep-s16-k34.log``, us, M = 1 / 8): k = 4 8192x4096 10.89 / 13.78 -> 10.88 / 12.28, 7168x5120
#: 12.99 / 16.30 -> 11.84 / 13.27, 7168x4096 9.83 / 12.11 -> 9.87 / 11.43; k = 3 8192x4096 10.23 / 12.88 -> 9.07 /
#: 10.48; k = 2 8192x4096 (``-mid.log``) 9.58 / 10.64 (M = 4) -> 7.78 / 7.89. k = 5 not measured there (72 bytes)
ONE_TILE_CTAS = 3
ONE_TILE_CTAS_4 = 4
#: k = 2, M <= 8, up to 16 * K2_SMALL_CTAS * SMs rows (beyond the routes above): kernel 1 with 4-warp CTAs, 6 an SM
#: (``benchmarks/results/h100/m1-cfg-sweep-s16-wide.log``, us, M = 1 / 2 / 8: 10240x4096 10.79 / 12.28 / 13.33 ->
#: 10.32 / 10.56 / 10.55, 12288x4096 13.37 / 15.27 / 15.83 -> 10.89 / 11.00 / 12.08; 10240x5120 12.91 / 14.02 /
#: 14.76 -> 13.29 / 13.37 / 13.78; 14336x4096 (896 tiles) lost)
K2_SMALL_CTAS = 6


def default_config(k, M, N, K, sm90=False, sms=None):
    """(kernel, warps a CTA, X) for one launch; X = min CTAs an SM (kernel 1) or pipeline stages (kernel 2).
    ``sm90``: the device is an H100-class GPU (the XK configs were measured there only). ``sms``: the device's
    SM count (the one-tile-a-CTA kernel-1 route, :data:`ONE_TILE_CTAS`, needs it; None: not taken).

    Kernel 4 (M > 16, and 9 <= M <= 16 with N >= 8192; H100 runs of 2026-11-21 in
    ``benchmarks/results/h100/mid-2026-11-21-*``): a CTA of W warps streams (row block, segment) pairs (stream-K),
    x / codes / scales of each segment through a cp.async shared-memory pipeline, block scales folded into the A
    fragments; ``config`` (4, W, row tiles a warp, stages[, min CTAs an SM]).
    Kernel 3 (N >= TALL, M = 1 on N > WIDE below BIG, and k = 2 with N * K >= BIG: M = 1 with x staged in
    shared memory (H100,
    ``benchmarks/results/h100/m1-cfg-sweep-2026-11-22.log``); N >= TALL: 2 <= M <= 8 without, not k = 4 with
    N * K >= BIG): stream-K over (tile, segment) pairs, a contiguous range a warp, register ring of PIPE[k]
    segments (faster there in the H100 runs of issue 3, 2026-11-21-issue3). ``config`` for kernel 3:
    (3, W, CTAs an SM, ring depth, x in shared memory 0/1).
    2 <= M <= 16 (H100, ``benchmarks/results/h100/m1-cfg-sweep-s9-m16.log``, ``-m2-8.log``): kernel 3 without XS on
    WIDE < N < 8192 below BIG (kernel 1 splits K badly there too) and, at k = 2, on N >= TALL; kernel 1 with
    4-warp CTAs at k = 2 on N * K >= BIG below TALL.
    Kernel 1: a CTA per (row tile, K split), its warps take the split's segments round-robin (register
    double buffer), shared-memory reduction. Kernel 2: every warp streams whole (tile, K split) tasks through
    its own cp.async pipeline. ``KBIT_MMA_CFG="kernel,W,X"`` overrides (lab).
    """
    ng = _ng(M)
    if sm90 and ng == 2 and N >= XK_MIN_N and N * K >= XK_MIN_NK and _cau_mid(k, N, K, sms):
        cfg = (3, 8, 2, 2)  # CTA-aligned units, x from global memory (cau-s19-m12-16.log, M = 12 / 16, us):
        # 14336x4096 k = 4 23.62 / 22.84 -> 19.43 / 20.59, k = 2 18.39 / 18.39 -> 15.62 / 16.55; 28672x4096 k = 2
        # 31.58 / 31.64 -> 26.72 / 28.56 (the K slices before)
    elif sm90 and ng == 2 and k == 2 and N >= TALL and N * K >= BIG:  # 57344x8192 M = 12 / 16 103.07 / 103.74 ->
        cfg = (3, 16, 1, 2)  # 91.06 / 98.23 us (K slices before; cau-s19-m12-16.log)
    elif sm90 and ng == 2 and N >= XK_MIN_N and N * K >= XK_MIN_NK:
        cfg = XK_CFG
    elif sm90 and ng in (4, 8) and N * K < LARGE7_SMALL_NK:
        cfg = SMALL_MID_CFG
    elif ng == 8:
        cfg = (4, 16, 1, 2)
    elif ng == 2 and k == 2 and N >= TALL:  # 57344x8192 108.3 vs 116.4 us (kernel 4)
        cfg = (3, 8, 2, 2)
    elif ng == 2 and k == 2 and N * K >= BIG:  # 8192x28672 55.9 vs 62.4 us (kernel 4)
        cfg = (1, 4, 4)
    elif ng == 4 or (ng == 2 and N >= 8192):
        cfg = (4, 8, 1, 2)
    elif ng == 2 and N > WIDE and N * K < BIG:  # 6144x4096 k = 4 20.3 -> 15.1 us, k = 2 17.8 -> 13.5 (kernel 1)
        cfg = (3, 8, 2, 2)
    elif sms and M <= 8 and WIDE < N <= 16 * ONE_TILE_CTAS * sms and N * K < BIG:
        cfg = (1, 8, ONE_TILE_CTAS)
    elif sms and k <= 4 and M <= 8 and WIDE < N <= 16 * ONE_TILE_CTAS_4 * sms and N * K < BIG:
        cfg = (1, 8, ONE_TILE_CTAS_4)
    elif sms and k == 2 and M <= 8 and WIDE < N <= 16 * K2_SMALL_CTAS * sms and N * K < BIG:
        cfg = (1, 4, K2_SMALL_CTAS)
    elif M == 1 and (N >= TALL or (k == 2 and N * K >= BIG)):  # k = 2 8192x28672: 39.4 vs 46.0 us (kernel 1)
        cfg = (3, 8, 2, PIPE[k], 1)
    elif M == 1 and N > WIDE and N * K < BIG:  # more row tiles than 2-CTA slots: kernel 1 splits K badly
        cfg = (3, 8, 2, 2, 1)
    elif M <= 8 and N > WIDE and N * K < BIG and N < TALL:  # the same at M = 2..8: 6144x4096 k = 4 15.7 -> 11.0
        cfg = (3, 8, 2, 2, 1)  # us, 10240x5120 28.2 -> 16.5 (m1-cfg-sweep-s9-m2-8.log); x staged (XS): 14336x4096
        # M = 2 / 8, k = 2 15.97 / 16.57 -> 13.97 / 15.32, k = 4 18.59 / 20.50 -> 17.10 / 19.23 (m1-cfg-s17-m2-8.log)
    elif M <= 8 and N >= TALL and (M <= 4 or N * K < BIG or k == 4):  # x staged, ring 2 (m1-cfg-s17-m2-8.log):
        cfg = (3, 8, 2, 2, 1)  # 28672x4096 M = 2 k = 2 25.31 -> 22.83, k = 5 39.69 -> 36.32; 57344x8192 k = 4 M = 4
        # 103.65 -> 94.86 (was kernel 1), k = 5 M = 2 135.12 -> 120.77; M = 8 on 57344x8192: k = 2 / 5 tie, k = 3 lost
    elif M <= 8 and N >= TALL and (k != 4 or N * K < BIG):
        cfg = (3, 8, 2, PIPE[k])
    elif N * K >= BIG:  # 8192x28672 (m1-cfg-s17-m2-8.log): (1, 8, 2) k = 4 M = 1 50.15 -> 47.87, k = 5 M = 2 / 8
        # 73.34 / 79.40 -> 69.05 / 77.37; k = 3 and k = 5 M = 1 kept (1, 4, 4) (tie / 66.17 vs 68.41)
        cfg = (1, 8, 2) if (k == 4 and M == 1) or (k == 5 and 2 <= M <= 8) else (1, 4, 4)
    else:
        cfg = (1, 8, 2)
    if os.environ.get("KBIT_MMA_CFG"):
        cfg = tuple(int(v) for v in os.environ["KBIT_MMA_CFG"].split(","))
    return cfg


def large_ok(device) -> bool:
    """Kernel 7 (wgmma; see :func:`uses_large`) runs here: sm_90 (it is compiled for sm_90a)."""
    return torch.cuda.get_device_capability(device) == (9, 0) and os.environ.get("KBIT_LARGE_M", "1") != "0"


#: kernel 7 serves every M from this (sm_90). H100, session 14 (``benchmarks/results/h100/k7-s14-m16-m32.log``,
#: ``k7-s14-k235.log``, ``k7-s14-small-shapes.log``), M = 32, kernels 1-4 -> kernel 7 with 32-token tiles: k = 4
#: 28672x4096 61.7 -> 51.9 us, 4096x14336 36.3 -> 32.6, 57344x8192 180.9 -> 152.7, 8192x28672 97.0 -> 82.6,
#: 14336x4096 38.1 -> 31.7, 6144x4096 26.5 -> 25.8, 4096x4096 22.9 -> 18.3, 1024x4096 14.3 -> 13.8; k = 2 57344x8192
#: 154.4 -> 146.9. At M = 16 kernel 3 (x slices) or kernel 1 win.
LARGE7_MIN_M = 17


def large_config(k, M, N, K):
    """Kernel 7's config (7, warps a CTA, 8-token groups a tile, x stages, token blocks a raster group, x swizzled
    [, x by bulk copy (1: CTA barrier, 2: empty mbarriers), refill lag, stream-K]).

    H100 lab runs of 2026-11-22 (``benchmarks/results/h100/large7-s6-run*.log``, k = 4, four shapes): x tiled on
    the device and bulk-copied (XB) beat the cp.async loader everywhere; up to M = 128 (and M <= 256 when N < 8192)
    128-token tiles of 12 warps with stream-K won, up to 256 256-token tiles with stream-K, above 256-token tiles
    without it. M <= 64 keeps the session-4 config (64-token tiles, no XB: not measured with it).
    Session 14 (``benchmarks/results/h100/k7-s14-*.log``): M <= 32 32-token tiles of 8 warps; M <= 64 64-token
    tiles, 6 x stages, bulk-copied x and stream-K, 16 warps on weights of >= BIG elements (k = 4 57344x8192 M = 64
    kernel 4 283.5 -> 192.8 us), else 12 warps (4096x14336 51.0 -> 42.1 us against the session-4 config); k = 5 12
    warps everywhere (16 spill: 57344x8192 M = 64 320.3 vs 278.5 us).
    ``KBIT_LARGE_CFG="7,W,NG,D,GM,XSW[,XB,LAG,SK]"`` overrides (lab)."""
    if os.environ.get("KBIT_LARGE_CFG"):
        return tuple(int(v) for v in os.environ["KBIT_LARGE_CFG"].split(","))
    if M <= 32:
        return (7, 8, 4, 6, 8, 1, 1, 0, 1)
    if M <= 64:
        return (7, 16 if N * K >= BIG and k != 5 else 12, 8, 6, 8, 1, 1, 0, 1)
    if M <= 128 or (M <= 256 and N < 8192):
        return (7, 12, 16, 4, 8, 1, 1, 0, 1)
    if M <= 256:
        return (7, 8, 32, 4, 8, 1, 1, 0, 1)
    return (7, 8, 32, 4, 8, 1, 1)


#: kernel 7 serves every M up to this; above it, weights of at least LARGE7_BIG_NK elements (dequantize + cuBLAS
#: won by ~5% at M = 4096 on 28672x4096 and 4096x14336, kernel 7 by 4-8% on 57344x8192 and 8192x28672: H100,
#: ``benchmarks/results/h100/large7-s6-run3.log`` against ``large7-s6-run1-xb.log``'s dequantize + cuBLAS)
LARGE7_MAX_M = 2048
LARGE7_BIG_NK = 2 * 10**8
#: below this many weight elements, M 65..256 goes to dequantize + cuBLAS (4096x4096: 0.55-0.60x bf16 there
#: against kernel 7's 0.40-0.44x at M = 64..256; ``benchmarks/results/h100/issue4-s6-2026-11-22.md``) and M 17..64
#: to kernel 1 (:data:`SMALL_MID_CFG`)
LARGE7_SMALL_NK = 2 * 10**7


#: small weights (under LARGE7_SMALL_NK elements) at M 17..64 on sm_90: kernel 1 (a CTA of 8 warps a 16-row tile and
#: K split, 2 CTAs an SM). H100 (``benchmarks/results/h100/mid-small-s15-ws4.log``, k = 4, us, kernel 7 -> kernel 1):
#: 4096x4096 M = 32 18.5 -> 13.0, M = 64 23.1 -> 18.6 (dequantize + cuBLAS, the M = 64 route before: 25.8 in
#: ``k7-s14-small-shapes.log``); 1024x4096 M = 32 10.3 -> 8.9, M = 64 14.0 -> 11.9. Kernel 7 stays faster from
#: 6144x4096 (M = 64 28.1 vs 40.9)
SMALL_MID_CFG = (1, 8, 2)

#: split-K workspace: a lane's four partial sums by one ``red.global.add.v4.f32`` (``WS4``) where a tile has more
#: parts than this (NG > 1; kernel 7 with stream-K: CTAs / tiles, kernel 3: K slices x warps a slice / tiles,
#: kernel 1: K splits), else one atomic a value. H100, ``benchmarks/results/h100/ws4-ab3-2026-11-22.md``
#: (k = 4, us, scalar -> vector): kernel 7 6144x4096 M = 32 (~5.5 parts) 25.6-26.0 -> 20.7, M = 64 31.2-31.6 ->
#: 26.4, 4096x14336 M = 64 (~6) 41.9-42.1 -> 38.4; kernel 3 x slices 8192x28672 M = 16 (14 parts) 65.7-66.5 ->
#: 60.9; but 28672x4096 M = 16 / 32 / 64 (about 1-2 parts) 36.2-36.8 -> 38.7, 50.6-51.5 -> 54.5, 65.2-65.3 ->
#: 71.5 and 57344x8192 M = 16 (x slices, 4 parts) 128.4 -> 131.7, M = 64 191 -> 206 (the read-back waits for one
#: 16-byte load at a time). Kernel 7 at 4.1 parts (8192x28672 M = 32 / 64, 6144x4096 M = 64) gained 1-16%.
WS4_PARTS = 4


def uses_large(M, N, K, device, config=None) -> bool:
    """Whether :func:`linear_small_m` runs ``M`` rows as one kernel 7 launch (sm_90): M >= :data:`LARGE7_MIN_M`
    (up to 2048, more on big weights: :func:`large_serves`) except small weights at M <= 64
    (:data:`SMALL_MID_CFG`); a given ``config`` decides by its kernel."""
    if config is not None:
        return config[0] == 7
    return M >= LARGE7_MIN_M and large_ok(device) and not (M <= MAX_M and N * K < LARGE7_SMALL_NK)


def large_serves(M, N, K) -> bool:
    """Whether the dispatcher sends dense ``M`` rows on an ``[N, K]`` weight to this entry point where kernel 7
    runs (sm_90): kernels 1-4 up to M = 16 (and on small weights up to 64), kernel 7 above, except small weights
    at M 65..256 and, beyond :data:`LARGE7_MAX_M`, weights under :data:`LARGE7_BIG_NK` elements (dequantize +
    cuBLAS there)."""
    if N * K < LARGE7_SMALL_NK and MAX_M < M <= 256:
        return False
    return M <= LARGE7_MAX_M or N * K >= LARGE7_BIG_NK


def _table_smem(k):
    """Dynamic shared bytes of the lookup table plus its alignment pad."""
    tab = {2: 16, 3: 64 * 32 * 4, 4: 256 * 32 * 4, 5: 32 * 32 * 4}[k]  # k = 2: codebook in registers
    return tab + {3: 8192, 4: 128, 5: 4096}.get(k, 16)


def _stage_bytes(k, scale_format):
    return (k + (2 if scale_format == "fp16" else 1)) * 512


def _splits(n_tiles, nsteps, slots, max_split, divide):
    """K splits: the fewest (within 5% of the best) that fill ``slots`` evenly; at most ``max_split``."""
    best, best_eff = 1, 0.0
    for s in range(1, max(1, max_split) + 1):
        if divide and nsteps % s:
            continue
        items = n_tiles * s
        eff = items / (-(-items // slots) * slots)
        if eff > best_eff * 1.05:
            best, best_eff = s, eff
        if items >= 8 * slots:
            break
    return best


def _sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def large_defines(k, cfg, grouped=False):
    """(defines, dynamic shared bytes) of kernel 7 config ``cfg`` (:func:`large_config`); ``grouped``: the MoE
    form (``GRP``: x pre-tiled per block of a block table, no split K; ``kbit.ops.grouped_mma``)."""
    W, ng = cfg[1], cfg[2]  # warps; 8-token groups a tile: 8 (64 tokens), 16 (128) or 32 (256)
    D = cfg[3] if len(cfg) > 3 else 4
    gm = cfg[4] if len(cfg) > 4 else 8
    xc = 8 * ng * 128
    xsw = cfg[5] if len(cfg) > 5 else 1
    xb = cfg[6] if len(cfg) > 6 and xsw else 0  # x pre-tiled, one bulk copy a chunk (1: CTA barrier, 2: mbarriers)
    if xb not in (0, 1, 2):
        raise ValueError(f"config: x loader (config[6]) must be 0, 1 or 2, got {cfg}")
    if grouped and not xb:
        raise ValueError(f"config: the grouped kernel 7 needs x pre-tiled (XB = 1 or 2), got {cfg}")
    D = max(3, min(D, 8, (SMEM_MAX - 2048 - 1024 - _table_smem(k)) // xc))
    defines = dict(KERNEL=7, K_BITS=k, NG=ng, D=D, MAXW=W, MINB=1, RT=1, ARCH_SPECIFIC=1, AB=2, GM=gm, XSW=xsw,
                   XB=xb, WS4=0)
    if xb == 2 and len(cfg) > 7 and cfg[7]:
        defines["XLAG"] = cfg[7]  # chunks between a stage's last read and its refill
    if len(cfg) > 8 and cfg[8] and not grouped:
        defines["SK"] = 1  # stream-K
    if grouped:
        defines["GRP"] = 1
    defines.update(lab_defines())
    return defines, D * xc + _table_smem(k) + 1024


def lab_defines() -> dict:
    """Lab-only defines from ``KBIT_LAB_DEFINES="NAME=V,..."``, added to every kernel build of this module (e.g.
    kernel 7's ``LAB_NOLOOKUP=1``, ``LAB_NOFOLD=1``: timing variants with wrong results; ``LKH=0``; ``MBAR_TRAP=1``).
    Read when a plan is first built (plans are cached per process)."""
    v = os.environ.get("KBIT_LAB_DEFINES", "")
    return {kv.split("=")[0]: int(kv.split("=")[1]) for kv in v.split(",") if kv}


def plan(k, M, N, K, scale_format="log8", config=None, device=None, pro=0, epi=0):
    """The launch plan: dict of defines, block, grid, dynamic shared bytes, splits, segments a split. ``pro``: an x
    prologue (1: RMSNorm, 2: residual add + RMSNorm; kernel 3 with x in shared memory only); ``epi`` 1: the
    SiLU * up epilogue of a fused gate/up weight (kernel 3 only); see :mod:`kbit.ops.prologue`."""
    from kbit.cuda import compile_kernel
    
    dev = torch.device(device or "cuda")
    Nt, S = -(-N // 16), -(-K // SEG)
    n_cnt = Nt  # split-K counters (kernel 7: one set a token block)
    sm90 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
    cfg = tuple(config or default_config(k, M, N, K, sm90=sm90, sms=_sms(dev) if dev.type == "cuda" else None))
    kernel, W, X = cfg[:3]
    ng = _ng(M)
    if kernel == 3:
        pd = cfg[3] if len(cfg) > 3 else PIPE[k]
        xk = min(cfg[5], S) if len(cfg) > 5 and cfg[5] and not pro and not deterministic() else 0
        if xk:  # K slices of xk segments, x[:, slice] in shared memory (rows padded by 64 bytes)
            xs = 1
            shared = _table_smem(k) + M * (xk * SEG + 32) * 2
            if shared > SMEM_MAX:
                raise ValueError(f"config: x slices of {xk} segments for M={M} need {shared} bytes of shared "
                                 f"memory, more than {SMEM_MAX}")
        else:
            xs = int(len(cfg) > 4 and cfg[4] and _table_smem(k) + M * S * SEG * 2 <= XS_MAX)
            shared = _table_smem(k) + xs * M * S * SEG * 2
        defines = dict(KERNEL=3, K_BITS=k, NG=ng, D=1, MAXW=W, MINB=X, PD=pd, XS=xs, XK=xk)
        if pro:
            if not xs:
                raise ValueError(f"pro: an x prologue needs kernel 3 with x in shared memory, got config {cfg}")
            defines["PRO"] = pro
            shared += S * SEG * 2  # the norm weight
        if epi:
            defines["EPI"] = epi
    elif kernel == 1:
        W = max(1, min(W, S))
        defines = dict(KERNEL=1, K_BITS=k, NG=ng, D=1, MAXW=W, MINB=X)
        shared = _table_smem(k)
    elif kernel == 6:
        D = cfg[3] if len(cfg) > 3 else 4
        ab = cfg[4] if len(cfg) > 4 else 4
        minb = 1
        sv = 2 if scale_format == "fp16" else 1
        stage = 8 * ng * 512 + W * (k * 512 + sv * 128)
        D = max(3, min(D, (SMEM_MAX - 2048 - _table_smem(k)) // stage))
        defines = dict(KERNEL=6, K_BITS=k, NG=ng, D=D, MAXW=W, MINB=minb, RT=1, ARCH_SPECIFIC=1, AB=ab)
        shared = D * stage + _table_smem(k) + 128
    elif kernel == 7:
        defines, shared = large_defines(k, cfg)
        ng = defines["NG"]
    elif kernel == 4:
        rt = X
        D = cfg[3] if len(cfg) > 3 else 3
        minb = cfg[4] if len(cfg) > 4 else 1
        sv = 2 if scale_format == "fp16" else 1
        stage = 8 * ng * 576 + W * rt * (k * 512 + sv * 128)
        D = max(2, min(D, (SMEM_MAX - 2048 - _table_smem(k)) // stage))
        defines = dict(KERNEL=4, K_BITS=k, NG=ng, D=D, MAXW=W, MINB=minb, RT=rt)
        shared = D * stage + _table_smem(k)
    else:
        if ng > 2:
            W = min(W, 8)
        stage = _stage_bytes(k, scale_format)
        D = max(2, min(X, (SMEM_MAX - 1024 - _table_smem(k)) // (W * stage)))
        defines = dict(KERNEL=2, K_BITS=k, NG=ng, D=D, MAXW=W, MINB=1)
        shared = W * D * stage + _table_smem(k)
    if (pro or epi) and kernel != 3:
        raise ValueError(f"pro, epi: a prologue or epilogue needs kernel 3, got config {cfg}")
    if kernel in (1, 3):
        pf = L2PF.get(kernel, 0) if N * K < BIG else 0
        defines["L2PF"] = int(os.environ.get("KBIT_L2PF", pf))
    if kernel == 1 and ng == 1 and N * K < BIG:  # (``K1EARLY`` in the source; k1-prefetch-s16-ab.log)
        defines["K1EARLY"] = 1
    # ``M1``: the segment skips token 2t + 1's accumulators (m1-fix-s17.log); not for kernel 1 at 80 or 64 registers
    # (3+ CTAs of 8 warps an SM), where ptxas then spills more (e.g. k = 4 (1, 8, 3): 8 -> 32 bytes of stack)
    if M == 1 and (kernel == 3 or (kernel == 1 and W * X <= 16)):
        defines["M1"] = 1
    if kernel == 1:  # a CTA's warps summed in warp order (bit-stable run to run where K is not split across CTAs)
        defines["K1WO"] = int(k in K1WO_K and ng == 1)  # M <= 8: measured there; at M >= 9 it spills more
    if kernel in (1, 3) and deterministic():
        defines["DET"] = 1
    defines.update(BF16=0, FP16_SCALES=int(scale_format == "fp16"), WS4=0)
    if kernel != 7:
        defines.update(lab_defines())
    kern = compile_kernel(*MMA_KERNELS[defines["KERNEL"]], defines, dev)
    occ = kern.occupancy(W * 32, shared)
    slots = _sms(dev) * occ
    lfx = False
    gi = {1: 3, 3: 5}.get(kernel)  # CTAs an SM in the grid below the occupancy (lab): leaves room for the next
    if gi is not None and len(cfg) > gi and cfg[gi]:  # kernel's CTAs to become resident (PDL) while this one runs
        slots = _sms(dev) * min(occ, cfg[gi])
    if kernel == 3 and defines["XK"]:  # the same CTAs for every K slice (the kernel reads cps = grid / n_sl)
        n_sl = -(-S // defines["XK"])
        splits, sps = 1, S
        grid = n_sl * max(1, min(slots // n_sl, -(-(Nt * defines["XK"]) // W)))
    elif kernel == 3:
        splits, sps = 1, S  # not used by kernel 3 (it always takes the workspace)
        grid = max(1, min(slots, -(-(Nt * S) // W)))
        cau = _cau_plan(Nt, S, W, occ, _sms(dev), epi, ng, _read_us(k, N, K)) if _cau_enabled() else None
        if cau:  # CTA-aligned units: kept only where the build reaches the occupancy the plan assumed; they add a
            # tile's parts in warp order, so they also serve deterministic mode (in place of DET's slots)
            W_c, occ_c, cau_defs, sps_c, grid_c = cau
            defs_c = {**{d: v for d, v in defines.items() if d != "DET"}, **cau_defs, "MAXW": W_c, "MINB": occ_c}
            kern_c = compile_kernel(*MMA_KERNELS[defs_c["KERNEL"]], defs_c, dev)
            if kern_c.occupancy(W_c * 32, shared) >= occ_c:
                defines, kern, W, occ, sps, grid = defs_c, kern_c, W_c, occ_c, sps_c, grid_c
            else:
                cau = None
        lfx_on = _lfx_enabled(xs) and not defines.get("DET") and not cau
        lfx_defs = _lfx_defines(Nt, S, grid, W, epi) if lfx_on else None
        if lfx_defs:  # the CTA-local fix-up: static shared slots; kept only at the same occupancy
            kern_l = compile_kernel(*MMA_KERNELS[defines["KERNEL"]], {**defines, **lfx_defs}, dev)
            if kern_l.occupancy(W * 32, shared) >= occ:
                defines.update(lfx_defs)
                kern, lfx = kern_l, True
    elif kernel == 6:
        splits, sps = 1, S
        grid = max(1, min(slots, -(-Nt // W) * S))
    elif kernel == 7:
        n_tb = -(-M // (8 * ng))  # token blocks: each has its own split-K counters
        tiles = -(-Nt // W) * n_tb
        if defines.get("SK"):
            splits, sps = 1, S
            grid = max(1, min(slots, tiles * S))
        else:
            splits = _splits(tiles, S, slots, max(1, S // 4), divide=False) if tiles < 2 * slots else 1
            sps = -(-S // splits)
            splits = -(-S // sps)
            grid = max(1, min(slots, tiles * splits))
        n_cnt = n_tb * Nt
    elif kernel == 4:
        splits, sps = 1, S  # not used by kernel 4 (stream-K over (row block, segment) pairs, workspace fix-up)
        grid = max(1, min(slots, -(-Nt // (W * X)) * S))
    elif kernel == 1:
        splits = _splits(Nt, S, slots, S // W, divide=False)
        sps = -(-S // splits)
        splits = -(-S // sps)
        items = Nt * splits
        grid = -(-items // -(-items // slots))
    else:
        splits = _splits(Nt, S, slots * W, S // 2, divide=True)
        sps = S // splits
        grid = min(slots, -(-(Nt * splits) // W))
    # the split-K workspace layout (``WS4`` in the kernel source): NG > 1 and more than WS4_PARTS parts a tile ->
    # one vector reduction a lane; fewer parts keep one atomic a value
    if kernel == 7:
        parts = grid / tiles if defines.get("SK") else splits
    elif kernel == 3 and defines["XK"]:
        n_sl = -(-S // defines["XK"])
        parts = n_sl * max(1.0, (grid // n_sl) * W / Nt)
    elif kernel == 3 and (lfx or defines.get("CAU")):
        parts = 2.0  # LFX: at most a part from each CTA that a tile crosses into; CAU: no workspace
    elif kernel == 3:
        parts = max(1.0, grid * W / Nt)
    else:
        parts = splits if kernel == 1 else 0
    ws4 = int(ng > 1 and not defines.get("DET") and parts > WS4_PARTS)
    if "WS4" not in lab_defines() and ws4 != defines.get("WS4", 0):
        defines["WS4"] = ws4
        kern = compile_kernel(*MMA_KERNELS[defines["KERNEL"]], defines, dev)
    if kernel == 3 and defines.get("DET"):  # a slot a part of a tile (finish_det): parts start >= L segments apart
        L = max(Nt * S // (grid * W), 1)
        ws_floats = Nt * ((S + L - 2) // L + 1) * 128 * ng
    elif kernel == 1 and defines.get("DET"):  # a slot a K split of a tile
        ws_floats = Nt * splits * 128 * ng if splits > 1 else 0
    else:  # fp32 partial sums: NG * 128 floats a 16-row tile a token block (``ws_at`` in the kernel source)
        ws_floats = -(-M // (8 * ng)) * 8 * ng * Nt * 16
    return dict(defines=defines, W=W, grid=grid, shared=shared, splits=splits, sps=sps, Nt=Nt, S=S,
                regs=kern.num_regs, ctas_per_sm=occ, n_cnt=n_cnt, ws_floats=ws_floats,
                use_ws=kernel in (3, 4, 6) or splits > 1 or bool(defines.get("SK")))


def _lfx_enabled(xs) -> bool:
    """Kernel 3's CTA-local fix-up (``LFX``): ``KBIT_LFX=1`` everywhere (and CTA-aligned units off unless
    ``KBIT_CAU=1``), ``0`` nowhere; by default where x is not staged in shared memory and the plan did not take
    CTA-aligned units (``CAU``, which come first since session 19). H100, M = 1
    (``benchmarks/results/h100/lfx-s18-*.log``), x from global memory, us: 28672x4096 k = 4 28.75 -> 28.12 and
    28.17 -> 26.69 (two runs), k = 2 25.42 -> 22.44; 57344x8192 k = 4 94.26 -> 91.87, k = 2 81.65 -> 70.81;
    12288x4096 k = 4 15.07 -> 13.93. With x staged (XS) the same builds streamed
    4-10% slower (not understood) and lost: 57344x8192 k = 2 68.20 -> 73.68, Llama-3-8B decode step (k = 4, batch 1)
    2.555 -> 2.627 ms."""
    v = os.environ.get("KBIT_LFX")
    return v == "1" if v in ("0", "1") else not xs


def _read_us(k, N, K) -> float:
    """A k-bit N x K weight's read time at 2.5 TB/s, in us (CAU's idle-time rule)."""
    return N * K * (k + 0.25) / 8 / 2.5e6


def _cau_mid(k, N, K, sms) -> bool:
    """M = 9..16 (sm_90): kernel 3 (3, 8, 2, 2) with CTA-aligned units instead of K slices, below BIG weights
    (k = 5: below 1e8; 28672x4096 k = 5 M = 16 46.74 -> 48.57 us lost) where the plan would take CAU."""
    if not sms or N * K >= BIG or (k == 5 and N * K >= 10**8) or not _cau_enabled():
        return False
    S = -(-K // SEG)
    return _cau_plan(-(-N // 16), S, 8, 2, sms, 0, 2, _read_us(k, N, K)) is not None


def _cau_enabled() -> bool:
    """Kernel 3's CTA-aligned units (``CAU``, where :func:`_cau_plan` accepts the shape): ``KBIT_CAU=1`` / ``0``
    forces them on / off; by default on, except where ``KBIT_LFX=1`` asks for the CTA-local fix-up. H100: x staged
    (``benchmarks/results/h100/cau-s19-sweep.log``) M = 1 28672x4096 k = 4 27.21 -> 25.13 us, M = 4 29.38 -> 25.40;
    x from global memory at M = 16 (``cau-s19-m16.log``, against LFX) 6144x4096 k = 4 15.16 -> 11.99, 4096x14336
    k = 4 (3, 8, 2, 2) 26.99 -> 20.93; it lost nowhere that the plan takes it."""
    v = os.environ.get("KBIT_CAU")
    if v in ("0", "1"):
        return v == "1"
    return os.environ.get("KBIT_LFX") != "1"


#: CAU only where the busiest CTA's units are at most 1 / CAU_MIN_EFF of an even share of the SMs, and the SM
#: time left idle by whole units a CTA, (1 - eff) x the weights' read time, is at most CAU_IDLE_US: the split-K
#: fix-up it saves costs ~2-4 us a call (H100, ``benchmarks/results/h100/cau-s19-sweep.log``: 57344x8192 k = 4,
#: eff 0.97 of ~90 us, was 3% slower with CAU)
CAU_MIN_EFF = 0.9
CAU_IDLE_US = 1.5
#: CAU's shared slots: at most this many bytes a CTA
CAU_MAX_SLOT_BYTES = 32768


def _cau_plan(Nt, S, W, occ, sms, epi, ng=1, est_us=0.0):
    """Kernel 3 with CTA-aligned units (``CAU`` in the source): whole units (tiles; EPI: gate / up pairs) a CTA,
    their split-K parts summed in shared memory. Tries the configured CTAs (``W`` warps, ``occ`` an SM) and, where
    ``occ`` is even, half as many CTAs of twice the warps; returns ``(W, CTAs an SM, defines, units a CTA, grid)`` of
    the one that leaves the fewest SM slots idle, or None where the busiest CTA carries more than 1 / CAU_MIN_EFF
    of an even share (or leaves more than CAU_IDLE_US of ``est_us`` idle), or the slots would not fit."""
    tpu = 2 if epi else 1
    if Nt % tpu:
        return None
    n_u, U = Nt // tpu, tpu * S
    best = None
    for w, o in ((W, occ), (2 * W, occ // 2)):
        if o < 1 or w > 32:
            continue
        slots = sms * o
        upc = -(-n_u // slots)
        eff = n_u / (slots * upc)
        if best is None or eff > best[0] + 1e-9:
            best = (eff, w, o, upc)
    eff, w, o, upc = best
    if eff < CAU_MIN_EFF or (1 - eff) * est_us > CAU_IDLE_US:
        return None
    grid = -(-n_u // upc)
    lfw = 1  # slots a warp: the tiles its range touches (not EPI: a part of a tile each end at most)
    for b in (0, grid - 1):
        c0, cn = b * upc * U, (min(n_u, (b + 1) * upc) - b * upc) * U
        for wi in range(w):
            j0, j1 = c0 + cn * wi // w, c0 + cn * (wi + 1) // w
            if j1 > j0:
                lfw = max(lfw, (j1 - 1) // S - j0 // S + 1)
    if not epi:
        lfw = min(lfw, 2)
    if w * lfw * ng * 512 > CAU_MAX_SLOT_BYTES:
        return None
    return w, o, dict(CAU=1, LFW=lfw), upc, grid


#: kernel 3's CTA-local fix-up (``LFX``): at most this many units (tiles; EPI: gate / up pairs) a CTA's range
LFX_MAX_UNITS = 64


def _lfx_defines(Nt, S, grid, W, epi):
    """Defines of kernel 3's CTA-local fix-up (``LFX`` in the source) for a grid of ``grid`` CTAs of ``W`` warps
    over Nt x S (tile, segment) pairs, ranges as the kernel cuts them: ``LFU`` = the most units (tiles; EPI: gate /
    up pairs) a CTA's range touches (its shared counters), ``LFW`` = shared slots a warp (a part of a tile each: 2;
    EPI: the most tiles a warp's range touches); None where a CTA would touch more than LFX_MAX_UNITS units."""
    T, TW, U = Nt * S, grid * W, (2 if epi else 1) * S
    lfu, lfw = 1, 2
    for b in range(grid):
        c0, c1 = T * b * W // TW, T * (b * W + W) // TW
        if c1 > c0:
            lfu = max(lfu, (c1 - 1) // U - c0 // U + 1)
    if epi:
        for gw in range(TW):
            j0, j1 = T * gw // TW, T * (gw + 1) // TW
            if j1 > j0:
                lfw = max(lfw, (j1 - 1) // S - j0 // S + 1)
    return dict(LFX=1, LFU=lfu, LFW=lfw) if lfu <= LFX_MAX_UNITS else None


class _PlanCache(dict):
    """The per-process plan cache; clearing it (labs and tests that change a routing environment variable do)
    also drops :func:`fast_linear`'s prepared launchers, which hold plans."""

    def clear(self):
        super().clear()
        _PREPARED.clear()


_PLANS: dict = _PlanCache()


def _plan_cached(k, M, N, S, scale_format, config, bf16, dev, kind=0, epi=0):
    """:func:`plan` with its compiled kernel (``p["kern"]``), cached per process."""
    from kbit.cuda import compile_kernel
    
    key = (k, _ng(M), M, N, S, scale_format, config, bf16, dev, kind, epi, deterministic())
    p = _PLANS.get(key)
    if p is None:
        p = plan(k, M, N, S * SEG, scale_format, config, dev, pro=kind, epi=epi)
        p["kern"] = compile_kernel(*MMA_KERNELS[p["defines"]["KERNEL"]], {**p["defines"], "BF16": int(bf16)}, dev)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = p
    return p


#: the kernels' argument list (``kbit_gemv_mma``): pointers, then ints; ``_ARG_X`` / ``_ARG_Y``: x's and y's places
_ARGS_FMT = "QQQQQQQQQQiiiiiiiiii"
_ARG_X, _ARG_Y = 5, 6
_BIAS_KIND = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def _kernel_args(p, rcodes, rscales, tensor_scale, codebook, x_ptr, y_ptr, bias, ws, cnt, M, N, x_stride, y_stride):
    """The arguments of plan ``p``'s launch, in ``_ARGS_FMT`` order."""
    Nt = p["Nt"]
    return (rcodes.data_ptr(), rscales.data_ptr(), tensor_scale.data_ptr(), codebook.data_ptr(),
            _etab(rcodes.device).data_ptr(), x_ptr, y_ptr, bias.data_ptr() if bias is not None else 0,
            ws.data_ptr(), cnt.data_ptr(), M, N, x_stride, y_stride, p["S"], Nt, p["splits"], p["sps"],
            0 if bias is None else _BIAS_KIND[bias.dtype], Nt * 16)


def _launch(x2, rcodes, rscales, tensor_scale, codebook, bias, y, *, k, scale_format, N, K, M, Kp, config=None,
            pro=None, epi=0):
    """One launch; ``pro``: ``(kind, residual, residual_out, norm_weight, eps)`` of an x prologue; ``epi``: see
    :func:`plan`."""

    dev = x2.device
    kind = pro[0] if pro else 0
    p = _plan_cached(k, M, N, rcodes.shape[1], scale_format, config, x2.dtype == torch.bfloat16, dev, kind, epi)
    S = p["S"]
    x_stride = x2.stride(0)
    if p["defines"].get("XB"):
        bt = 8 * p["defines"]["NG"]
        x2 = _x_tiles(x2, bt, S)
        x_stride = S * 4  # 64-column chunks a token block
    elif p["defines"]["KERNEL"] in (6, 7):
        x2 = _permute_x(x2)
        x_stride = x2.stride(0)
    ws, cnt = _workspace(dev, p["ws_floats"], p["n_cnt"]) if p["use_ws"] else (y, y)
    fmt, extra = "", ()
    if kind:
        _, res, res_out, nw, eps = pro
        fmt, extra = "QQQfii", (res.data_ptr() if res is not None else 0,
                                res_out.data_ptr() if res_out is not None else 0,
                                nw.data_ptr(), float(eps), K, res.stride(0) if res is not None else 0)
    args = _kernel_args(p, rcodes, rscales, tensor_scale, codebook, x2.data_ptr(), y.data_ptr(), bias, ws, cnt, M,
                        N, x_stride, y.stride(0))
    p["kern"]((p["grid"],), p["W"] * 32, _ARGS_FMT + fmt, *args, *extra, shared=p["shared"], pdl=True)


_XT_KERNELS: dict = {}


def _x_tiles_kernel(name, device):
    """Kernel ``name`` of ``X_TILES_SOURCE`` (``kbit_x_tiles``, ``kbit_x_tiles_g``), compiled once a device:
    compile_kernel hashes the whole source on every call."""
    kern = _XT_KERNELS.get((name, device))
    if kern is None:
        from kbit.cuda import compile_kernel

        kern = _XT_KERNELS[(name, device)] = compile_kernel("x_tiles.cu", name, {}, device)
    return kern


def _x_tiles_groups(n_ch: int, bt: int) -> int:
    """The x gathers' grid y: 256-thread groups a token block (a thread copies 4 of the block's ``n_ch * bt * 8``
    16-byte pieces: ``XT_CPT`` of ``X_TILES_SOURCE``; ``n_ch`` is a multiple of 4)."""
    return -(-(n_ch // 4) * bt * 8 // 256)


def _x_tiles(x2, bt, S):
    """x ``[M, S * 256]`` (rows 16-byte aligned) as kernel 7's bulk-copy tiles: ``[ceil(M / bt), S * 4, bt, 64]``
    in the "mma-v1" K order, each ``[bt, 64]`` tile in wgmma's 128-byte swizzle, rows past M zero
    (``kbit_x_tiles``; :func:`_x_tiles_reference` is the torch definition)."""
    M = x2.shape[0]
    n_tb, n_ch = -(-M // bt), S * 4
    xt = torch.empty(n_tb * n_ch * bt * 64, dtype=x2.dtype, device=x2.device)
    kern = _x_tiles_kernel("kbit_x_tiles", x2.device)
    kern((n_tb, _x_tiles_groups(n_ch, bt)), 256, "QQiiii", x2.data_ptr(), xt.data_ptr(), M, x2.stride(0), n_ch, bt,
         pdl=True)
    return xt


def _x_tiles_reference(x2, bt, S):
    """The definition of :func:`_x_tiles` in torch."""
    M, Kw = x2.shape
    n_tb = -(-M // bt)
    xp = torch.zeros(n_tb * bt, Kw, dtype=x2.dtype, device=x2.device)
    xp[:M] = _permute_x(x2)
    t = xp.view(n_tb, bt, S * 4, 8, 8).permute(0, 2, 1, 3, 4)  # [tb, chunk, row, piece, 8]
    r = torch.arange(bt, device=x2.device).view(bt, 1) % 8
    src = torch.arange(8, device=x2.device).view(1, 8) ^ r  # piece at position c holds piece c ^ (r % 8)
    return t[:, :, torch.arange(bt, device=x2.device).view(bt, 1), src].reshape(-1)


def _prep_x(x2, S):
    """x rows readable as 16-byte vectors up to column S*256 (a zero-padded copy when needed)."""
    M, K = x2.shape
    Kw = S * SEG
    ok = (K == Kw and x2.stride(1) == 1 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0)
    if ok:
        return x2
    xp = torch.zeros(M, Kw, dtype=x2.dtype, device=x2.device)
    xp[:, :K] = x2
    return xp


def _check(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias):
    from kbit.ops.gemv import _check_dense

    _check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)


def linear_small_m(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                   bias=None, config=None):
    """``y = x @ W.T (+ bias)`` for a k-bit weight ``W[N, K]`` (canonical layout, repacked once and cached).

    x: fp16/bf16 ``[..., K]`` (any strides; leading dims flattened to M rows, M <= 64 a launch, more in
    chunks of 64); codes/scales/tensor_scale/codebook as in ``kbit.ops.gemv.gemv``; bias optional ``[N]``.
    Returns ``[..., N]`` in x's dtype. Accumulation in fp32 (tensor cores); the codebook is rounded to x's
    dtype. Falls back to the Triton GEMV where the CUDA kernel is unavailable.

    The cache (:func:`repacked`) keeps a repacked copy beside the canonical tensors for as long as they live:
    for weights held long (a model), hold them in layout "mma-v1" only and call :func:`linear_repacked`
    (``kbit.nn.KbitLinear.repack_for_kernels``).
    """
    _check(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    return _linear_small_m(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                           scale_format=scale_format, N=N, K=K, bias=bias, config=config)


def _linear_small_m(x, codes, scales, tensor_scale, codebook, *, k, blocksize, scale_format, N, K, bias=None,
                    config=None):
    """:func:`linear_small_m` on checked arguments (``kbit.ops.gemv.gemv`` checks them once)."""
    if not available(x.device):
        from kbit.ops.gemv import gemv

        return gemv(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                    N=N, K=K, bias=bias)
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], N)
    rc, rs = repacked(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
    if config is None and FAST_LINEAR and x.is_cuda:  # the launcher prepared for this signature, if any
        y = fast_linear(x, rc, rs, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                        N=N, K=K, bias=bias)
        if y is not None:
            return y
    return _run(x, rc, rs, tensor_scale, codebook, bias, k=k, blocksize=blocksize, scale_format=scale_format, N=N,
                K=K, config=config)


def _run(x, rc, rs, tensor_scale, codebook, bias, *, k, blocksize, scale_format, N, K, config):
    """Launch the kernel on repacked ``(rc, rs)``: M rows in chunks of MAX_M."""
    if bias is not None:
        bias = bias.contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    S = rc.shape[1]
    Kp = -(-K // blocksize) * blocksize
    if uses_large(M, N, K, x.device, config):
        xm = _prep_x(x2, S)
        _launch(xm, rc, rs, tensor_scale, codebook, bias, y, k=k, scale_format=scale_format, N=N, K=K, M=M, Kp=Kp,
                config=tuple(config or large_config(k, M, N, K)))
        return y.reshape(*lead, N)
    for m0 in range(0, M, MAX_M):
        xm = _prep_x(x2[m0:m0 + MAX_M], S)
        _launch(xm, rc, rs, tensor_scale, codebook, bias, y[m0:m0 + MAX_M], k=k, scale_format=scale_format, N=N,
                K=K, M=xm.shape[0], Kp=Kp, config=config)
    return y.reshape(*lead, N)


def _check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias, lead=()):
    from kbit.ops.gemv import _check_params, _check_tensor, _fail

    _check_params(k, blocksize, scale_format, N, K)
    _check_tensor("x", x, (torch.float16, torch.bfloat16, torch.float32))
    if x.dim() < 1 or x.shape[-1] != K:
        _fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    _, Nt, S = _geometry(N, K, blocksize)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    _check_tensor("rcodes", rcodes, (torch.int32,), (*lead, Nt, S, k, 32, 4), x.device)
    _check_tensor("rscales", rscales, (sdt,), (*lead, Nt, S, 8, 16), x.device)
    _check_tensor("tensor_scale", tensor_scale, (torch.float32,), lead, x.device)
    _check_tensor("codebook", codebook, (torch.float32,), (2**k,), x.device)
    if not (rcodes.is_contiguous() and rscales.is_contiguous()):
        _fail(ValueError, "rcodes, rscales", "contiguous tensors", (rcodes.stride(), rscales.stride()))
    if bias is not None:
        _check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (N,), x.device)


def linear_repacked(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                    bias=None, config=None):
    """:func:`linear_small_m` on a weight held in layout "mma-v1" (``rcodes, rscales`` from :func:`repack`):
    no cache, nothing kept. Where the CUDA kernel is unavailable: an unrepacked temporary and
    ``kbit.ops.gemv.gemv`` (fp16/bf16 x)."""
    _check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if not available(x.device):
        from kbit.ops.gemv import gemv

        codes, scales = unrepack(rcodes, rscales, k=k, blocksize=blocksize, N=N, K=K)
        return gemv(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                    N=N, K=K, bias=bias)
    return _run(x, rcodes, rscales, tensor_scale, codebook, bias, k=k, blocksize=blocksize,
                scale_format=scale_format, N=N, K=K, config=config)


def prepare_repacked(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                     bias=None):
    """A fast caller of :func:`linear_repacked` for inputs like ``x`` (same shape, strides, dtype, device; the
    weights' storage unchanged): checks the arguments once, packs the launch arguments once, and returns
    ``run(x) -> y`` (None from ``run`` where x's address is not 16-byte aligned: call :func:`linear_repacked`).
    None where the call is not one small-M launch with x read in place (CPU, kernel 7, M > MAX_M, x not
    contiguous or K not a multiple of 256). :func:`fast_linear` keeps one a signature (host cost a call at
    M = 1: ``benchmarks/results/h100/linear-overhead-s18.log``)."""
    from kbit.cuda.runtime import Prepared

    _check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if not (x.is_cuda and available(x.device) and serves(x, N, K, k)):
        return None
    M, S = x.numel() // K, rcodes.shape[1]
    if M > MAX_M or uses_large(M, N, K, x.device) or not x.is_contiguous() or K != S * SEG:
        return None
    if bias is not None and not bias.is_contiguous():
        return None
    dev, dtype, shape = x.device, x.dtype, (*x.shape[:-1], N)
    p = _plan_cached(k, M, N, S, scale_format, None, dtype == torch.bfloat16, dev)
    if p["defines"].get("XB") or p["defines"]["KERNEL"] in (6, 7):
        return None
    ws, cnt = _workspace(dev, max(p["ws_floats"], 1), p["n_cnt"])
    args = _kernel_args(p, rcodes, rscales, tensor_scale, codebook, 0, 0, bias, ws, cnt, M, N, K, N)
    prep = Prepared(p["kern"], (p["grid"],), p["W"] * 32, _ARGS_FMT, args, (_ARG_X, _ARG_Y), shared=p["shared"],
                    pdl=True)
    keep = (ws, cnt)  # alive for as long as the launch may use them (the e-table is cached per device for good)

    def run(x):
        xp = x.data_ptr()
        if xp & 15:
            return None
        y = torch.empty(shape, dtype=dtype, device=dev)
        prep.launch(xp, y.data_ptr())
        return y

    run.keep = keep
    return run


_PREPARED: dict = {}  # fast_linear's launchers by signature
#: ``fast_linear`` (the prepared launchers of :func:`linear_mma_v1` and ``KbitLinear``); ``KBIT_FAST_LINEAR=0``
#: (read at import) turns them off
FAST_LINEAR = os.environ.get("KBIT_FAST_LINEAR", "1") != "0"


def fast_linear(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize, scale_format, N, K, bias=None):
    """:func:`linear_repacked` through a launcher prepared once per signature (x's shape, strides, dtype and
    device, the weights' addresses and format, the deterministic mode; :func:`prepare_repacked`), or None where
    that does not apply (the caller takes the general path). The weights are read through their addresses at each
    launch, so tensors updated in place are seen; new tensors change the signature."""
    key = (x.shape, x.stride(), x.dtype, x.get_device(), rcodes.data_ptr(), rscales.data_ptr(),
           tensor_scale.data_ptr(), codebook.data_ptr(), 0 if bias is None else bias.data_ptr(),
           None if bias is None else bias.dtype, k, blocksize, scale_format, N, K, rcodes.shape, rscales.shape,
           deterministic())
    run = _PREPARED.get(key)
    if run is None:
        if torch.cuda.is_current_stream_capturing():  # building may allocate (workspace) and compile
            return None
        run = prepare_repacked(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                               scale_format=scale_format, N=N, K=K, bias=bias) or False
        if len(_PREPARED) >= 1024:
            _PREPARED.clear()
        _PREPARED[key] = run
    return run(x) if run else None


def serves(x: torch.Tensor, N: int, K: int, k: int) -> bool:
    """Whether ``kbit.ops.gemm.linear`` would run this call (``x [..., K]`` on a ``[N, K]`` k-bit weight) on the
    small-M kernel: CUDA with NVRTC (not ``KBIT_GEMV_BACKEND=triton``, not the Triton interpreter) and an M
    the dispatcher gives the GEMV (M <= ``kbit.tuning.dispatch.MMA_MAX_M``)."""
    from kbit.ops.gemv import _use_mma

    if not x.is_cuda or not K or not _use_mma(x):
        return False
    from kbit.ops.gemm import _choice

    M = x.numel() // K
    return M > 0 and _choice(M, N, K, k, x.device).kernel == "gemv"


_DEQ_KERNELS: dict = {}  # (k, scale_format, dtype, vec, device) -> (kernel, grid slots)


def dequant_repacked(rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                     dtype=torch.bfloat16, out=None):
    """``W [N, K]`` in ``dtype`` (float16 / bfloat16) from a weight in layout "mma-v1", in one kernel
    (``kbit_deq_mma``; bit-exact with ``kbit.ops.dequant`` of the canonical tensors) instead of :func:`unrepack`
    plus the canonical dequantize. ``out``: a contiguous ``[N, K]`` tensor of ``dtype`` to write into."""
    from kbit.cuda import compile_kernel
    from kbit.ops.gemv import _fail

    if dtype not in (torch.float16, torch.bfloat16):
        _fail(TypeError, "dtype", "torch.float16 or torch.bfloat16", dtype)
    probe = torch.empty(0, K, dtype=dtype, device=rcodes.device)
    _check_repacked(probe, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, None)
    if out is not None and (tuple(out.shape) != (N, K) or out.dtype != dtype or not out.is_contiguous()
                            or out.device != rcodes.device):
        _fail(ValueError, "out", f"a contiguous {dtype} tensor of shape {(N, K)} on {rcodes.device}",
              f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})")
    if not available(rcodes.device):
        _fail(ValueError, "rcodes", "tensors on a CUDA device where the kernel runs (sm_80+, NVRTC found); "
              "elsewhere use unrepack and kbit.ops.dequant", rcodes.device)
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=rcodes.device)
    _, Nt, S = _geometry(N, K, blocksize)
    if N == 0 or K == 0:
        return out
    dev = out.device
    vec = int(K % 8 == 0 and out.data_ptr() % 16 == 0)
    key = (k, scale_format, dtype, vec, dev)
    hit = _DEQ_KERNELS.get(key)
    if hit is None:
        kern = compile_kernel("dequant_mma.cu", "kbit_deq_mma", dict(K_BITS=k, FP16_SCALES=int(scale_format == "fp16"),
                                                               BF16=int(dtype == torch.bfloat16), VEC=vec), dev)
        hit = _DEQ_KERNELS[key] = (kern, _sms(dev) * kern.occupancy(256, _table_smem(k)))
    kern, slots = hit
    grid = max(1, min(slots, -(-(Nt * S) // 8)))
    kern((grid,), 256, "QQQQQQiiii", rcodes.data_ptr(), rscales.data_ptr(), tensor_scale.data_ptr(),
         codebook.data_ptr(), _etab(dev).data_ptr(), out.data_ptr(), N, K, S, Nt, shared=_table_smem(k))
    return out


def linear_mma_v1(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                  bias=None):
    """``kbit.ops.gemm.linear`` (any M) on a weight held in layout "mma-v1": the small-M kernel where the
    dispatcher picks it (:func:`serves`); where it picks dequantize + cuBLAS, :func:`dequant_repacked` then
    ``F.linear``; else an unrepacked temporary (:func:`unrepack`, freed after the call) through
    ``kbit.ops.gemm.linear`` (fused GEMM, Triton GEMV; the float32 reference on the CPU)."""
    if FAST_LINEAR and x.is_cuda:
        y = fast_linear(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                        scale_format=scale_format, N=N, K=K, bias=bias)
        if y is not None:
            return y
    if serves(x, N, K, k):
        return linear_repacked(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                               scale_format=scale_format, N=N, K=K, bias=bias)
    from kbit.ops.gemm import _choice, linear

    _check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and available(x.device)
            and _choice(x.numel() // K if K else 0, N, K, k, x.device).kernel == "dequant_mm"):
        w = dequant_repacked(rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                             scale_format=scale_format, N=N, K=K, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    codes, scales = unrepack(rcodes, rscales, k=k, blocksize=blocksize, N=N, K=K)
    return linear(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                  N=N, K=K, bias=bias)


@torch.library.custom_op("kbit::linear_small_m", mutates_args=())
def _linear_small_m_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                       codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_small_m(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                          scale_format=scale_format, N=N, K=K, bias=bias)


@_linear_small_m_op.register_fake
def _(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    return x.new_empty(*x.shape[:-1], N)


@torch.library.custom_op("kbit::linear_mma_v1", mutates_args=())
def _linear_mma_v1_op(x: torch.Tensor, rcodes: torch.Tensor, rscales: torch.Tensor, tensor_scale: torch.Tensor,
                      codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_mma_v1(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                         scale_format=scale_format, N=N, K=K, bias=bias)


@_linear_mma_v1_op.register_fake
def _(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    return x.new_empty(*x.shape[:-1], N)


def kbit_linear_small_m(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a 2-D ``KbitWeight`` through ``torch.ops.kbit.linear_small_m``."""
    return torch.ops.kbit.linear_small_m(x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                                         weight.k, weight.blocksize, weight.scale_format, weight.N, weight.K, bias)


# ------------------------------------------------------------------------------------------------ weights


class RepackedWeight:
    """A k-bit weight held in layout "mma-v1" only: ``W [N, K]`` (:func:`repack`) or a stack ``[E, N, K]``
    (``kbit.ops.grouped_mma.repack_stack``): ``codes`` int32 ``[(E,) Nt, S, k, 32, 4]``, ``scales``
    ``[(E,) Nt, S, 8, 16]``, ``tensor_scale`` float32 ``[(E)]``, ``codebook`` float32 ``[2**k]``, and the
    format parameters of ``kbit.format.KbitWeight``. :meth:`canonical` unrepacks (bit-exact, new tensors)."""

    layout = LAYOUT

    def __init__(self, codes, scales, tensor_scale, codebook, shape, k, blocksize, scale_format="log8",
                 codebook_name="custom"):
        self.codes, self.scales, self.tensor_scale, self.codebook = codes, scales, tensor_scale, codebook
        self.shape = tuple(int(v) for v in shape)
        self.k, self.blocksize, self.scale_format, self.codebook_name = k, blocksize, scale_format, codebook_name
        if len(self.shape) not in (2, 3):
            raise ValueError(f"shape: expected (N, K) or (E, N, K), got {self.shape}")
        _, Nt, S = _geometry(self.N, self.K, blocksize)
        lead = self.shape[:-2]
        if tuple(codes.shape) != (*lead, Nt, S, k, 32, 4) or tuple(scales.shape) != (*lead, Nt, S, 8, 16):
            raise ValueError(f"codes, scales: expected {(*lead, Nt, S, k, 32, 4)} and {(*lead, Nt, S, 8, 16)} "
                             f"(layout {LAYOUT} of {self.shape}), got {tuple(codes.shape)}, {tuple(scales.shape)}")

    @property
    def N(self) -> int:
        return self.shape[-2]

    @property
    def K(self) -> int:
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.tensor_scale, self.codebook))

    def _fmt(self) -> dict:
        return dict(k=self.k, blocksize=self.blocksize, N=self.N, K=self.K)

    @classmethod
    def from_canonical(cls, qw) -> RepackedWeight:
        """Repack a ``kbit.format.KbitWeight`` (2-D or a 3-D stack); its tensors are not changed."""
        kw = dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.N, K=qw.K)
        if len(qw.shape) == 2:
            rc, rs = repack(qw.codes, qw.scales, **kw)
        else:
            from kbit.ops.grouped_mma import repack_stack

            rc, rs = repack_stack(qw.codes, qw.scales, **kw)
        return cls(rc, rs, qw.tensor_scale, qw.codebook, qw.shape, qw.k, qw.blocksize, qw.scale_format,
                   qw.codebook_name)

    def canonical_tensors(self, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical ``(codes, scales)``, unrepacked (new tensors); of a stack: only ``experts`` (indices), if
        given."""
        if len(self.shape) == 2:
            return unrepack(self.codes, self.scales, **self._fmt())
        from kbit.ops.grouped_mma import unrepack_stack

        rc, rs = self.codes, self.scales
        if experts is not None:
            rc, rs = rc.index_select(0, experts), rs.index_select(0, experts)
        return unrepack_stack(rc, rs, **self._fmt())

    def canonical(self):
        """The weight as a ``kbit.format.KbitWeight`` (unrepacked codes and scales; tensor scales and codebook
        shared)."""
        from kbit.format.spec import KbitWeight

        codes, scales = self.canonical_tensors()
        return KbitWeight(codes, scales, self.tensor_scale, self.codebook, self.shape, self.k, self.blocksize,
                          self.scale_format, self.codebook_name)

    def __repr__(self) -> str:
        return (f"RepackedWeight(shape={self.shape}, k={self.k}, blocksize={self.blocksize}, "
                f"scale_format={self.scale_format!r}, layout={LAYOUT!r}, device={self.device})")


_ = math  # keep the import for callers that patch configs
