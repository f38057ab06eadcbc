"""The benchmark driver: kbit candidates, bf16 cuBLAS, peers and the read ceiling, timed in one run.

For each dense shape [N, K], each M and each k: quantize a random weight (``kbit.quantize``), time every
selected candidate (``kbit.bench.registry``) on cold-L2 weight copies, time bf16 ``F.linear`` on the
dequantized weight, and the peers that have that k. For each MoE shape and token count: the same with a
routing (``kbit.bench.moe``), against ``torch._grouped_mm``. Every row carries the read ceiling measured
at the start of the run, so ``tbps / ceiling_tbps`` is the fraction of the roofline reached.

Bytes per call (the roofline's numerator): kbit = codes + scales + tensor_scale + codebook (of the
touched experts for MoE) + activations read; bf16 = 2 N K (per touched expert) + activations; peers =
their packed weight, scales and zeros + activations. Outputs written are not counted.
"""
from __future__ import annotations

import datetime as _dt
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton

from kbit.bench import candidates as _candidates  # noqa: F401  (registers the built-in candidates)
from kbit.bench import moe as moe_mod
from kbit.bench.ceiling import measure_read_ceiling
from kbit.bench.floor import measure_read_floor
from kbit.bench.peers import select_peers
from kbit.bench.registry import Unsupported, select_candidates
from kbit.bench.report import git_commit, gpu_slug
from kbit.bench.timing import L2_FACTOR, WARMUP, WARMUP_MS, Timing, copies_for_cold_l2, l2_bytes, tbps, time_calls
from kbit.bench.weights import clone_weight, kbit_api, kbit_bytes, stand_in_weight, tensor_bytes
from kbit.format.spec import check_blocksize, check_k
from kbit.utils.checks import check_int, fail
from kbit.utils.device import sm_count

BF16 = torch.bfloat16

# (N, K) of Llama-3-8B MLP (gate/up fused 28672 x 4096 and down 4096 x 14336), Llama-3-70B MLP
# (57344 x 8192, 8192 x 28672) and a square attention projection (4096 x 4096).
DENSE_SHAPES = ((28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672), (4096, 4096))
MS = (1, 2, 4, 8)
KS = (2, 3, 4, 5)


@dataclass
class BenchConfig:
    """What one ``kbit bench`` run measures. ``candidates``: comma list of registry names (None: the
    defaults, "all": every one); ``peers``: comma list of peer names (None: none); ``budget_s``: soft
    wall-clock budget, units past it are skipped and listed in the header."""

    shapes: Sequence[tuple[int, int]] = DENSE_SHAPES
    ms: Sequence[int] = MS
    ks: Sequence[int] = KS
    blocksize: int = 32
    candidates: str | None = None
    peers: str | None = None
    moe: Sequence[moe_mod.MoeShape] = moe_mod.QWEN3_30B_A3B
    tokens: Sequence[int] = (1, 4)
    reps: int = 15
    ceiling: bool = True
    floor: bool = False
    #: peers of a shape right after its kbit and bf16 rows (a budget then cuts whole shapes, as a suite run wants)
    #: instead of after every shape
    peers_with_shape: bool = False
    budget_s: float | None = None
    seed: int = 0
    commit: str | None = None
    command: str = ""
    extra_header: dict = field(default_factory=dict)

    def __post_init__(self):
        for k in self.ks:
            check_k(k)
        for name in ("ms", "tokens"):
            for i, v in enumerate(getattr(self, name)):
                check_int(f"{name}[{i}]", v, minimum=1)
        for i, shape in enumerate(self.shapes):
            if len(shape) != 2:
                fail(ValueError, f"shapes[{i}]", "an (N, K) pair", shape)
            for side, v in zip("NK", shape, strict=True):
                check_int(f"shapes[{i}].{side}", v, minimum=1)
        check_blocksize(self.blocksize)
        check_int("reps", self.reps, minimum=1)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float32 (Frobenius)."""
    y = y.float().reshape(ref.shape)
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def _randn(shape, seed: int, device, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(BF16)


#: expert stacks of more weights than this (2 ** 31; of the suite, DeepSeek-V3's) are made one expert at a time
#: and their reference weight kept in bf16, so that no float32 copy of the whole stack is needed
BIG_STACK = 2**31


def _randn_stack(E: int, N: int, K: int, seed: int, device, scale: float) -> torch.Tensor:
    """A bf16 [E, N, K] stack of seeded normal values times ``scale``, one expert at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(E, N, K, dtype=BF16, device=device)
    for e in range(E):
        out[e] = torch.randn(N, K, generator=g, device=device, dtype=torch.float32).mul_(scale)
    return out


