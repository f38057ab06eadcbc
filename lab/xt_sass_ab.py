"""The ``XT`` change (x read in place where K is not a multiple of 256) on the CPU: each kernel's build without XT
against the same build of git revision REV (opcode sequences, constant-bank operands normalised: the new ``kx``
argument moves the prologue arguments' offsets), and the XT builds' extra instructions. Needs NVRTC only, no GPU::

    python lab/xt_sass_ab.py --nvrtc /path/to/libnvrtc.so.12 --ref REV
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_count as SC  # noqa: E402

#: (file, defines) of builds the plans make (kernel 1 at M = 1, kernel 3 with / without x in shared memory, with the
#: prologue and the SiLU epilogue, kernel 4 at M = 16 and 64)
BUILDS = [
    ("gemv_mma_split.cu", dict(K_BITS=4, NG=1, D=1, MAXW=8, MINB=2, M1=1, BF16=1, FP16_SCALES=0)),
    ("gemv_mma_split.cu", dict(K_BITS=2, NG=1, D=1, MAXW=8, MINB=2, M1=1, BF16=1, FP16_SCALES=0)),
    ("gemv_mma_streamk.cu", dict(K_BITS=4, NG=1, D=1, MAXW=8, MINB=2, PD=2, XS=1, M1=1, BF16=1, FP16_SCALES=0)),
    ("gemv_mma_streamk.cu", dict(K_BITS=5, NG=2, D=1, MAXW=8, MINB=2, PD=2, XS=0, BF16=1, FP16_SCALES=0)),
    ("gemv_mma_streamk.cu", dict(K_BITS=3, NG=2, D=1, MAXW=8, MINB=2, PD=2, XS=1, XK=4, BF16=1, FP16_SCALES=0)),
    ("gemv_mma_streamk.cu", dict(K_BITS=4, NG=1, D=1, MAXW=8, MINB=2, PD=2, XS=1, PRO=2, EPI=1, BF16=1, FP16_SCALES=0)),
    ("mma_pipe.cu", dict(K_BITS=4, NG=2, D=4, MAXW=8, MINB=1, RT=1, BF16=1, FP16_SCALES=0)),
    ("mma_pipe.cu", dict(K_BITS=2, NG=8, D=3, MAXW=8, MINB=1, RT=1, BF16=1, FP16_SCALES=0)),
]


def opcodes(sass: str) -> list[str]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            out.append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[..]", m.group(1)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--nvrtc", required=True)
    p.add_argument("--ref", required=True, help="git revision before the change")
    a = p.parse_args(argv)
    from kbit import options
    options.set_options(nvrtc_lib=a.nvrtc, cache_dir=None)
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print("| file | defines | same as ref without XT | instructions ref / new / XT | regs ref / new / XT |")
    print("|---|---|---|--:|--:|")
    for file, d in BUILDS:
        old, (r0, _) = SC.sass_of(a.ref, file, d, cuobjdump)
        new, (r1, _) = SC.sass_of(None, file, d, cuobjdump)
        xt, (r2, _) = SC.sass_of(None, file, {**d, "XT": 1}, cuobjdump)
        o, n, x = opcodes(old), opcodes(new), opcodes(xt)
        same = o == n
        ds = ",".join(f"{k}={v}" for k, v in d.items() if k not in ("D", "BF16"))
        print(f"| {file} | {ds} | {'yes' if same else 'NO'} | {len(o)} / {len(n)} / {len(x)} | {r0} / {r1} / {r2} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
