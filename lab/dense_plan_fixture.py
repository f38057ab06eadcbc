"""Record the dense launch choices of the tree on PYTHONPATH into tests/data/dense_plans.json (CPU only).

Written against commit 64014d4 (before the dense restructuring of issue 31) and run there once; the CPU test
tests/test_dense_plans.py asserts that the restructured code reproduces every entry. It fakes the device facts
(compute capability, SM count, device name) and the NVRTC compiler: the fake kernel's occupancy is
:func:`fake_occupancy` (the same function is in the test), so the plan logic runs end to end without a GPU.

Usage (from a checkout of the old tree): ``PYTHONPATH=src python lab/dense_plan_fixture.py out.json``.
"""

from __future__ import annotations

import json
import sys
import types

import torch

KS = (2, 3, 4, 5)
MS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 200, 256, 257,
      300, 511, 512, 1000, 1024, 2048, 2049, 3000, 4096)
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (28672, 4096), (6144, 4096), (1024, 4096), (57344, 8192),
          (8192, 28672), (8192, 8192), (10240, 5120), (5120, 2048), (12288, 4096), (7168, 5120), (7168, 4096),
          (10240, 4096), (2048, 2048), (896, 896), (151936, 896), (4608, 3072), (3072, 8192), (24576, 3072),
          (100, 300), (1000, 1000), (17, 33), (4100, 4096), (30000, 4096), (16384, 2048), (4224, 4096),
          (16383, 1024), (20000, 6000))
#: (name, capability, SM count, device name)
DEVICES = (("h100", (9, 0), 132, "NVIDIA H100 80GB HBM3"), ("h100pcie", (9, 0), 114, "NVIDIA H100 PCIe"),
           ("h20", (9, 0), 78, "NVIDIA H20"), ("a100", (8, 0), 108, "NVIDIA A100-SXM4-80GB"),
           ("l40s", (8, 9), 142, "NVIDIA L40S"))
#: M values whose small-M plans are recorded with every scale format / deterministic mode
PLAN_MS = (1, 2, 4, 8, 9, 16, 17, 32, 33, 64, 65, 128, 256, 512, 2048, 4096)


