"""Tuned tables: what ``kbit tune`` measured on one GPU, the default rule fitted on it, and the lookup a dispatcher
would make (exact shape first, then the rule).

A tuned table is a JSON file per GPU (``<cache_dir>/tuned/<gpu>.json`` by default; :func:`default_path`)::

    {"format": "kbit-tuned", "version": 1, "gpu": "h100", "gpu_name": ..., "sms": 132, "commit": ..., ...,
     "entries": {"<k>": {"<N>x<K>": {"<M bucket>": {
         "best": {"family": "mma", "config": {...}, "us": 40.1},
         "current_us": 48.3,                      # the dispatcher's choice before tuning, timed in the same run
         "current": {"family": "mma", ...},       # that choice, or null where not known (not in packaged tables)
         "builtin": {"family": "mma", ...},       # the built-in rules' choice (one of the trials), or null
         "code": {"mma": "<digest>", ...},        # the kernel code the trials ran (kbit.tuning.code)
         "trials": [{"family": ..., "config": ..., "us": ...}, ...]}}}},   # every candidate timed (us null: failed)
     "rules": [{"if": {"k": [4], "M_min": 9, "M_max": 16, "NK_min": 50000000, "NK_below": 100000000},
                "family": ..., "config": ...,
                "fit": {"shapes": 7, "geomean_slowdown": 1.02, "worst_slowdown": 1.04}}, ...]}

The rule (:func:`fit_rules`): per (k, M bucket) and per band of N x K (:data:`NK_EDGES`), of the candidates within
:data:`WITHIN` of the best on every tuned shape of the band the one with the smallest geometric-mean slowdown
(time / that shape's best), else the one with the smallest worst slowdown; one rule per (k, M bucket) with no band
bound after them as the catch-all. Conditions use the vocabulary of the rule tables in
``configs/default.json``. :func:`evaluate` replays a rule on other tuned entries (the held-out half of the suite).

Where the dispatcher looks (:func:`tuned_candidate`), first answer wins: the user's own table in the cache directory
(``kbit tune`` wrote it on their GPU), then the table shipped with kbit for that GPU (``configs/tuned-<gpu>.json``,
package data: :func:`packaged_path`; made by :meth:`TunedTable.packaged`), each first for an entry of the very shape,
then for a shape never tuned (the nearest tuned shapes, then the fitted rules); then nothing (the built-in rule
tables decide). On the nearest tuned shapes the built-in rules' own choice competes as one more candidate (its time
on each is that of the trial it chose there): where it wins, the table answers "the built-in rules" for the shape.
A shipped table that cannot be read fails loudly, naming its path.

M buckets (:meth:`TunedTable.bucket`): a table answers for M rows from the entries of M's own bucket
(``m_bucket(M)``) where it tuned that bucket (for that k); M = 1 only from bucket 1, where the decode kernels have
their own builds. Up to :data:`EXTRAPOLATE_MAX` rows an untuned bucket takes the next tuned one up to that limit:
the small-M kernels' configs do not depend on M, and on the H100 tune table of 2026-11-27 a larger bucket's pick
(at most 16 rows) ran M = 1, 4, 8 rows at a geometric mean of 1.01-1.04x the best against 1.05-1.07x for the
built-in rules. Above it kernel 7 and the GEMM tile by M, and a larger bucket's pick lost to the built-in rules
even from twice the rows (M = 128 from 256: 1.25x against 1.14x; M = 64 from 256: 1.34x against 1.13x), so there
an untuned bucket is left to them (``lab`` analysis in ``docs/notes/2026-11-27-tuned-buckets.md``).

Nothing here searches: a shape that is neither in the table nor matched by a rule gets None (the built-in rules
and heuristics then decide), so a first call never runs a search inline.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from kbit import options
from kbit.tuning import mma as _tmma
from kbit.tuning.code import CODE_FILES, family_digests
from kbit.tuning.mma_plan import k1_layout, x_staged
from kbit.tuning.space import Candidate, candidate_from_dict
from kbit.tuning.tables import M_BUCKETS, m_bucket

__all__ = ["BUILTIN", "EXTRAPOLATE_MAX", "FORMAT", "NEAREST", "NK_EDGES", "WITHIN", "Trial", "TunedTable",
           "default_path", "evaluate", "fit_rules", "packaged_path", "packaged_table", "rule_matches",
           "serving_bucket", "tuned_candidate", "reload_tuned"]

FORMAT = "kbit-tuned"
VERSION = 1
_CONFIGS = Path(__file__).with_name("configs")
#: bands of N x K weight elements the fitted rule distinguishes (the bounds the built-in rule tables use, and 5e8)
NK_EDGES = (2 * 10**7, 5 * 10**7, 10**8, 2 * 10**8, 5 * 10**8)
#: a fitted rule prefers candidates within this of each tuned shape's best (the dispatcher's bar in issue 32)
WITHIN = 1.05
#: an untuned shape takes its pick over this many nearest tuned shapes (:meth:`TunedTable.nearest`)
NEAREST = 3
#: up to this many rows an untuned M bucket takes the next tuned bucket up to it (see the module docstring)
EXTRAPOLATE_MAX = 16
#: :meth:`TunedTable.nearest`'s answer where the built-in rules' own choice wins on the nearest tuned shapes
BUILTIN = "builtin"


def packaged_path(gpu: str) -> Path:
    """``kbit/tuning/configs/tuned-<gpu>.json``: the tuned table shipped for one GPU (it may not exist)."""
    return _CONFIGS / f"tuned-{gpu}.json"


def default_path(gpu: str) -> Path:
    """``<kbit.options cache_dir>/tuned/<gpu>.json``."""
    cache = options.get().cache_dir
    if not cache:
        raise ValueError("cache_dir: expected a kbit cache directory (kbit.options), got none; pass a path")
    return Path(cache) / "tuned" / f"{gpu}.json"


@dataclass(frozen=True)
class Trial:
    """One candidate timed on one (k, N, K, M bucket): ``us`` None where it failed or was unsupported."""

    candidate: Candidate
    us: float | None

    def as_dict(self) -> dict:
        return {**self.candidate.as_dict(), "us": self.us}


def _trial(d: dict) -> Trial:
    return Trial(candidate_from_dict(d), None if d.get("us") is None else float(d["us"]))


class TunedTable:
    """One GPU's tuned entries and fitted rules (see the module docstring for the JSON form)."""

    def __init__(self, gpu: str, meta: dict | None = None):
        self.gpu = gpu
        self.meta = dict(meta or {})
        self.entries: dict[tuple[int, int, int, int], dict] = {}  # (k, N, K, bucket) -> entry
        self.rules: list[dict] = []
        #: the packaged form's candidates, which its entries' ``times`` name by index
        self.candidates: list[Candidate] = []

    # -- building
    def add(self, k: int, N: int, K: int, M: int, trials: Iterable[Trial], current_us: float | None = None,
            builtin: Candidate | None = None, current: Candidate | None = None) -> dict:
        """Records the trials of one (k, N, K, M's bucket) and the digests of the kernel code they ran
        (:func:`kbit.tuning.code.family_digests`); the best is the fastest timed one. ``builtin``: the built-in
        rules' choice there (one of the trials; :meth:`nearest` weighs it); ``current``: the dispatcher's choice
        that ``current_us`` timed."""
        trials = list(trials)
        timed = [t for t in trials if t.us is not None and math.isfinite(t.us)]
        if not timed:
            raise ValueError(f"trials: expected at least one timed candidate for k={k} {N}x{K} M={M}, got none")
        best = min(timed, key=lambda t: t.us)
        entry = dict(best=best.as_dict(), current_us=current_us, trials=[t.as_dict() for t in trials],
                     builtin=None if builtin is None else builtin.as_dict(),
                     current=None if current is None else current.as_dict(),
                     code=family_digests(t.candidate.family for t in trials))
        self.entries[(int(k), int(N), int(K), m_bucket(M))] = entry
        return entry

    def stale(self, key: tuple[int, int, int, int]) -> bool:
        """Whether the entry's times were measured on other kernel code than this kbit's: a family's recorded
        digest differs from its files' now, or the entry recorded none (:mod:`kbit.tuning.code`)."""
        code = self.entries[key].get("code")
        return not code or any(f not in CODE_FILES for f in code) or family_digests(code) != code

    def merge(self, other: TunedTable) -> None:
        """Takes ``other``'s entries (replacing those of the same key)."""
        self.entries.update(other.entries)

    # -- lookup
    def lookup(self, k: int, M: int, N: int, K: int) -> Candidate | None:
        """The tuned candidate for ``M`` rows on a k-bit [N, K] weight: the exact shape's entry for M's bucket, else
        the pick over the :data:`NEAREST` nearest tuned shapes of that k and bucket (:meth:`nearest`), else the
        first fitted rule that matches, else None (also where the built-in rules' choice won on the nearest shapes).
        Scans the entries: callers on a hot path keep its answers (:func:`tuned_candidate` does)."""
        return self.answer(k, M, N, K)[1]

    def answer(self, k: int, M: int, N: int, K: int) -> tuple[bool, Candidate | None]:
        """(whether this table answers, its candidate): :meth:`exact`, else :meth:`general_answer` ((True, None):
        the built-in rules' choice)."""
        cand = self.exact(k, M, N, K)
        return (True, cand) if cand is not None else self.general_answer(k, M, N, K)

    def buckets(self, k: int) -> tuple[int, ...]:
        """The M buckets this table tuned at ``k``, ascending."""
        return tuple(sorted({key[3] for key in self.entries if key[0] == k}))

    def bucket(self, k: int, M: int) -> int | None:
        """The tuned bucket whose entries serve ``M`` rows at ``k`` (see the module docstring), or None."""
        return serving_bucket(self.buckets(k), M)

    def exact(self, k: int, M: int, N: int, K: int) -> Candidate | None:
        """The best of the entry of exactly this shape and the bucket serving M (:meth:`bucket`), or None."""
        b = self.bucket(k, M)
        entry = None if b is None else self.entries.get((k, N, K, b))
        return None if entry is None else candidate_from_dict(entry["best"])

    def general_answer(self, k: int, M: int, N: int, K: int) -> tuple[bool, Candidate | None]:
        """(whether this table answers, its candidate): :meth:`nearest` (its ``BUILTIN`` answer: (True, None), the
        built-in rules decide), else the first fitted rule that matches; (False, None) where neither does. A kernel-3
        config that stages x in K slices answers with the whole x where it fits [N, K] at M rows (:func:`_x_form`)."""
        b = self.bucket(k, M)
        near = None if b is None else self.nearest(k, b, N, K)
        if near is BUILTIN:
            return True, None
        if near is not None:
            return True, _x_form(near, k, M, K)
        for rule in self.rules:
            if rule_matches(rule["if"], k, M, N, K):
                return True, _x_form(candidate_from_dict(rule), k, M, K)
        return False, None

    def nearest(self, k: int, bucket: int, N: int, K: int) -> Candidate | str | None:
        """For a shape not tuned: of the :data:`NEAREST` tuned shapes of this k and M bucket nearest to [N, K]
        (distance ``|log N / N'| + |log K / K'|``), the candidate a fitted rule would take over them (:func:`fit_rules`:
        within :data:`WITHIN` of the best on each, else the smallest worst slowdown), the built-in rules' choice
        competing as one more candidate where every one of those entries records it; where it wins, what the
        rules chose there if that was one candidate on all of them, else :data:`BUILTIN`; None without such
        shapes. Judged by leaving each model family of the H100 tune table of 2026-11-27 out in turn (1267 entries,
        M = 1..1024; ``lab/suite/cv_families.py``, ``benchmarks/results/cpu/nearest-builtin-cv-2026-11-27.txt``):
        within 5% of the best on 80% of the 1263 entries whose pick was timed there (worst 2.82x); 79% (2.74x) when
        a win of the built-in candidate always answered :data:`BUILTIN`, 69% (5.04x) for the built-in rules
        alone. At M = 1 a kernel-1 config's times are not carried to a shape where its CTAs take more tiles in turn
        (:func:`_k1_more_rounds`): on the shipped table of 2026-11-28 (1309 entries) the same 78% within 5% with
        and without it; on the held-out shapes, 5120x8192 went from kernel 1 to kernel 3, 0.78x the time at k = 4
        and 0.91x at k = 2 (``benchmarks/results/h100/table-veto-2026-11-28/``). A kernel-3 config that stages x
        is judged by the times of the form it takes on [N, K] (:func:`_x_stand_in`)."""
        keys = [key for key in self.entries if key[0] == k and key[3] == bucket]
        if not keys:
            return None
        keys.sort(key=lambda key: (abs(math.log(N / key[1])) + abs(math.log(K / key[2])), key))
        near = keys[:NEAREST]
        if not all("trials" in self.entries[key] or "times" in self.entries[key] for key in near):
            return candidate_from_dict(self.entries[near[0]]["best"])  # no trials kept: the nearest shape's best
        # Kernel-1 times carried only where its CTAs take no more tiles in turn (:func:`_k1_more_rounds`); at M = 1
        # only: at 4 to 64 rows the veto lost on the held-out shapes (H100 held-out tune of 2026-11-27, k = 2:
        # within 5% of the best at M = 64 83% -> 73%, M = 8 87% -> 83%)
        # A kernel-3 config that stages x runs on [N, K] in the form that fits there: that form's times stand for it
        # (:func:`_x_stand_in`)
        sms = self.meta.get("sms") if bucket == 1 else None
        def stand_in(c, key):
            return None if _k1_more_rounds(c, key, N, K, sms) else _x_stand_in(c, key, K)

        slow = _slowdowns(self, near, stand_in=stand_in)
        # (the built-in choice's times stand as measured where kernel 1 takes more rounds: the rules choose again)
        own = [self.builtin_slowdown(key, lambda c, key: _x_stand_in(c, key, K)) for key in near]
        if all(v is not None for v in own):
            slow[BUILTIN] = own
        picked = _pick(slow, len(near))
        if picked is None:
            return None
        if picked[0] != BUILTIN:
            return candidate_from_dict(json.loads(picked[0]))
        # The built-in rules won on those shapes with what they chose there. Where that was one candidate, it is
        # the one measured: the rules may choose otherwise for [N, K] (a threshold between), unmeasured. Not where
        # it is a kernel-1 config whose times do not carry to [N, K]: the rules choose there (they may not take it).
        own = {self.builtin_candidate(key) for key in near}
        if len(own) != 1:
            return BUILTIN
        c = own.pop()
        return BUILTIN if any(_k1_more_rounds(c, key, N, K, sms) for key in near) else c

    def builtin_candidate(self, key: tuple[int, int, int, int]) -> Candidate | None:
        """The built-in rules' choice an entry records (None where it records none)."""
        own = self.entries[key].get("builtin")
        if own is None:
            return None
        return self.candidates[own] if isinstance(own, int) else candidate_from_dict(own)

    def builtin_slowdown(self, key: tuple[int, int, int, int], stand_in=None) -> float | None:
        """The built-in rules' choice's time / the best at an entry (None where it records none or was not timed);
        ``stand_in``: as in :func:`_slowdowns`."""
        own = self.builtin_candidate(key)
        if own is None:
            return None
        times = {t.candidate: t.us for t in self.trials(key) if t.us is not None}
        if own not in times:
            return None
        run = stand_in(own, key) if stand_in is not None else own
        return math.inf if run is None else times.get(run, times[own]) / min(times.values())

    # -- JSON
    def as_dict(self) -> dict:
        nested: dict = defaultdict(lambda: defaultdict(dict))
        for (k, N, K, b), e in sorted(self.entries.items()):
            nested[str(k)][f"{N}x{K}"][str(b)] = e
        out = {"format": FORMAT, "version": VERSION, "gpu": self.gpu, **self.meta,
               "entries": {k: dict(v) for k, v in nested.items()}, "rules": self.rules}
        if self.candidates:
            out["candidates"] = [c.as_dict() for c in self.candidates]
        return out

    def save(self, path: str | Path, indent: int | None = 1) -> Path:
        """Writes the table to ``path`` (``indent`` None: one line, as the packaged tables are kept)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        text = json.dumps(self.as_dict(), indent=indent, allow_nan=False, separators=None if indent else (",", ":"))
        tmp.write_text(text + "\n")
        tmp.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def from_dict(cls, d: dict) -> TunedTable:
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"tuned table: expected format {FORMAT!r} version {VERSION}, got "
                             f"{d.get('format')!r} version {d.get('version')!r}")
        meta = {k: v for k, v in d.items() if k not in ("format", "version", "gpu", "entries", "rules", "candidates")}
        t = cls(d["gpu"], meta)
        t.candidates = [candidate_from_dict(c) for c in d.get("candidates", [])]
        for k, shapes in d.get("entries", {}).items():
            for shape, buckets in shapes.items():
                N, K = (int(v) for v in shape.split("x"))
                for b, e in buckets.items():
                    t.entries[(int(k), N, K, int(b))] = e
        t.rules = list(d.get("rules", []))
        return t

    @classmethod
    def load(cls, path: str | Path) -> TunedTable:
        """The table at ``path``; a file that is not a whole tuned table (bad JSON, another format, an entry or rule
        that names no known candidate) is a ``ValueError`` naming the path."""
        path = Path(path)
        try:
            t = cls.from_dict(json.loads(path.read_text()))
            for key, e in t.entries.items():
                candidate_from_dict(e["best"])
                if "times" in e:
                    t.trials(key)  # every index names a candidate
                t.builtin_candidate(key)
                code = e.get("code", {})
                if not (isinstance(code, dict) and all(isinstance(v, str) for v in code.values())):
                    raise ValueError(f"entry {key}: expected code as {{family: digest}}, got {code!r}")
            for r in t.rules:
                candidate_from_dict(r)
                for name, v in r["if"].items():  # one at a time: the matcher stops at the first that fails
                    rule_matches({name: v}, 1, 1, 1, 1)  # an unknown condition is a ValueError
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:  # JSONDecodeError: a ValueError
            raise ValueError(f"tuned table {path}: expected a {FORMAT!r} table (kbit tune), got an unreadable one: "
                             f"{type(e).__name__}: {e}") from e
        return t

    def packaged(self) -> TunedTable:
        """The form shipped as package data (:func:`packaged_path`): each entry keeps its best, the dispatcher's time
        before tuning and its timed trials as ``times`` ([candidate index, us] pairs; the candidates listed once, in
        ``candidates``) and the built-in choice as a candidate index, which :meth:`nearest` needs; the rules as they
        are."""
        t = TunedTable(self.gpu, self.meta)
        index: dict[Candidate, int] = {}
        for key, e in sorted(self.entries.items()):
            times = []
            if "trials" in e or "times" in e:
                for tr in self.trials(key):
                    if tr.us is not None:
                        times.append([index.setdefault(tr.candidate, len(index)), round(tr.us, 3)])
            own = self.builtin_candidate(key)
            t.entries[key] = {"best": e["best"], "current_us": e.get("current_us"), "times": times,
                              "builtin": None if own is None else index.setdefault(own, len(index))}
            if e.get("code"):
                t.entries[key]["code"] = e["code"]
        t.candidates = list(index)
        t.rules = list(self.rules)
        return t

    def trials(self, key: tuple[int, int, int, int]) -> list[Trial]:
        e = self.entries[key]
        if "times" in e:
            return [Trial(self.candidates[int(i)], float(us)) for i, us in e["times"]]
        if "trials" not in e:
            raise ValueError(f"table: expected the trials of {key} (a table kbit tune wrote), got an entry that holds "
                             "only the best")
        return [_trial(t) for t in e["trials"]]


@functools.lru_cache(maxsize=16)
def _active(cache: str, gpu: str) -> TunedTable | None:
    path = Path(cache) / "tuned" / f"{gpu}.json"
    return TunedTable.load(path) if path.is_file() else None


@functools.lru_cache(maxsize=16)
def packaged_table(gpu: str) -> TunedTable | None:
    """The tuned table kbit ships for ``gpu`` (:func:`packaged_path`), or None where it ships none; a shipped file
    that cannot be read is a ``ValueError`` naming its path (a broken install, never silently the built-in rules)."""
    path = packaged_path(gpu)
    return TunedTable.load(path) if path.is_file() else None


def tuned_candidate(k: int, M: int, N: int, K: int, gpu: str) -> Candidate | None:
    """What the tuned tables say for ``M`` rows on a k-bit [N, K] weight on ``gpu``, first answer wins: the user's
    table in the cache directory, then the table shipped for the GPU, each first for an entry of exactly this shape
    (:meth:`TunedTable.exact`), then each for its generalisation (:meth:`TunedTable.general_answer`: nearest tuned
    shapes, fitted rules; where the built-in choice wins on the nearest shapes, that ends the search: None); else
    None. Never searches; answers are kept per process.

    The hook a dispatcher consults before its built-in rules, on every eager launch: the tables are read once a
    process (no file access on the hot path), as the dispatcher keeps its own choices; :func:`reload_tuned` reads
    them again."""
    return _lookup(options.get().cache_dir, gpu, k, M, N, K)


@functools.lru_cache(maxsize=65536)
def _lookup(cache: str | None, gpu: str, k: int, M: int, N: int, K: int) -> Candidate | None:
    tables = [t for t in (_active(cache, gpu) if cache else None, packaged_table(gpu)) if t is not None]
    for t in tables:  # a measured entry of either table before a generalisation of either
        cand = t.exact(k, M, N, K)
        if cand is not None:
            return cand
    for t in tables:
        answered, cand = t.general_answer(k, M, N, K)
        if answered:
            return cand  # None: the built-in rules' choice won on the nearest tuned shapes
    return None


def reload_tuned() -> None:
    """Read the tuned tables again at the next lookup (e.g. after ``kbit tune`` wrote one in this process). The
    dispatcher's own caches (``kbit.dispatch.linear._choice``, ``kbit.ops.gemv_mma.PLANS``) are cleared apart."""
    _active.cache_clear()
    packaged_table.cache_clear()
    _lookup.cache_clear()


