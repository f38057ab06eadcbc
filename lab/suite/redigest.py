"""Carry a tuned table's code digests over to the scheme of ``kbit.tuning.code`` (what the code does: no comments,
docstrings or layout) where the code each entry was timed on can be found in this repository's history (CPU):

    PYTHONPATH=src python lab/suite/redigest.py src/kbit/tuning/configs/tuned-h200.json [--write]

Tables written before that scheme hold digests of the files' raw bytes (``_raw_digest``, the old
``kbit.tuning.code.code_digest``). For each (family, raw digest) the table's entries hold, the commits that touched
the family's files (``git rev-list HEAD``, newest first) are read back, each with the headers its CUDA sources
include at that commit (``code_files`` over the commit's files), until one's raw digest equals the stored one. The
raw digest covers the paths as well as the bytes, so a match says the entry was timed on exactly that commit's
family files; the digest of the new scheme over them replaces the stored one. Nothing is guessed: a stored digest
no commit matches (a run on uncommitted files, a family whose files moved) stays as it is, and so stale.

Prints per family the entries that record it, how many matched a commit and how many are now fresh (the new digest
equals that of the files installed now, as ``TunedTable.stale`` compares); the whole table is written back only
with ``--write``, through ``TunedTable.save`` in the file's own form (one line where it is one line).
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from kbit.tuning import code as C  # noqa: E402
from kbit.tuning.tuned import TunedTable  # noqa: E402

#: where the package lies in the repository (CODE_FILES' paths are relative to it)
PACKAGE = "src/kbit"


def _raw_digest(family: str, root: Path) -> str:
    """The digest tables recorded before ``kbit.tuning.code`` normalized the files: SHA-256 over the family's paths
    and raw bytes (a private copy: the package no longer has it)."""
    h = hashlib.sha256()
    for rel in C.code_files(family, root):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


class _Git:
    """Blobs of the repository at ``top`` through one ``git cat-file --batch`` (hundreds of commits are read)."""

    def __init__(self, top: Path):
        self.top = top
        self.cat = subprocess.Popen(["git", "cat-file", "--batch"], cwd=top, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)

    def run(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.top, check=True, capture_output=True, text=True).stdout

    def show(self, rev: str, path: str) -> bytes | None:
        """``git show rev:path``, or None where the commit has no such file."""
        self.cat.stdin.write(f"{rev}:{path}\n".encode())
        self.cat.stdin.flush()
        head = self.cat.stdout.readline().split()
        if len(head) != 3 or head[1] != b"blob":
            return None  # "<rev:path> missing"
        data = self.cat.stdout.read(int(head[2]))
        self.cat.stdout.read(1)  # the newline after each blob
        return data

    def tree(self, rev: str, family: str, root: Path) -> bool:
        """Writes the family's files at ``rev`` under ``root`` as the package lays them out, with every CUDA source
        and header of the commit's csrc folder (``code_files`` then follows the includes as at that commit); False
        where the commit lacks a listed file."""
        csrc = self.run("ls-tree", "--name-only", rev, f"{PACKAGE}/cuda/csrc/").split()
        rels = set(C.CODE_FILES[family]) | {p[len(PACKAGE) + 1:] for p in csrc if p.endswith((".cu", ".cuh"))}
        for rel in rels:
            data = self.show(rev, f"{PACKAGE}/{rel}")
            if data is None:
                if rel in C.CODE_FILES[family]:
                    return False
                continue
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return True


def carry(git: _Git, family: str, wanted: set[str]) -> dict[str, tuple[str, str]]:
    """{raw digest: (commit, new digest)} for the ``wanted`` raw digests of ``family`` some commit's files have."""
    paths = [f"{PACKAGE}/{rel}" for rel in C.CODE_FILES[family]] + [f"{PACKAGE}/cuda/csrc"]
    found: dict[str, tuple[str, str]] = {}
    for rev in git.run("rev-list", "HEAD", "--", *paths).split():
        if not wanted - set(found):
            break
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            if not git.tree(rev, family, root):
                continue
            try:
                raw = _raw_digest(family, root)
                if raw in wanted and raw not in found:
                    found[raw] = (rev, C.code_digest(family, root))
            except (OSError, SyntaxError, UnicodeDecodeError):  # an include that is not there, a file not parsed
                continue
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a tuned table (e.g. src/kbit/tuning/configs/tuned-h200.json)")
    ap.add_argument("--write", action="store_true", help="write the table back with the carried digests")
    args = ap.parse_args(argv)

    path = Path(args.table)
    table = TunedTable.load(path)
    git = _Git(Path(__file__).resolve().parents[2])
    stored: dict[str, Counter] = {}  # family -> Counter of the raw digests its entries hold
    for e in table.entries.values():
        for fam, d in (e.get("code") or {}).items():
            stored.setdefault(fam, Counter())[d] += 1
    print(f"{path}: {len(table.entries)} entries, {sum(1 for e in table.entries.values() if e.get('code'))} "
          f"record digests; stale before: {sum(table.stale(key) for key in table.entries)}")
    now = C.family_digests(f for f in stored if f in C.CODE_FILES)
    carried: dict[tuple[str, str], str] = {}
    for fam, digests in sorted(stored.items()):
        if fam not in C.CODE_FILES:
            print(f"  {fam}: not a family of this kbit, left as it is")
            continue
        found = carry(git, fam, set(digests))
        matched = fresh = 0
        for d, n in sorted(digests.items()):
            rev, new = found.get(d, (None, None))
            if rev is None:
                print(f"    {fam} {d}: {n} entries, no commit's files have it (left stale)")
                continue
            carried[(fam, d)] = new
            matched += n
            fresh += n * (new == now[fam])
            print(f"    {fam} {d}: {n} entries, commit {rev[:10]} -> {new}"
                  f"{' (fresh)' if new == now[fam] else ' (the files changed since: stale)'}")
        print(f"  {fam}: {sum(digests.values())} entries, {matched} matched a commit, {fresh} now fresh")
    for e in table.entries.values():
        if e.get("code"):
            e["code"] = {fam: carried.get((fam, d), d) for fam, d in e["code"].items()}
    print(f"stale after: {sum(table.stale(key) for key in table.entries)} of {len(table.entries)}")
    if args.write:
        one_line = path.read_text().count("\n") <= 1  # the packaged tables are one line (TunedTable.save)
        table.save(path, indent=None if one_line else 1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
