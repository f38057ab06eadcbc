"""GPU lab: one token's MoE pairs as one dense GEMV (``kbit.ops.gemv_mma.pairs_linear``), its kernel-3 config as
dispatched (the dense table's pick for the stacked ``[P N, K]`` shape) against pinned kernel-3 configs.

    PYTHONUNBUFFERED=1 python lab/moe_pairs_cfg_lab.py [--models ...] [--k 4] [--budget S] [--out DIR]

Why: the dense pick was tuned for a launch that loads its first weights before its PDL wait; the pairs' launch
cannot (its experts are known only after the wait), so its best ring depth, warps and CTAs an SM may differ.
Cold L2 (stack copies > 8x L2), CUDA graphs (``kbit.bench.timing.time_calls``). Each config's output is checked
against the grouped kernels' (relative error). Writes ``moe_pairs_cfg.json`` under ``--out``; prints a table last.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "lab"))

import torch  # noqa: E402
from moe_t1_lab import gemms, parse_args, stack  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv_mma as GM  # noqa: E402
from kbit.ops import grouped_mma as GR  # noqa: E402
from kbit.ops import moe_blocks as MB  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402

PINNED = {f"w{w} b{b} r{r}{' xg' if not xs else ''}": MmaConfig(3, w, b, ring=r, x_smem=xs)
          for w, b in ((4, 4), (8, 2), (8, 1), (16, 1)) for r in (2, 3, 4) for xs in (True,)}


def main():
    a = parse_args(300)
    out = Path(a.out)
    k, rows_out = a.k, []
    real_launch_config = GM.launch_config
    for name, gemm, E, top, N, K, one in gemms(a):
        stacks = [stack(E, N, K, k, seed=i) for i in range(copies_for_cold_l2(int(one * E), l2_bytes()))]
        ids = torch.randperm(E, device="cuda")[:top].to(torch.int32)
        xr = 1 if gemm == "gate_up" else top
        x = torch.randn(xr, K, device="cuda").bfloat16()
        rows = (torch.zeros if gemm == "gate_up" else lambda n, **kw: torch.arange(n, **kw))(
            top, dtype=torch.int32, device="cuda")
        kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, blocks=MB.block_table(ids, 8), checked=True)
        ref = GR.grouped_linear(x, rows, ids, *stacks[0], **kw).double()
        reps = [GR.repacked_stack(c, sc, k=k, blocksize=32, scale_format="log8", N=N, K=K)
                for c, sc, _, _ in stacks]
        pk = dict(k=k, scale_format="log8", N=N, K=K)
        r = dict(model=name, gemm=gemm, N=N, K=K, P=top, mb=top * one / 1e6,
                 config=repr(real_launch_config(k, 1, top * N, K, "cuda")))
        for vname, cfg in [("dispatched", None), *PINNED.items()]:
            GM._PAIRS.clear()
            GM.launch_config = real_launch_config if cfg is None else (lambda *a_, c=cfg: c)
            try:
                y = GM.pairs_linear(x, rows, ids, *reps[0], *stacks[0][2:], **pk)
                if y is None:
                    r[vname] = "not applicable"
                    continue
                err = ((y.double() - ref).norm() / ref.norm()).item()
                t = time_calls([(lambda rp=rp, s=s, x=x, rows=rows, ids=ids, pk=pk:
                                 GM.pairs_linear(x, rows, ids, *rp, *s[2:], **pk))
                                for rp, s in zip(reps, stacks, strict=True)])
                r[vname] = (t.us, top * one / t.us / 1e6, err)
            except Exception as ex:  # noqa: BLE001
                r[vname] = repr(ex)[:200]
            finally:
                GM.launch_config = real_launch_config
                GM._PAIRS.clear()
        del stacks, reps
        torch.cuda.empty_cache()
        rows_out.append(r)
        timed = {n: v for n, v in r.items() if isinstance(v, tuple)}
        best = min(timed, key=lambda n: timed[n][0]) if timed else None
        print(name, gemm, r["config"], {n: f"{v[0]:.2f}us {v[2]:.0e}" for n, v in timed.items()},
              "best", best, flush=True)
        (out / "moe_pairs_cfg.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), commit=os.environ.get("KBIT_COMMIT", "?"), rows=rows_out),
            indent=1))
    print("\n| model | gemm | MB | dispatched us | best pinned | us | x |")
    for r in rows_out:
        timed = {n: v for n, v in r.items() if isinstance(v, tuple) and n != "dispatched"}
        d = r.get("dispatched")
        if not timed or not isinstance(d, tuple):
            print(f"| {r['model']} | {r['gemm']} | {r['mb']:.1f} | {d} | - | - | - |")
            continue
        b = min(timed, key=lambda n: timed[n][0])
        print(f"| {r['model']} | {r['gemm']} | {r['mb']:.1f} | {d[0]:.2f} | {b} | {timed[b][0]:.2f} | "
              f"{d[0] / timed[b][0]:.3f} |")


if __name__ == "__main__":
    main()