def fake_occupancy(defines: dict, threads: int, shared: int) -> int:
    """CTAs an SM of a fake build: its MINB (launch bounds), limited by threads and shared memory."""
    return max(1, min(max(1, defines.get("MINB", 1)), 2048 // threads, (228 * 1024) // (shared + 1024)))


class FakeKernel:
    def __init__(self, file, name, defines):
        self.file, self.name, self.defines = file, name, dict(defines)
        self.num_regs = 64

    def occupancy(self, threads, shared):
        return fake_occupancy(self.defines, threads, shared)


def install_fakes(dev_facts):
    """Patch torch.cuda's device queries to answer ``dev_facts`` = (name, capability, sms, device name)."""
    _, cap, sms, name = dev_facts
    torch.cuda.get_device_capability = lambda device=None: cap
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=sms,
                                                                               name=name)


def enc(d: dict) -> str:
    return ",".join(f"{k}={d[k]}" for k in sorted(d))


class Palette:
    """Distinct strings once (the file stays small): entries hold indices into ``strings``."""

    def __init__(self):
        self.strings, self.index = [], {}

    def __call__(self, s) -> int:
        s = s if isinstance(s, str) else json.dumps(s, sort_keys=True, separators=(",", ":"))
        if s not in self.index:
            self.index[s] = len(self.strings)
            self.strings.append(s)
        return self.index[s]


def main(out):
    import kbit.cuda
    from kbit.ops import gemm, gemv_mma
    from kbit.ops import prologue as P
    from kbit.tuning import dispatch as D
    from kbit.tuning import gemv as G

    compiled = []

    def compile_kernel(file, name, defines, device):
        compiled.append((file, name))
        return FakeKernel(file, name, defines)

    kbit.cuda.compile_kernel = compile_kernel
    pal = Palette()
    rec = {"ms": MS, "default_config": {}, "large_config": {}, "plan": {}, "route": {}, "gemv_config": {},
           "choose": {}, "fused_config": {}, "large_serves": {}}
    for k in KS:
        for N, K in SHAPES:
            rec["large_config"][f"{k},{N},{K}"] = [pal(list(gemv_mma.large_config(k, M, N, K))) for M in MS]
            rec["large_serves"][f"{N},{K}"] = [int(gemv_mma.large_serves(M, N, K)) for M in MS]
            for sm90 in (False, True):
                for sms in (None, 132, 114, 78, 108):
                    rec["default_config"][f"{k},{N},{K},{int(sm90)},{sms}"] = [
                        pal(list(gemv_mma.default_config(k, M, N, K, sm90=sm90, sms=sms))) for M in MS]
            rec["fused_config"][f"{k},{N},{K}"] = [
                pal((lambda c: None if c is None else list(c))(P.fused_config(k, M, N, K))) for M in MS]
            rec["gemv_config"][f"{k},{N},{K},generic"] = [pal(G.gemv_config(k, min(M, 8), N, K, None).as_dict())
                                                          for M in MS]
            install_fakes(DEVICES[0])
            rec["gemv_config"][f"{k},{N},{K},h100"] = [
                pal(G.gemv_config(k, min(M, 8), N, K, torch.device("cuda", 0)).as_dict()) for M in MS]
    for dev_facts in DEVICES:
        install_fakes(dev_facts)
        gemv_mma._PLANS.clear()
        dev = torch.device("cuda", 0)
        name = dev_facts[0]
        for k in KS:
            for N, K in SHAPES:
                for mma in (False, True):
                    row = []
                    for M in MS:
                        large = mma and gemv_mma.large_ok(dev)
                        ch = D.choose(M, N, K, k, dev, mma=mma, large=large)
                        split = D.split_k(ch.config, M, N, -(-K // 32) * 32, dev_facts[2])
                        row.append(pal([ch.kernel, ch.config.as_dict(), split]))
                    rec["choose"][f"{k},{N},{K},{name},{int(mma)}"] = row
                rec["route"][f"{k},{N},{K},{name}"] = [pal(route(gemv_mma, gemm, k, M, N, K, dev)) for M in MS]
                if name not in ("h100", "a100", "h20"):
                    continue
                for M in PLAN_MS:
                    for sf in ("log8", "fp16"):
                        for det in (False, True):
                            if (sf == "fp16" or det) and (M not in (1, 16, 64) or k not in (2, 4)):
                                continue
                            torch.use_deterministic_algorithms(det)
                            rec["plan"][f"{k},{M},{N},{K},{name},{sf},{int(det)},0,0"] = plans(
                                gemv_mma, compiled, pal, k, M, N, K, sf, dev)
                            torch.use_deterministic_algorithms(False)
                    if M <= 8 and name != "h20":  # prologue / epilogue launches
                        cfg = P.fused_config(k, M, N, K)
                        if cfg is None:
                            continue
                        S = -(-K // 256)
                        for pro, epi in ((1, 0), (2, 0), (0, 1), (2, 1)):
                            if epi and N % 32:
                                continue
                            compiled.clear()
                            p = gemv_mma.plan(k, M, N, S * 256, "log8", cfg, dev, pro=pro, epi=epi)
                            rec["plan"][f"{k},{M},{N},{K},{name},log8,0,{pro},{epi}"] = [
                                [list(cfg), enc_plan(p, compiled, pal)]]
    rec["palette"] = pal.strings
    with open(out, "w") as f:
        json.dump(rec, f, separators=(",", ":"), sort_keys=True)


def enc_plan(p, compiled, pal):
    """file:name, the defines (a palette index), then W, grid, shared, splits, sps, n_cnt, ws_floats, use_ws, occ."""
    file, name = compiled[-1]
    nums = [p[f] for f in ("W", "grid", "shared", "splits", "sps", "n_cnt", "ws_floats")]
    return [pal(f"{file}:{name}|{enc(p['defines'])}"), *nums, int(p["use_ws"]), p["ctas_per_sm"]]


def plans(gemv_mma, compiled, pal, k, M, N, K, sf, dev):
    """The launches of ``linear_small_m`` (``_run``): one kernel-7 launch, or chunks of up to 64 rows."""
    S = -(-K // 256)
    if gemv_mma.uses_large(M, N, K, dev):
        cfg = tuple(gemv_mma.large_config(k, M, N, K))
        compiled.clear()
        return [[list(cfg), enc_plan(gemv_mma.plan(k, M, N, S * 256, sf, cfg, dev), compiled, pal)]]
    out = []
    for m in sorted({min(64, M - m0) for m0 in range(0, M, 64)}):
        compiled.clear()
        out.append([m, enc_plan(gemv_mma.plan(k, m, N, S * 256, sf, None, dev), compiled, pal)])
    return out


def route(gemv_mma, gemm, k, M, N, K, dev):
    """The backend ``kbit.ops.gemm.linear`` / ``KbitLinear`` takes for M rows on CUDA with NVRTC (mma) and
    without it (the Triton path)."""
    out = []
    real = gemv_mma.available
    for mma in (True, False):
        gemv_mma.available = (lambda device=None, _v=mma: _v)
        gemm._choice.cache_clear()
        ch = gemm._choice(M, N, K, k, dev)
        if ch.kernel == "gemv" and mma:
            out.append("mma7" if gemv_mma.uses_large(M, N, K, dev) else "mma")
        else:
            out.append(ch.kernel)
    gemv_mma.available = real
    gemm._choice.cache_clear()
    return ",".join(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/dense_plans.json")
