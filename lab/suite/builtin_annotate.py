"""Records in each entry of a tuned table which trial is the built-in rules' choice (``"builtin"``), for tables
written before the tuner recorded it; :meth:`kbit.tuning.tuned.TunedTable.nearest` weighs that choice. The choice
is the current code's built-in rules, asked on this CPU with the GPU's facts given (sm_90, its SM count and name);
an entry whose trials do not hold it gets none.

    PYTHONPATH=src python lab/suite/builtin_annotate.py IN_JSON OUT_JSON [--sms 132 --name "NVIDIA H100 80GB HBM3"]
"""
from __future__ import annotations

import argparse
import contextlib
import types
from unittest import mock

import torch

from kbit.bench import tune as T
from kbit.tuning.tuned import TunedTable, fit_rules
from kbit.utils import device as udev


@contextlib.contextmanager
def gpu_facts(sms: int = 132, name: str = "NVIDIA H100 80GB HBM3"):
    """Inside: ``torch.cuda`` answers as an sm_90 GPU of ``sms`` SMs named ``name``, with the CUDA kernels."""
    props = types.SimpleNamespace(multi_processor_count=sms, name=name)
    with mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)), \
            mock.patch.object(torch.cuda, "get_device_name", lambda device=None: name), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props), \
            mock.patch.object(T, "kernels_available", lambda device: True):
        udev._sm_count.cache_clear()
        try:
            yield torch.device("cuda", 0)
        finally:
            udev._sm_count.cache_clear()


def annotate(table: TunedTable, dev) -> tuple[int, int]:
    """Sets each entry's ``"builtin"``; returns (entries that got one, entries whose trials lack it)."""
    got = missing = 0
    for key, e in table.entries.items():
        k, N, K, b = key
        own = T.builtin_candidate(k, b, N, K, dev)
        timed = {t.candidate for t in table.trials(key) if t.us is not None}
        if own is not None and own in timed:
            e["builtin"] = own.as_dict()
            got += 1
        else:
            e["builtin"] = None
            missing += 1
    return got, missing


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("inp")
    p.add_argument("out")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--name", default="NVIDIA H100 80GB HBM3")
    a = p.parse_args()
    table = TunedTable.load(a.inp)
    with gpu_facts(a.sms, a.name) as dev:
        got, missing = annotate(table, dev)
    rules = fit_rules(table)
    table.meta["builtin"] = "built-in choice recorded per entry by lab/suite/builtin_annotate.py"
    table.save(a.out)
    print(f"{got} entries record the built-in choice, {missing} do not; {len(rules)} rules -> {a.out}")


if __name__ == "__main__":
    main()
