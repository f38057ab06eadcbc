"""Layout "mma-v1": the k-bit weight as the swap-AB tensor-core kernels read it (``kbit.ops.gemv_mma``,
``kbit.ops.grouped_mma``), made from the canonical layout of ``docs/format.md`` by :func:`repack`; :func:`unrepack`
is its inverse (bit-exact). Plain torch, deterministic, on the tensors' device.

The weight is the A operand of ``mma.sync.m16n8k16`` (16 rows x 16 columns) and a lane's registers must hold its
rows and columns in the order the instruction wants them, so codes are regrouped per (16-row tile, 256-column
segment) and lane. Layout "mma-v1" of one matrix ``[N, K]`` (Nt = ceil(N / 16) row tiles, S = ceil(Kp / 256) segments):

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

import torch

from kbit.format.pack import PLANES
from kbit.format.spec import KbitWeight
from kbit.utils.cache import TensorCache

__all__ = ["LAYOUT", "SEG", "RepackedWeight", "geometry", "repack", "repack_stack", "repacked", "unrepack",
           "unrepack_stack"]

#: the layout's name (``kbit.nn.KbitLinear.layout`` holds it once repacked)
LAYOUT = "mma-v1"
#: columns a segment
SEG = 256


def geometry(N: int, K: int, blocksize: int) -> tuple[int, int, int]:
    """(Kp, row tiles Nt, segments S) of an ``[N, K]`` weight."""
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
    Kp, Nt, S = geometry(N, K, blocksize)
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
    Kp, Nt, S = geometry(N, K, blocksize)
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



_REPACKED = TensorCache(max_entries=None)  # one copy per live canonical weight (see repacked)


def repacked(codes: torch.Tensor, scales: torch.Tensor, *, k: int, blocksize: int, scale_format: str, N: int,
             K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`repack`, cached per ``(codes, scales)`` (objects and versions, held weakly): the small-M kernels take
    canonical weights too, at the cost of a second copy for as long as the canonical tensors live."""
    fmt = (k, blocksize, scale_format, N, K)
    val = _REPACKED.get((codes, scales), fmt)
    if val is None:
        val = _REPACKED.put((codes, scales), fmt,
                            repack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K))
    return val


def repack_stack(codes: torch.Tensor, scales: torch.Tensor, *, k: int, blocksize: int, scale_format: str, N: int,
                 K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical stack ``(codes [E, N, words], scales [E, N, nb])`` -> ``(codes [E, Nt, S, k, 32, 4],
    scales [E, Nt, S, 8, 16 (x2 for fp16 bytes)])``: expert ``e`` is :func:`repack` of its matrix.

    With ``N % 16 == 0`` (tiles never straddle two experts) the stack is repacked as one ``[E * N, K]`` matrix.
    """
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[:2] != scales.shape[:2] or codes.shape[1] != N:
        raise ValueError(f"codes, scales: expected stacks [E, {N}, ...], got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    E = codes.shape[0]
    kw = dict(k=k, blocksize=blocksize, scale_format=scale_format, K=K)
    if N % 16 == 0:
        rc, rs = repack(codes.reshape(E * N, -1), scales.reshape(E * N, -1), N=E * N, **kw)
        return rc.view(E, N // 16, *rc.shape[1:]), rs.view(E, N // 16, *rs.shape[1:])
    parts = [repack(codes[e], scales[e], N=N, **kw) for e in range(E)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def unrepack_stack(rcodes: torch.Tensor, rscales: torch.Tensor, *, k: int, blocksize: int, N: int,
                   K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_stack` (bit-exact, new tensors): canonical ``(codes [E, N, words], scales [E, N,
    nb])``."""
    E = rcodes.shape[0]
    if E == 0:
        Kp = -(-K // blocksize) * blocksize
        return (torch.empty(0, N, Kp * k // 32, dtype=torch.int32, device=rcodes.device),
                torch.empty(0, N, Kp // blocksize, dtype=rscales.dtype, device=rscales.device))
    if N % 16 == 0:
        c, s = unrepack(rcodes.reshape(E * rcodes.shape[1], *rcodes.shape[2:]),
                        rscales.reshape(E * rscales.shape[1], *rscales.shape[2:]), k=k, blocksize=blocksize,
                        N=E * N, K=K)
        return c.view(E, N, -1), s.view(E, N, -1)
    parts = [unrepack(rcodes[e], rscales[e], k=k, blocksize=blocksize, N=N, K=K) for e in range(E)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


class RepackedWeight:
    """A k-bit weight held in layout "mma-v1" only: ``W [N, K]`` (:func:`repack`) or a stack ``[E, N, K]``
    (:func:`repack_stack`): ``codes`` int32 ``[(E,) Nt, S, k, 32, 4]``, ``scales``
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
        _, Nt, S = geometry(self.N, self.K, blocksize)
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
            rc, rs = repack_stack(qw.codes, qw.scales, **kw)
        return cls(rc, rs, qw.tensor_scale, qw.codebook, qw.shape, qw.k, qw.blocksize, qw.scale_format,
                   qw.codebook_name)

    def canonical_tensors(self, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical ``(codes, scales)``, unrepacked (new tensors); of a stack: only ``experts`` (indices), if
        given."""
        if len(self.shape) == 2:
            return unrepack(self.codes, self.scales, **self._fmt())
        rc, rs = self.codes, self.scales
        if experts is not None:
            rc, rs = rc.index_select(0, experts), rs.index_select(0, experts)
        return unrepack_stack(rc, rs, **self._fmt())

    def canonical(self):
        """The weight as a ``kbit.format.KbitWeight`` (unrepacked codes and scales; tensor scales and codebook
        shared)."""
        codes, scales = self.canonical_tensors()
        return KbitWeight(codes, scales, self.tensor_scale, self.codebook, self.shape, self.k, self.blocksize,
                          self.scale_format, self.codebook_name)

    def __repr__(self) -> str:
        return (f"RepackedWeight(shape={self.shape}, k={self.k}, blocksize={self.blocksize}, "
                f"scale_format={self.scale_format!r}, layout={LAYOUT!r}, device={self.device})")

