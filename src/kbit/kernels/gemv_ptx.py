"""Inline PTX of the Triton GEMV (``kbit.kernels.gemv``): the codebook lookup programs and the packed dot products,
as text the kernels take as constexpr arguments (``kbit.ops.gemv`` passes them). Pure Python, no kernels.
"""

# --------------------------------------------------------------------------------------------------------
# Inline PTX. Each lookup program turns one plane-0 word (+ the plane-1 bits of its codes, in ``h`` at bit 0)
# into packed half pairs. Operands: outputs first, then the word, [h,] then the byte tables.
# Table registers (see ``kbit.ops.gemv.lookup_table``): the low bytes of the 2**k half values, 4 a register,
# then the high bytes. prmt(a, b, sel) picks bytes of the 8-byte (a, b) by the nibbles of sel[15:0]; a
# nibble with bit 3 set replicates the sign of the picked byte (used to make byte masks).
# The same programs are emulated bit-exactly in tests/test_gemv.py.
# --------------------------------------------------------------------------------------------------------


def _ptx(lines, n_out, n_in, temps):
    body = "\n".join(lines)
    decl = ".reg .b32 " + ", ".join(temps) + ";" if temps else ""
    cons = ",".join(["=r"] * n_out + ["r"] * n_in)
    return "{\n" + decl + "\n" + body + "\n}", cons


def lookup_program(k):
    """The lookup as a list of (op, dst, *srcs) over named registers; inputs w, h, T0..; outputs o0..

    Pairs come out in natural column order for k = 4, 5 (o_p = columns 2p, 2p+1). For k = 2, 3 they come
    out as (c0, c2), (c1, c3), (c4, c6), (c5, c7), ... (the activation pairs are permuted to match).
    """
    p = []
    if k in (2, 3):
        # nibble i of se = code 2i (bits 0-1), of so = code 2i+1
        p += [("and", "se", "w", 0x33333333), ("shr", "so", "w", 2), ("and", "so", "so", 0x33333333)]
        if k == 3:
            # spread the 16 plane-1 bits: bit q -> bit 2q (odd code 2i+1 -> 4i+2, even code 2i -> 4i)
            p += [("and", "x", "h", 0xFFFF)]
            for sh, mask in ((8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333), (1, 0x55555555)):
                p += [("shl", "y", "x", sh), ("lop3", "x", "x", "y", mask, 0xA8)]  # (x | y) & mask
            p += [("shl", "y", "x", 2), ("lop3", "se", "se", "y", 0x44444444, 0xF8),  # se | (y & m)
                  ("lop3", "so", "so", "x", 0x44444444, 0xF8)]
        lo_a, lo_b, hi_a, hi_b = ("T0", "T1", "T1", "T0") if k == 2 else ("T0", "T1", "T2", "T3")
        for half in (0, 1):
            for src in ("se", "so"):
                s = src
                if half:
                    p += [("shr", "s2", src, 16)]
                    s = "s2"
                p += [("prmt", "lo", lo_a, lo_b, s), ("prmt", "hi", hi_a, hi_b, s)]
                o_even = 4 * half + (0 if src == "se" else 1)
                p += [("prmt", f"o{o_even}", "lo", "hi", 0x5140),
                      ("prmt", f"o{o_even + 2}", "lo", "hi", 0x7362)]
        return p
    # k = 4, 5: nibble i of w = low 4 bits of code i
    p += [("and", "sa", "w", 0x77777777), ("shl", "t", "w", 4)]
    nlo = 4 if k == 4 else 8  # table registers per byte plane
    for half in (0, 1):
        s = "sa"
        if half:
            p += [("shr", "sb", "sa", 16)]
            s = "sb"
        # m3: byte i = 0xFF where code (4 half + i) has bit 3 (msb of a byte of w or of w << 4)
        p += [("prmt", "m3", "t", "w", 0xFBEA if half else 0xD9C8)]
        if k == 5:
            # m4: bit 4 of code (4 half + i) sits at h bit (4 half + i); move it to bit 8i+7, replicate
            if half:
                p += [("shr", "q", "h", 4), ("and", "q", "q", 0xF)]
            else:
                p += [("and", "q", "h", 0xF)]
            p += [("mul", "q", "q", 0x10204080), ("prmt", "m4", "q", "q", 0xBA98)]
        for plane, base in (("lo", 0), ("hi", nlo)):
            regs = [f"T{base + i}" for i in range(nlo)]
            p += [("prmt", "u0", regs[0], regs[1], s), ("prmt", "u1", regs[2], regs[3], s),
                  ("lop3", "v0", "u0", "u1", "m3", 0xD8)]  # m3 ? u1 : u0
            if k == 5:
                p += [("prmt", "u0", regs[4], regs[5], s), ("prmt", "u1", regs[6], regs[7], s),
                      ("lop3", "v1", "u0", "u1", "m3", 0xD8), ("lop3", "v0", "v0", "v1", "m4", 0xD8)]
            p += [("mov", plane, "v0")]
        p += [("prmt", f"o{2 * half}", "lo", "hi", 0x5140), ("prmt", f"o{2 * half + 1}", "lo", "hi", 0x7362)]
    return p


