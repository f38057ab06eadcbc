"""Which files under benchmarks/results/ are cited, and which references point at nothing.

A file is cited when a tracked file outside benchmarks/results (docs, README, code, tests, configs) or a cited
results file names it: as a path (``benchmarks/results/h100/x.json``, or below the results folder:
``h100/x.json``), as a run's folder (``h100/m16-2026-11-27/``: every file in it; without the GPU folder, in any of
them), by its name at the end of another path (``/root/out/x.json``, as a device run names it), as a bare name
(``x.json``, or its stem ``x``), through a pattern (``x-run*.log``, ``x.{json,md}``) or as a tail after its sibling
(``x-a.md``, ``-b.md``). A bare name counts for every GPU folder holding it.

    PYTHONPATH=src python lab/results_refs.py            # counts, uncited files, broken references
    PYTHONPATH=src python lab/results_refs.py --cited    # the cited files too, each with one citing file

Exit status 1 when a ``results/<gpu>/...`` reference matches no file.
"""

import argparse
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = "benchmarks/results/"
# a path-like word; brace groups ({json,md}) may hold commas
TOKEN = re.compile(r"(?:[\w.*?/<>-]|\{[\w.,*-]*\})+")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def expand(pattern: str) -> list[str]:
    """``a.{json,md}`` -> ``a.json``, ``a.md`` (nested groups are not used in the repository)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


class Index:
    """Results files (paths relative to benchmarks/results) by name and by stem, and a memo of the words seen."""

    def __init__(self, files: list[str]):
        self.files, self.by_name, self.memo = files, {}, {}
        self.folders = {f.split("/", 1)[0] for f in files}  # h100, h200x2, cpu, ...
        for f in files:
            name = f.split("/", 1)[1]
            stem = name.split(".", 1)[0]
            self.by_name.setdefault(name, set()).add(f)
            if len(stem) >= 8 and "-" in stem:  # `e2e-llama-2026-11-22` names the .json and the .md
                self.by_name.setdefault(stem, set()).add(f)

    def matches(self, token: str) -> tuple[set[str], bool]:
        """The files a word names, and whether it is a ``results/<gpu>/...`` path."""
        if token not in self.memo:
            self.memo[token] = self._matches(token.rstrip(".,"))
        return self.memo[token]

    def suffix(self, tail: str, text: str) -> set[str]:
        """`-run1.json` after `mma-2026-11-21-issue3.md` names mma-2026-11-21-issue3-run1.json: a file whose name
        (or stem) ends with the word and whose other part is in the citing text."""
        return {f for key, fs in self.by_name.items() if key.endswith(tail) and len(key) > len(tail) + 3
                and key[:-len(tail)] in text for f in fs}

    def _path(self, rel: str) -> tuple[set[str], bool]:
        """A path below benchmarks/results: a file (or pattern), or a run's folder (``h100/m16-2026-11-27/``: every
        file in it)."""
        if rel.endswith("/") and rel.count("/") >= 2:
            return {f for f in self.files if f.startswith(rel)}, True
        if "/" not in rel or rel.endswith(("/", "-")):  # a GPU folder, or a name split over two lines
            return set(), False
        return {f for p in expand(rel) for f in self.files if fnmatch.fnmatchcase(f, p)}, True

    def _matches(self, token: str) -> tuple[set[str], bool]:
        if "<" in token:  # a template such as <gpu>/<name>-<date>.json
            return set(), False
        if "results/" in token:
            return self._path(token.split("results/", 1)[1])
        if "/" in token and token.split("/", 1)[0] in self.folders:
            return self._path(token)  # `h200x2/tp-2026-11-26c.md`: below benchmarks/results, as the notes write it
        if "/" in token:  # `k1split-ab-2026-11-27/` or `.../huge-m1.log`: a run's folder in some GPU folder
            found = {f for g in self.folders for f in self._path(f"{g}/{token}")[0]}
            tail = token.rsplit("/", 1)[1]  # else a file by its name (`/root/out/x.json`: as a device run wrote it)
            return (found or (self._matches(tail)[0] if tail else set())), False
        found = set()
        for p in expand(token):
            wild = re.search(r"[*?[]", p)
            if not wild:
                found |= self.by_name.get(p, set())
            elif wild.start() >= 4:  # `*.json` alone names no particular file
                found |= {f for f in self.files if fnmatch.fnmatchcase(f.split("/", 1)[1], p)}
        return found, False


def scan(paths: list[str], index: Index, cites: dict, broken: list) -> set[str]:
    new = set()
    for path in paths:
        try:
            text = (ROOT / path).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        beside = set() if path.startswith(RES) else {p.name for p in (ROOT / path).parent.iterdir()}
        for tok in set(TOKEN.findall(text)):
            if "/" not in tok and tok.rstrip(".,") in beside:
                continue  # a link to a file beside the citing one: docs/notes/README.md -> sampling.md
            found, is_path = index.matches(tok)
            if re.fullmatch(r"-[a-z]\w[\w.-]+", tok.rstrip(".,")):
                found = found | index.suffix(tok.rstrip(".,"), text)
            if is_path and not found:
                broken.append((path, tok))
            for f in found:
                if f not in cites and RES + f != path:
                    cites[f] = path
                    new.add(f)
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cited", action="store_true", help="list the cited files too")
    args = ap.parse_args(argv)
    every = tracked()
    files = sorted(p[len(RES):] for p in every if p.startswith(RES))
    me = str(Path(__file__).resolve().relative_to(ROOT))
    cites, broken = {}, []
    index = Index(files)
    new = scan([p for p in every if not p.startswith(RES) and p != me], index, cites, broken)
    while new:  # a cited results file cites others in turn
        new = scan([RES + f for f in sorted(new)], index, cites, broken)
    uncited = [f for f in files if f not in cites]
    print(f"{len(files)} files: {len(cites)} cited, {len(uncited)} uncited, {len(broken)} broken references")
    if args.cited:
        print("\ncited (file <- one citing file):")
        print("\n".join(f"  {f} <- {cites[f]}" for f in sorted(cites)))
    print("\nuncited:")
    stems = {f.split(".", 1)[0] for f in cites}
    print("\n".join(f"  {f}" + ("  (same run as a cited file)" if f.split(".", 1)[0] in stems else "")
                    for f in uncited))
    if broken:
        print("\nbroken (citing file: reference):")
        print("\n".join(f"  {p}: {t}" for p, t in sorted(set(broken))))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
