"""Which kernel builds read data of the launch before above their PDL wait (CPU, NVRTC only).

For each define set of ``lab/cuda_sass_ab.py`` (the builds kbit.ops makes), ``tests/pdl_scan.py``'s analysis:
the kernel parameters a load of which ptxas moved above ``griddepcontrol.wait`` (weights excepted)::

    python lab/pdl_hoist_scan.py [--nvrtc /path/to/libnvrtc.so.12] [--quick] [--files grouped_mma.cu ...] \\
        [--csrc DIR]

Exit status 1 if any build has one. 2026-11-29, NVRTC 12.9: at 6d3e649 47 of 297 builds (the block count of the
grouped kernels 4 and 7), at 690fe73 none (``benchmarks/results/cpu/pdl-scan-2026-11-29/``).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", default=None, help="libnvrtc.so (default: torch's)")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--files", nargs="*", default=None)
    ap.add_argument("--csrc", default=None,
                    help="another tree's kbit/cuda/csrc folder (default: this checkout's; the define sets and the "
                         "analysis stay this checkout's)")
    a = ap.parse_args(argv)
    sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "lab")]
    from kbit import options

    options.set_options(nvrtc_lib=a.nvrtc, cache_dir=None)
    import cuda_sass_ab

    import pdl_scan

    bad = total = 0
    for file, names, defines in cuda_sass_ab.cases(a.quick):
        if a.files and file not in a.files:
            continue
        for name, params in pdl_scan.hoisted(file, names, defines, a.cuobjdump, a.csrc).items():
            total += 1
            if params:
                bad += 1
                print(f"HOISTED {file} {name}: params {params} {sorted(defines.items())}")
    print(f"{total} builds with a PDL wait, {bad} with a load of the launch before moved above it")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
