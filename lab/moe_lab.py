"""GPU lab for the grouped (MoE) tensor-core kernels of ``kbit.ops.grouped_mma``: kernel 1 (``kbit_grouped_mma``)
against kernel 4 (``kbit_grouped_mma4``), one expert GEMM at a time, next to bf16 ``torch._grouped_mm`` on the same
routing (x rows gathered, as a layer does), in one call.

    PYTHONUNBUFFERED=1 python lab/moe_lab.py [--models ...] [--tokens 16,64,256,1024] [--kernels 1,4]

Correctness first (float64 reference on small stacks: every k, both dtypes, fp16 scales, ragged expert runs),
then cold-L2 CUDA-graph timings (``kbit.bench.timing.time_calls``). Writes ``moe_lab.json`` / ``moe_lab.log``
under ``$OUT``; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import grouped_mma as GM  # noqa: E402
from kbit.ops.gemv import grouped_gemv_reference  # noqa: E402

MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-next": (512, 10, 2048, 512), "mixtral-8x7b": (8, 2, 4096, 14336)}
LOG = []


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    LOG.append(s)


def stack(E, N, K, k, sf="log8", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Kp = -(-K // 32) * 32
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, Kp * k // 32), generator=g, dtype=torch.int32, device="cuda")
    if sf == "log8":
        scales = torch.randint(0, 64, (E, N, Kp // 32), generator=g, dtype=torch.uint8, device="cuda")
    else:
        scales = (torch.rand(E, N, Kp // 32, generator=g, device="cuda") + 0.05).half()
    ts = torch.rand(E, generator=g, device="cuda") + 0.5 if sf == "log8" else torch.ones(E, device="cuda")  # format
    cb = torch.sort(torch.rand(2**k, generator=g, device="cuda") * 2 - 1).values
    return codes, scales, ts, cb


def weight_copies(E, N, K, k):
    """k-bit stacks and bf16 ``[E, K, N]`` views, each as enough copies for a cold L2 (within ~12 / 20 GB)."""
    nbytes = E * N * K * k // 8
    ws = [stack(E, N, K, k, seed=i) for i in range(max(1, min(copies_for_cold_l2(nbytes, l2_bytes()),
                                                                int(12e9 // max(nbytes, 1)))))]
    wb = [torch.randn(E, N, K, dtype=torch.bfloat16, device="cuda").transpose(-2, -1) for _ in
          range(max(1, min(copies_for_cold_l2(2 * E * N * K, l2_bytes()), int(20e9 // (2 * E * N * K)))))]
    return ws, wb


def routing(T, E, top, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, generator=g, device="cuda")
    eid = logits.topk(top, dim=1).indices.reshape(-1)
    tok = torch.arange(T, device="cuda").repeat_interleave(top)
    order = torch.sort(eid, stable=True).indices
    eids = eid[order].to(torch.int32)
    rows = tok[order].to(torch.int32)
    offs = torch.cumsum(torch.bincount(eids, minlength=E), 0).to(torch.int32)
    return rows, eids, offs


def set_kernel(kern):
    """``"1"`` / ``"4"``: that grouped kernel (the sm_90 kernel 7 off); ``"7"`` the grouped kernel 7 at every
    T (its default config for the step), ``"7:7.12.16.4.8.1.2"`` with that config."""
    kern = str(kern)
    for v in ("KBIT_GROUPED_KERNEL", "KBIT_GROUPED_LARGE_CFG"):
        os.environ.pop(v, None)
    if kern.startswith("7"):
        os.environ["KBIT_GROUPED_LARGE"] = "1"
        GM.LARGE_MIN_ROWS = 0
        if ":" in kern:
            os.environ["KBIT_GROUPED_LARGE_CFG"] = kern.split(":")[1].replace(".", ",")
    else:
        os.environ["KBIT_GROUPED_LARGE"] = "0"
        os.environ["KBIT_GROUPED_KERNEL"] = kern


def check_x_tiles():
    fails = []
    for (E, T, top, K, bt) in ((16, 40, 4, 512, 64), (8, 300, 2, 768, 128), (4, 700, 2, 256, 256)):
        rows, eids, _ = routing(T, E, top)
        x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
        blk, nblk = GM.block_table(eids, bt)
        P = rows.shape[0]
        n_max = GM.max_blocks(P, E, bt)
        S = K // 256
        nb = int(nblk.item())
        a = GM._x_tiles_grouped(x, rows, blk, nblk, n_max, bt, S).view(n_max, S * 4, bt, 64)[:nb]
        b = GM._x_tiles_grouped_reference(x, rows, blk, nblk, n_max, bt, S).view(n_max, S * 4, bt, 64)[:nb]
        ok = torch.equal(a, b)
        log(f"check x tiles grouped E={E} T={T} K={K} bt={bt}: {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append(("x_tiles_g", E, T, K, bt))
    return fails


def correctness(kernels=(4,)):
    fails, n = check_x_tiles() if any(str(v).startswith("7") for v in kernels) else [], 0
    for kern in kernels:
        set_kernel(kern)
        for k in (2, 3, 4, 5):
            for dt in (torch.float16, torch.bfloat16):
                for sf in ("log8", "fp16"):
                    for (E, T, top, N, K) in ((16, 40, 4, 384, 512), (8, 7, 2, 200, 768), (4, 100, 2, 64, 256),
                                              (8, 600, 2, 1000, 1100)):
                        w = stack(E, N, K, k, sf, seed=n)
                        rows, eids, _ = routing(T, E, top, seed=n)
                        x = torch.randn(T, K, dtype=dt, device="cuda")
                        kw = dict(k=k, blocksize=32, scale_format=sf, N=N, K=K)
                        y = GM.grouped_linear(x, rows, eids, *w, **kw, sorted_rows=True)
                        ref = grouped_gemv_reference(x, rows, eids, *w, **kw)
                        e = ((y.double() - ref).norm() / ref.norm()).item()
                        ok = e < (3e-3 if dt == torch.float16 else 1.5e-2)
                        n += 1
                        if not ok or n % 16 == 0:
                            log(f"check kern={kern} k={k} {dt} {sf} E={E} T={T} N={N} K={K}: {e:.2e} "
                                f"{'ok' if ok else 'FAIL'}")
                        if not ok:
                            fails.append((kern, k, str(dt), sf, E, T, N, K, e))
    log(f"correctness: {n} cases, {len(fails)} failures")
    return fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="16,64,256,1024")
    ap.add_argument("--kernels", default="1,4")
    ap.add_argument("--check", default="4", help="kernels to check (set_kernel's names)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    fails = correctness(a.check.split(",") if a.check else ())
    rows_out = []

    def dump():
        (out / "moe_lab.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                          commit=os.environ.get("KBIT_COMMIT", "?"), fails=fails,
                                                          rows=rows_out), indent=1))
        (out / "moe_lab.log").write_text("\n".join(LOG))

    dump()
    k = a.k
    for name in a.models.split(","):
        E, top, H, I = MODELS[name]
        for which, (N, K) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            ws, wb = weight_copies(E, N, K, k)
            for T in [int(v) for v in a.tokens.split(",")]:
                if time.time() - t0 > a.budget:
                    log("budget reached")
                    break
                rows, eids, offs = routing(T, E, top)
                x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
                r = dict(model=name, gemm=which, T=T, N=N, K=K, E=E)
                bf = time_calls([(lambda w=w, x=x, rows=rows, offs=offs:
                                  torch._grouped_mm(x.index_select(0, rows), w, offs=offs)) for w in wb])
                r["bf16_us"] = bf.us
                outs = {}
                for kern in a.kernels.split(","):
                    if kern == "xt":  # the grouped x gather of kernel 7 alone
                        set_kernel("7")
                        bt = GM._large_rows(rows.shape[0], E, "cuda")
                        blk, nblk = GM.block_table(eids, bt)
                        P, S = rows.shape[0], -(-K // 256)
                        xp = GM._prep_x(x, S)
                        n_max = GM.max_blocks(P, E, bt)
                        args = (xp, rows, blk, nblk, n_max, bt, S)
                        r["kxt_us"] = time_calls([lambda args=args: GM._x_tiles_grouped(*args)]).us
                        continue
                    set_kernel(kern)
                    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, sorted_rows=True)
                    try:
                        outs[kern] = GM.grouped_linear(x, rows, eids, *ws[0], **kw)
                        t = time_calls([(lambda w=w, x=x, rows=rows, eids=eids, kw=kw:
                                         GM.grouped_linear(x, rows, eids, *w, **kw)) for w in ws])
                        r[f"k{kern}_us"] = t.us
                    except Exception as ex:  # noqa: BLE001
                        log(f"  kernel {kern} failed: {repr(ex)[:300]}")
                if len(outs) >= 2:
                    a1, a4 = list(outs.values())[:2]
                    r["k1_vs_k4"] = ((a1.double() - a4.double()).norm() / a4.double().norm()).item()
                rows_out.append(r)
                log(f"{name} {which} T={T} bf16 {bf.us:.1f} " + " ".join(
                    f"{kk}={v:.1f}({bf.us / v:.2f}x)" for kk, v in r.items()
                    if kk.startswith("k") and kk.endswith("_us"))
                    + (f" diff {r.get('k1_vs_k4', 0):.1e}"))
                dump()
            del ws, wb
            torch.cuda.empty_cache()
    log(f"\ncorrectness failures: {len(fails)}")
    log("| model | gemm | T | bf16 us | " + " | ".join(f"kernel {v}" for v in a.kernels.split(",")) + " |")
    for r in rows_out:
        log(f"| {r['model']} | {r['gemm']} | {r['T']} | {r['bf16_us']:.1f} | " + " | ".join(
            (f"{r[f'k{v}_us']:.1f} ({r['bf16_us'] / r[f'k{v}_us']:.2f}x)" if f"k{v}_us" in r else "-")
            for v in a.kernels.split(",")) + " |")
    dump()


if __name__ == "__main__":
    main()