def _log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the run
class Runner:
    def __init__(self, cfg: BenchConfig, device: str = "cuda",
                 checkpoint: Callable[[dict, list[dict]], object] | None = None):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self.gpu_name = torch.cuda.get_device_name(self.device)
        self.gpu = gpu_slug(self.gpu_name)
        self.l2 = l2_bytes(self.device)
        self.commit = cfg.commit or git_commit()
        self.ceiling_tbps: float | None = None
        self.ceiling_bytes = 0
        self.bf16_us: dict[tuple, float] = {}
        self.t0 = time.time()
        self.api = kbit_api()
        self.dense_cands = select_candidates("dense", cfg.candidates)
        self.moe_cands = select_candidates("moe", cfg.candidates)
        self.peers = select_peers(cfg.peers)
        self._peer_down: dict[str, str] = {}

    # -- bookkeeping
    def over_budget(self) -> bool:
        return self.cfg.budget_s is not None and time.time() - self.t0 > self.cfg.budget_s

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append(f"{what}: {reason}")
        _log(f"  skip {what}: {reason}")

    def time(self, what: str, calls: Sequence[Callable[[], object]]) -> Timing | None:
        try:
            return time_calls(calls, reps=self.cfg.reps)
        except Exception as e:  # noqa: BLE001 - one failing kernel must not end the run
            self.skip(what, f"timing failed: {type(e).__name__}: {str(e)[:300]}")
            return None

    def add_row(self, *, kernel: str, k: int, blocksize: int, N: int, K: int, M: int, E: int, timing: Timing,
                nbytes: int, err: float | None, **extra) -> None:
        key = (E, N, K, M)
        if kernel.startswith("bf16"):
            self.bf16_us[key] = timing.us
        bf16_us = self.bf16_us.get(key)
        row = dict(gpu=self.gpu, commit=self.commit, kernel=kernel, k=int(k), blocksize=int(blocksize),
                   dtype="bfloat16", N=int(N), K=int(K), M=int(M), E=int(E), us=float(timing.us),
                   bf16_us=None if bf16_us is None else float(bf16_us), tbps=float(tbps(nbytes, timing.us)),
                   ceiling_tbps=self.ceiling_tbps, bytes=int(nbytes), err=err, us_min=timing.us_min,
                   us_max=timing.us_max, calls=timing.calls, mode=timing.mode, **extra)
        self.rows.append(row)
        xb = f"{bf16_us / timing.us:5.2f}x" if bf16_us else "   -  "
        frac = f"{row['tbps'] / self.ceiling_tbps * 100:4.0f}%" if self.ceiling_tbps else "  - "
        es = "-" if err is None else f"{err:.1e}"
        _log(f"  {kernel:<18} k={k:<2} B={blocksize:<3} {E}x{N}x{K} M={M:<4} {timing.us:9.2f} us {xb} "
             f"{row['tbps']:5.2f} TB/s {frac} err {es} ({timing.mode}, {timing.calls} calls)")

    # -- measurements
    def run(self) -> tuple[dict, list[dict]]:
        cfg = self.cfg
        _log(f"kbit bench on {self.gpu_name} (L2 {self.l2 / 1e6:.0f} MB), commit {self.commit}; "
             f"kbit.quantize {'found' if self.api else 'NOT available (stand-in weights)'}")
        if cfg.ceiling:
            c = measure_read_ceiling(reps=cfg.reps, device=str(self.device))
            self.ceiling_tbps, self.ceiling_bytes = c.read_tbps, c.nbytes
            _log(f"read ceiling: {c.read_tbps:.3f} TB/s (sum over {c.nbytes / 1e9:.2f} GB, {c.timing.mode})")
        # kbit and bf16 on every shape first; peers (slow to build, JIT compiles) last, within the budget
        units = []
        for N, K in cfg.shapes:
            units.append((f"dense {N}x{K}", lambda N=N, K=K: self.dense_shape(N, K)))
            if self.peers and cfg.peers_with_shape:
                units.append((f"peers {N}x{K}", lambda N=N, K=K: self.dense_peers(N, K)))
        units += [(f"moe {s.name}", lambda s=s: self.moe_shape(s)) for s in cfg.moe]
        if self.peers and not cfg.peers_with_shape:
            units += [(f"peers {N}x{K}", lambda N=N, K=K: self.dense_peers(N, K)) for N, K in cfg.shapes]
        for name, unit in units:
            if self.over_budget():
                self.skip(name, "budget")
                continue
            t = time.time()
            unit()
            torch.cuda.empty_cache()
            _log(f"{name}: {time.time() - t:.1f} s")
            if self.checkpoint is not None:
                self.checkpoint(self.header(), self.rows)
        return self.header(), self.rows

    def header(self) -> dict:
        cfg = self.cfg
        return dict(gpu=self.gpu, gpu_name=self.gpu_name, date=_dt.date.today().isoformat(),
                    commit=self.commit, command=cfg.command, torch=torch.__version__, triton=triton.__version__,
                    l2_bytes=self.l2,
                    sms=sm_count(self.device), ceiling_tbps=self.ceiling_tbps,
                    ceiling_bytes=self.ceiling_bytes, reps=cfg.reps, l2_factor=L2_FACTOR, warmup=WARMUP,
                    warmup_ms=WARMUP_MS,
                    kbit_quantize=self.api is not None, elapsed_s=round(time.time() - self.t0, 1),
                    skipped=self.skipped, **cfg.extra_header)

    def quantize(self, W: torch.Tensor, k: int):
        """(KbitWeight, True), or (StandInWeight, False) while kbit.quantize is missing."""
        if self.api is None:
            return stand_in_weight(W.shape, k, self.cfg.blocksize, W.device), False
        return self.api[0](W, k=k, blocksize=self.cfg.blocksize), True

    def dequantize(self, qw, dtype) -> torch.Tensor:
        return self.api[1](qw, dtype=dtype)

    def dense_inputs(self, N: int, K: int) -> tuple[torch.Tensor, dict]:
        """The seeded weight [N, K] and activations {M: [M, K]} of a dense shape (the same in every pass)."""
        cfg = self.cfg
        W = _randn((N, K), cfg.seed + N * 7 + K, self.device, 0.02)
        return W, {M: _randn((M, K), cfg.seed + 1000 + M, self.device) for M in cfg.ms}

    def dense_shape(self, N: int, K: int) -> None:
        cfg = self.cfg
        _log(f"dense {N}x{K}")
        W, xs = self.dense_inputs(N, K)
        for i, k in enumerate(cfg.ks):
            try:
                qw, real = self.quantize(W, k)
            except Exception as e:  # noqa: BLE001
                self.skip(f"kbit k={k} {N}x{K}", f"quantize failed: {type(e).__name__}: {str(e)[:200]}")
                qw, real = stand_in_weight(W.shape, k, cfg.blocksize, W.device), False
            wdq = self.dequantize(qw, torch.float32) if real else None
            if i == 0:  # bf16 baseline: on the dequantized weight of the first k (cuBLAS does not care which)
                self.dense_bf16(wdq.to(BF16) if real else W, xs)
            self.dense_kbit(qw, real, wdq, xs)
            del qw, wdq
        del W

    def dense_peers(self, N: int, K: int) -> None:
        _log(f"peers {N}x{K}")
        W, xs = self.dense_inputs(N, K)
        for k in self.cfg.ks:
            for peer in self.peers:
                self.dense_peer(peer, W, k, xs)
                torch.cuda.empty_cache()

    def dense_bf16(self, Wb: torch.Tensor, xs: dict) -> None:
        N, K = Wb.shape
        n = copies_for_cold_l2(tensor_bytes(Wb), self.l2)
        copies = [Wb] + [Wb.clone() for _ in range(n - 1)]
        for M, x in xs.items():
            t = self.time(f"bf16 {N}x{K} M={M}", [lambda w=w, x=x: F.linear(x, w) for w in copies])
            if t:
                self.add_row(kernel="bf16", k=16, blocksize=0, N=N, K=K, M=M, E=1, timing=t,
                             nbytes=tensor_bytes(Wb) + tensor_bytes(x), err=None)
        del copies

    def dense_kbit(self, qw, real: bool, wdq, xs: dict) -> None:
        N, K = qw.shape[-2], qw.shape[-1]
        wbytes = kbit_bytes(qw)
        copies = None
        for cand in self.dense_cands:
            what = f"{cand.name} k={qw.k} {N}x{K}"
            if cand.needs_kbit and not real:
                self.skip(what, "kbit.quantize not available")
                continue
            if self.over_budget():
                self.skip(what, "budget")
                continue
            if copies is None:
                n = copies_for_cold_l2(wbytes, self.l2)
                copies = [qw] + [clone_weight(qw) for _ in range(n - 1)]
            for M, x in xs.items():
                try:
                    fns = [cand.factory(c, M) for c in copies]
                    y = fns[0](x)
                    torch.cuda.synchronize()
                except Unsupported as e:
                    self.skip(f"{what} M={M}", str(e))
                    continue
                except Exception as e:  # noqa: BLE001
                    self.skip(f"{what} M={M}", f"failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                err = rel_err(y, x.float() @ wdq.t()) if (real and cand.needs_kbit) else None
                t = self.time(f"{what} M={M}", [lambda f=f, x=x: f(x) for f in fns])
                if t:
                    self.add_row(kernel=cand.name, k=qw.k, blocksize=qw.blocksize, N=N, K=K, M=M, E=1,
                                 timing=t, nbytes=wbytes + tensor_bytes(x), err=err, stand_in=not real)
                del fns
        del copies
        if self.cfg.floor and not self.over_budget():
            self.dense_floor(qw, wbytes, min(xs))

    def dense_floor(self, qw, wbytes: int, M: int) -> None:
        """A ``read`` row: the fastest plain read of the weight's bytes (:mod:`kbit.bench.floor`)."""
        N, K = qw.shape[-2], qw.shape[-1]
        try:
            f = measure_read_floor(wbytes, reps=self.cfg.reps, device=str(self.device))
        except Exception as e:  # noqa: BLE001
            self.skip(f"read k={qw.k} {N}x{K}", f"failed: {type(e).__name__}: {str(e)[:300]}")
            return
        self.add_row(kernel="read", k=qw.k, blocksize=qw.blocksize, N=N, K=K, M=M, E=1, timing=f.timing,
                     nbytes=f.nbytes, err=None, read_best=f.best, read_variants=f.variants)

    def _peer_ok(self, peer, k: int) -> bool:
        if k not in peer.bits:
            return False
        if peer.name not in self._peer_down:
            reason = peer.unavailable()
            self._peer_down[peer.name] = reason or ""
            if reason:
                self.skip(peer.name, reason)
        return not self._peer_down[peer.name]

    def dense_peer(self, peer, W: torch.Tensor, k: int, xs: dict) -> None:
        N, K = W.shape
        what = f"{peer.name} k={k} {N}x{K}"
        if not self._peer_ok(peer, k):
            return
        if self.over_budget():
            self.skip(what, "budget")
            return
        try:
            pw = peer.build(W, k)
            n = copies_for_cold_l2(pw.nbytes, self.l2)
            states = [pw.state] + [peer.copy(pw.state) for _ in range(n - 1)]
        except Exception as e:  # noqa: BLE001
            self.skip(what, f"build failed: {type(e).__name__}: {str(e)[:300]}")
            return
        for M, x in xs.items():
            try:
                thunks = [peer.bind(s, x) for s in states]
                y = thunks[0]()
                torch.cuda.synchronize()
                err = rel_err(y, x.float() @ pw.reference.t())
            except Exception as e:  # noqa: BLE001
                self.skip(f"{what} M={M}", f"failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            t = self.time(f"{what} M={M}", thunks)
            if t:
                self.add_row(kernel=peer.name, k=k, blocksize=pw.group, N=N, K=K, M=M, E=1, timing=t,
                             nbytes=pw.nbytes + tensor_bytes(x), err=err, note=pw.note)
        del states, pw

    # -- MoE
    def moe_shape(self, shape: moe_mod.MoeShape) -> None:
        cfg = self.cfg
        E, N, K = shape.E, shape.N, shape.K
        _log(f"moe {shape.name}: E={E} {N}x{K} top-{shape.topk}")
        big = E * N * K > BIG_STACK
        W = _randn_stack(E, N, K, cfg.seed + 17 * N + K, self.device, 0.02) if big else \
            _randn((E, N, K), cfg.seed + 17 * N + K, self.device, 0.02)
        routings = {T: moe_mod.make_routing(T, shape.topk, E, seed=cfg.seed + T, device=self.device)
                    for T in cfg.tokens}
        acts = {T: _randn((T * shape.topk, K), cfg.seed + 2000 + T, self.device) for T in cfg.tokens}
        for i, k in enumerate(cfg.ks):
            try:
                qw, real = self.quantize(W, k)
            except Exception as e:  # noqa: BLE001
                reason = f"quantize failed: {type(e).__name__}: {str(e)[:200]}"
                self.skip(f"kbit moe k={k} {shape.name}", reason)
                qw, real = stand_in_weight(W.shape, k, cfg.blocksize, W.device), False
            # a big stack's reference weight in bf16 (moe_mod.reference widens one expert at a time)
            wdq = self.dequantize(qw, BF16 if big else torch.float32) if real else None
            if i == 0:
                self.moe_bf16(shape, wdq.to(BF16) if real else W, routings, acts)
            self.moe_kbit(shape, qw, real, wdq, routings, acts)
            del qw, wdq
        del W

    def moe_bf16(self, shape, Wb: torch.Tensor, routings: dict, acts: dict) -> None:
        E, N, K = Wb.shape
        for T, r in routings.items():
            a = acts[T]
            fn, name = moe_mod.bf16_grouped(Wb, r)
            try:
                err = rel_err(fn(a), moe_mod.reference(a, Wb, r))
                if not err < 1e-2:
                    raise RuntimeError(f"error {err:.1e} against the reference")
            except Exception as e:  # noqa: BLE001
                reason = f"{type(e).__name__}: {str(e)[:200]}; using a loop of mm"
                self.skip(f"{name} {shape.name} T={T}", reason)
                name = "bf16-loop_mm"
            wbytes = len(r.touched) * N * K * 2
            n = copies_for_cold_l2(wbytes, self.l2)
            copies = [Wb] + [Wb.clone() for _ in range(n - 1)]
            if name == "bf16-loop_mm":
                fns = [moe_mod.bf16_loop(w, r) for w in copies]
            else:
                fns = [moe_mod.bf16_grouped(w, r)[0] for w in copies]
            t = self.time(f"{name} {shape.name} T={T}", [lambda f=f, a=a: f(a) for f in fns])
            if t:
                # the row's kernel is "bf16" so that kbit rows find their baseline; "impl" says which
                self.add_row(kernel="bf16", k=16, blocksize=0, N=N, K=K, M=T, E=E, timing=t,
                             nbytes=wbytes + tensor_bytes(a), err=None, impl=name, topk=shape.topk,
                             touched=len(r.touched), layer=shape.name)
            del copies, fns

    def moe_kbit(self, shape, qw, real: bool, wdq, routings: dict, acts: dict) -> None:
        E, N, K = shape.E, shape.N, shape.K
        for cand in self.moe_cands:
            what = f"{cand.name} k={qw.k} {shape.name}"
            if cand.needs_kbit and not real:
                self.skip(what, "kbit.quantize not available")
                continue
            for T, r in routings.items():
                if self.over_budget():
                    self.skip(f"{what} T={T}", "budget")
                    continue
                a = acts[T]
                wbytes = kbit_bytes(qw, r.touched)
                n = copies_for_cold_l2(wbytes, self.l2)
                try:
                    copies = [qw] + [clone_weight(qw) for _ in range(n - 1)]
                    fns = [cand.factory(c, r) for c in copies]
                    y = fns[0](a)
                    torch.cuda.synchronize()
                except Unsupported as e:
                    self.skip(f"{what} T={T}", str(e))
                    continue
                except Exception as e:  # noqa: BLE001
                    self.skip(f"{what} T={T}", f"failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                err = rel_err(y, moe_mod.reference(a, wdq, r)) if real else None
                t = self.time(f"{what} T={T}", [lambda f=f, a=a: f(a) for f in fns])
                if t:
                    self.add_row(kernel=cand.name, k=qw.k, blocksize=qw.blocksize, N=N, K=K, M=T, E=E,
                                 timing=t, nbytes=wbytes + tensor_bytes(a), err=err, topk=shape.topk,
                                 touched=len(r.touched), layer=shape.name)
                del copies, fns


def run_bench(cfg: BenchConfig, device: str = "cuda",
              checkpoint: Callable[[dict, list[dict]], object] | None = None) -> tuple[dict, list[dict]]:
    """Runs the benchmark described by ``cfg`` on ``device``; returns (header, rows) for
    :func:`kbit.bench.report.write_results`. ``checkpoint(header, rows)`` is called after each shape (the
    CLI writes the results file there, so a run cut short keeps what it measured)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kbit bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    return Runner(cfg, device, checkpoint).run()
