"""Rebuild the judges' caches on a machine that has neither the judge packages nor the tokenizers (the GPU machine,
reached through the device tool, whose carry is 64 MiB a call): the GGUF files travel as byte slices in several
calls, this joins them, checks each file against the manifest's size and MD5, and writes what
``rotation_gptq_study.load(name, tokenizer=False)`` reads (``/tmp/kbit-judges/<name>/config.json`` and
``weights.pt``, the GGUF dequantized by transformers, which needs the ``gguf`` package).

Made here (this machine has the packages): ``python lab/quality/judge_parts.py --split DIR`` writes
``DIR/meta/manifest.json``, ``DIR/meta/<name>-ids.pt`` (the Lee corpus as that judge's token ids, for
``k2_library.py --ids``) and ``DIR/p<i>/part<i>``. There: ``python lab/quality/judge_parts.py --join PARTS --meta
DIR/meta`` (PARTS: the folder the parts were copied to).

``--wiki DIR`` writes ``DIR/<name>-wiki-ids.pt``: the Wikipedia extract gensim ships beside the Lee corpus (about 100
articles, 3 MB of text once the markup is stripped) as each judge's token ids, tuning text for
``k2_library.py --tune-ids`` that shares nothing with the Lee evaluation text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import rotation_gptq_study as study  # this file's folder is on sys.path
import torch

NAMES = ("smollm2", "gemma3")
SLICE = 50_210_780  # with the ~14 MB working tree, one slice a call stays under the 64 MiB carry


def split(out: Path) -> None:
    from kbit.eval.judges import lee_text

    meta = out / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    blob, files = b"", []
    for name in NAMES:
        data = study._gguf_path(name).read_bytes()
        files.append({"name": name, "bytes": len(data), "md5": hashlib.md5(data).hexdigest()})
        blob += data
        _, tok = study.load(name)
        torch.save(tok(lee_text(), return_tensors="pt").input_ids[0].to(torch.int32), meta / f"{name}-ids.pt")
    parts = -(-len(blob) // SLICE)
    for i in range(parts):
        (out / f"p{i}").mkdir(exist_ok=True)
        (out / f"p{i}" / f"part{i}").write_bytes(blob[i * SLICE:(i + 1) * SLICE])
    (meta / "manifest.json").write_text(json.dumps({"files": files, "parts": parts, "slice": SLICE}, indent=1))


WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def wiki_text() -> str:
    """The articles of gensim's Wikipedia test extract as plain text: markup stripped by gensim's own
    ``filter_wiki``, redirects dropped, and only lines of at least 40 characters kept (the rest are table cells,
    captions and headings)."""
    import bz2
    import os

    import gensim
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", WIKI)
    articles = []
    for _title, text, _id in extract_pages(bz2.BZ2File(path)):
        if text.lower().startswith("#redirect"):
            continue
        lines = (ln.replace("'''", "").replace("''", "").strip() for ln in filter_wiki(text).splitlines())
        articles.append("\n".join(ln for ln in lines if len(ln) >= 40))
    return "\n\n".join(a for a in articles if a)


def wiki_ids(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = wiki_text()
    for name in NAMES:
        _, tok = study.load(name)
        ids = tok(text, return_tensors="pt").input_ids[0].to(torch.int32)
        torch.save(ids, out / f"{name}-wiki-ids.pt")
        print(f"{name}: {ids.numel()} tokens of Wikipedia text -> {out / f'{name}-wiki-ids.pt'}", flush=True)


def join(parts: Path, meta: Path) -> None:
    from transformers import AutoModelForCausalLM  # optional dependency of the study

    man = json.loads((meta / "manifest.json").read_text())
    blob = b"".join((parts / f"part{i}").read_bytes() for i in range(man["parts"]))
    at = 0
    for f in man["files"]:
        data = blob[at:at + f["bytes"]]
        at += f["bytes"]
        if len(data) != f["bytes"] or hashlib.md5(data).hexdigest() != f["md5"]:
            raise SystemExit(f"{f['name']}: the joined GGUF does not match the manifest (a part missing or damaged)")
        gguf = parts / f"{f['name']}.gguf"
        gguf.write_bytes(data)
        model = AutoModelForCausalLM.from_pretrained(str(parts), gguf_file=gguf.name, dtype=torch.float32)
        cached = study.CACHE / f["name"]
        cached.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(cached)
        torch.save(model.state_dict(), cached / "weights.pt")
        print(f"{f['name']}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {cached}",
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--split", type=Path, help="write the parts, manifest and token ids here")
    g.add_argument("--join", type=Path, help="the folder holding part0 .. partN-1")
    g.add_argument("--wiki", type=Path, help="write each judge's token ids of gensim's Wikipedia extract here")
    p.add_argument("--meta", type=Path, help="with --join: the folder of manifest.json")
    a = p.parse_args(argv)
    if a.split is not None:
        split(a.split)
    elif a.wiki is not None:
        wiki_ids(a.wiki)
    else:
        join(a.join, a.meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