# ------------------------------------------------------------------------------------------------ the fitted rule


def serving_bucket(tuned: Iterable[int], M: int) -> int | None:
    """Of the ``tuned`` M buckets, the one that serves ``M`` rows: 1 for M = 1 (if tuned); else ``m_bucket(M)`` if
    tuned; else, up to :data:`EXTRAPOLATE_MAX` rows, the smallest tuned bucket above it up to that limit; else None."""
    if M <= 1:
        return 1 if 1 in tuned else None
    b = m_bucket(M)
    if b in tuned:
        return b
    if b > EXTRAPOLATE_MAX:
        return None
    return min((t for t in tuned if b < t <= EXTRAPOLATE_MAX), default=None)


def _m_range(tuned: tuple[int, ...], b: int) -> dict:
    """The M condition of a fitted rule for tuned bucket ``b`` (the rows :func:`serving_bucket` sends to it)."""
    if b == 1:
        return {"M_min": 1, "M_max": 1}
    i = M_BUCKETS.index(b) if b in M_BUCKETS else 0
    own = M_BUCKETS[i - 1] + 1 if i else 2  # the rows of b's own bucket
    if b <= EXTRAPOLATE_MAX:  # and those of the untuned buckets below it
        own = max((t for t in tuned if 1 < t < b), default=1) + 1
    cond = {"M_min": own}
    if b != M_BUCKETS[-1]:
        cond["M_max"] = b
    return cond