def n_pairs(k):
    return 8 if k in (2, 3) else 4


def n_table_regs(k):
    return 2 ** (k - 1)


def lookup_asm(k):
    np_ = n_pairs(k)
    inputs = ["w"] + (["h"] if k in (3, 5) else []) + [f"T{i}" for i in range(n_table_regs(k))]
    # outputs go through temporaries, written last: an output register may alias an input
    names = {n: f"${np_ + i}" for i, n in enumerate(inputs)}
    temps = set()
    lines = []

    def r(x):
        if isinstance(x, int):
            return hex(x)
        if x not in names:
            temps.add(x)
        return names.get(x, x)

    for op, dst, *src in lookup_program(k):
        d = r(dst)
        if op == "and":
            lines.append(f"and.b32 {d}, {r(src[0])}, {r(src[1])};")
        elif op == "shr":
            lines.append(f"shr.u32 {d}, {r(src[0])}, {src[1]};")
        elif op == "shl":
            lines.append(f"shl.b32 {d}, {r(src[0])}, {src[1]};")
        elif op == "mul":
            lines.append(f"mul.lo.u32 {d}, {r(src[0])}, {r(src[1])};")
        elif op == "mov":
            lines.append(f"mov.b32 {d}, {r(src[0])};")
        elif op == "prmt":
            lines.append(f"prmt.b32 {d}, {r(src[0])}, {r(src[1])}, {r(src[2])};")
        elif op == "lop3":
            lines.append(f"lop3.b32 {d}, {r(src[0])}, {r(src[1])}, {r(src[2])}, {hex(src[3])};")
        else:  # pragma: no cover
            raise ValueError(op)
    lines += [f"mov.b32 ${i}, o{i};" for i in range(np_)]
    return _ptx(lines, np_, len(inputs), sorted(temps))


def dot_asm(np_, bf16):
    """sum_p v_p . x_p (packed pairs) in fp32: half2 FMA chains, 8 products a lane (fp16) or 4 (bf16)."""
    ty = "bf16x2" if bf16 else "f16x2"
    chain = 4 if bf16 else 8
    lines = ["mov.b32 z, 0x80008000;"]
    n_chains = (np_ + chain - 1) // chain
    for c in range(n_chains):
        acc = f"a{c}"
        for i, p in enumerate(range(c * chain, min(np_, (c + 1) * chain))):
            src = "z" if i == 0 else acc
            lines.append(f"fma.rn.{ty} {acc}, ${1 + p}, ${1 + np_ + p}, {src};")
    temps = ["z"] + [f"a{c}" for c in range(n_chains)] + ["l", "u", "s"]
    for c in range(n_chains):
        if bf16:
            lines += [f"shl.b32 l, a{c}, 16;", f"and.b32 u, a{c}, 0xffff0000;"]
        else:
            lines += ["{", ".reg .b16 l16, u16;", f"mov.b32 {{l16, u16}}, a{c};", "cvt.f32.f16 l, l16;",
                      "cvt.f32.f16 u, u16;", "}"]
        if c == 0:
            lines.append("add.f32 s, l, u;")
        else:
            lines += ["add.f32 s, s, l;", "add.f32 s, s, u;"]
    lines.append("mov.b32 $0, s;")
    body = "\n".join(lines)
    return "{\n.reg .b32 " + ", ".join(temps) + ";\n" + body + "\n}", ",".join(["=r"] + ["r"] * (2 * np_))


# Precomputed asm text per (k, dtype): constexpr strings for the jit code.
_LOOKUP = {k: lookup_asm(k) for k in (2, 3, 4, 5)}
_DOT = {(np_, bf): dot_asm(np_, bf) for np_ in (4, 8) for bf in (False, True)}
LOOKUP_ASM = {k: v[0] for k, v in _LOOKUP.items()}
LOOKUP_CONS = {k: v[1] for k, v in _LOOKUP.items()}
DOT_ASM = {k: v[0] for k, v in _DOT.items()}
DOT_CONS = {k: v[1] for k, v in _DOT.items()}