def rule_matches(cond: dict, k: int, M: int, N: int, K: int) -> bool:
    """Whether a fitted rule's conditions hold: the vocabulary and the matcher of the rule tables in
    ``configs/default.json`` (fitted rules use k, M_min, M_max, N_min, N_max, NK_min, NK_below of it)."""
    return _tmma._matches(cond, k, M, N, K, sm90=False, sms=None)


def _band(nk: int) -> tuple[int, int | None]:
    lo = 0
    for edge in NK_EDGES:
        if nk < edge:
            return lo, edge
        lo = edge
    return lo, None


def _k1_more_rounds(c: Candidate | None, key: tuple, N: int, K: int, sms: int | None) -> bool:
    """Whether ``c`` is a kernel-1 config whose CTAs take more tiles one after another on ``[N, K]`` than on the
    tuned shape of ``key`` (needs the table's ``sms``). Its time there does not carry over: a CTA streams its tiles
    in turn, so one more round adds a tile's whole stream to the launch, which stream-K kernels spread over the SMs
    (H100, 8 warps x 2 CTAs, k = 4, M = 1: 3584x18944, one tile a CTA, 16.0 us against the dispatcher's kernel 3,
    17.8; 5120x32768, two a CTA, 47.6 against 36.2; ``benchmarks/results/h100/k1-grid-ab-2026-11-27/``)."""
    if not sms or c is None or c.family != "mma" or c.config.kernel != 1:
        return False
    return _k1_rounds(c.config, N, K, sms) > _k1_rounds(c.config, key[1], key[2], sms)


def _x_form(c: Candidate | None, k: int, M: int, K: int) -> Candidate | None:
    """The form in which ``c`` runs ``M`` rows of a k-bit weight of ``K`` columns: a kernel-3 config that stages x in
    K slices stages the whole x where it fits beside the table (:func:`x_staged`); every other candidate as it is.

    Where the whole x fits, the slices lose to it (H200 tune table of 2026-11-28, kernel 3 with 16 warps, one CTA,
    ring 3: slices / whole at M = 16 1.14-1.23 (medians at k = 2..5; 1.16 at k = 4, 0.93-1.72 over 20 shapes),
    1.08-1.14 at M = 8, 1.07-1.14 at M = 4; on the held-out shapes of >= 24576x4096 at M = 16, k = 3 and 4,
    1.19-1.45 but 1.02-1.05 on 151936x2048, ``benchmarks/results/h200/xform-2026-11-29/``). A shape took the form
    its nearest tuned shapes had won with: the held-out 65536x5120 at M = 16, whose x fits, took the slices from
    59136x8192 and 57344x8192, where it does not (100.7 us; 100352x5120, the whole x, 113.8:
    ``benchmarks/results/h200/suite-midm-heldout-2026-11-29/``; with the whole x 76.0). The other way
    (the slices where the whole x does not fit) is not a rule: they won at k = 3..5 and M = 8, 16, not at k = 2
    or M = 4, and so against the nearest shapes' picks on the tune half."""
    if c is None or c.family != "mma" or c.config.kernel != 3 or not c.config.x_slice:
        return c
    whole = replace(c.config, x_smem=True, x_slice=0)
    return Candidate("mma", whole) if x_staged(k, M, -(-K // _tmma.SEG), whole) else c


def _x_stand_in(c: Candidate | None, key: tuple, K: int) -> Candidate | None:
    """The candidate whose time on the tuned shape of ``key`` stands for ``c`` on a weight of ``K`` columns (at the
    entry's rows): for kernel 3 with x in K slices that stages the whole x on ``K`` (:func:`_x_form`), that whole
    form where it fits the tuned shape too; for kernel 3 with the whole x staged on the tuned shape and not on
    ``K`` (where the plan reads x from global memory), its x-from-global form (8 warps, 2 CTAs, x staged, on
    128256x4096 at M = 8 95.6 us, against 110.0 from global memory; on the held-out 262208x5376, where x does not
    fit, 269.0 us against 233.5 for one CTA of 16 warps, H200, ``benchmarks/results/h200/midm-xglobal-2026-11-28/``);
    else ``c``."""
    if c is None or c.family != "mma" or c.config.kernel != 3:
        return c
    k, M = key[0], key[3]
    if c.config.x_slice:
        run = _x_form(c, k, M, K)
        return run if run is c else _x_form(c, k, M, key[2])
    S = -(-key[2] // _tmma.SEG)
    if x_staged(k, M, S, c.config) and not x_staged(k, M, -(-K // _tmma.SEG), c.config):
        return Candidate("mma", replace(c.config, x_smem=False))
    return c


def _k1_rounds(cfg, N: int, K: int, sms: int) -> int:
    """The items (tile, K split) the busiest CTA of a kernel-1 launch takes, at the occupancy ``cfg`` asks for."""
    Nt, S = -(-N // 16), -(-K // _tmma.SEG)
    occ = min(cfg.min_ctas, cfg.grid_ctas) if cfg.grid_ctas else cfg.min_ctas
    splits, _, grid = k1_layout(Nt, S, cfg.warps, sms * max(1, occ), sms)
    return -(-(Nt * splits) // grid)


def _slowdowns(table: TunedTable, keys: list, stand_in=None) -> dict[str, list[float]]:
    """candidate key -> its time / the shape's best, one value per entry of ``keys`` where it was timed. With
    ``stand_in(candidate, key)``: the time of the candidate it returns instead where that was timed (the shape
    asked runs the candidate as that one), infinity where it returns None (no time says anything about the shape)."""
    out: dict[str, list[float]] = defaultdict(list)
    for key in keys:
        trials = [t for t in table.trials(key) if t.us is not None]
        best = min(t.us for t in trials)
        times = {t.candidate: t.us for t in trials}
        for t in trials:
            c = stand_in(t.candidate, key) if stand_in else t.candidate
            out[t.candidate.key].append(math.inf if c is None else times.get(c, t.us) / best)
    return out


def _pick(slow: dict[str, list[float]], n: int) -> tuple[str, float, float] | None:
    """(candidate key, geomean slowdown, worst slowdown) of the candidate timed on the most of the ``n`` shapes (all,
    where some are): of those within :data:`WITHIN` of each shape's best on every shape, the smallest geometric
    mean; where none is, the smallest worst slowdown (the bar is per point: one shape far off weighs more than a
    few percent on the others)."""
    if not slow:
        return None
    cover = max(len(v) for v in slow.values())
    pool = {c: v for c, v in slow.items() if len(v) == cover}
    ok = [c for c, v in pool.items() if max(v) <= WITHIN]
    if ok:
        best = min(ok, key=lambda c: (statistics.geometric_mean(pool[c]), c))
    else:
        best = min(pool, key=lambda c: (max(pool[c]), statistics.geometric_mean(pool[c]), c))
    return best, statistics.geometric_mean(pool[best]), max(pool[best])


def _rule(cond: dict, picked: tuple[str, float, float], n: int) -> dict:
    cand_key, gm, worst = picked
    return {"if": cond, **json.loads(cand_key),
            "fit": {"shapes": n, "geomean_slowdown": round(gm, 4), "worst_slowdown": round(worst, 4)}}


def fit_rules(table: TunedTable) -> list[dict]:
    """The default rule fitted on ``table``'s entries (see the module docstring); also stored in ``table.rules``."""
    groups: dict[tuple[int, int], list] = defaultdict(list)
    for key in table.entries:
        groups[(key[0], key[3])].append(key)
    rules = []
    for (k, b), keys in sorted(groups.items()):
        m_cond = {"k": [k], **_m_range(table.buckets(k), b)}
        bands: dict[tuple, list] = defaultdict(list)
        for key in keys:
            bands[_band(key[1] * key[2])].append(key)
        for (lo, hi), bkeys in sorted(bands.items()):
            picked = _pick(_slowdowns(table, bkeys), len(bkeys))
            if picked:
                cond = {**m_cond, **({"NK_min": lo} if lo else {}), **({"NK_below": hi} if hi else {})}
                rules.append(_rule(cond, picked, len(bkeys)))
        picked = _pick(_slowdowns(table, keys), len(keys))
        if picked:
            rules.append(_rule(m_cond, picked, len(keys)))
    table.rules = rules
    return rules


def evaluate(rules: list[dict], table: TunedTable, fitted: TunedTable | None = None) -> dict:
    """How ``rules`` do on ``table``'s entries (e.g. the held-out half): per entry the time of the rule's candidate
    over the entry's best (where that candidate was timed there), and over the dispatcher's time before tuning.
    ``fitted``: judge ``fitted.lookup`` instead (its entries, nearest tuned shapes, then its rules: what the
    dispatcher does with that table). Returns {"entries", "covered", "median", "worst", "within_5pct",
    "vs_current_median", "rows": [...]}."""
    probe = fitted
    if probe is None:
        probe = TunedTable(table.gpu)
        probe.rules = rules
    rows = []
    for key in sorted(table.entries):
        k, N, K, b = key
        answered, cand = probe.answer(k, b, N, K)
        if answered and cand is None:
            cand = table.builtin_candidate(key)  # the table says: the built-in rules' choice here
        trials = {t.candidate.key: t.us for t in table.trials(key) if t.us is not None}
        best = min(trials.values())
        us = trials.get(cand.key) if cand is not None else None
        cur = table.entries[key].get("current_us")
        rows.append(dict(k=k, N=N, K=K, M=b, best_us=best, rule_us=us, slowdown=None if us is None else us / best,
                         vs_current=None if us is None or not cur else cur / us))
    sl = [r["slowdown"] for r in rows if r["slowdown"] is not None]
    vc = [r["vs_current"] for r in rows if r["vs_current"] is not None]
    return dict(entries=len(rows), covered=len(sl), median=statistics.median(sl) if sl else None,
                worst=max(sl) if sl else None, within_5pct=sum(s <= 1.05 for s in sl) / len(sl) if sl else None,
                vs_current_median=statistics.median(vc) if vc else None, rows=rows)
