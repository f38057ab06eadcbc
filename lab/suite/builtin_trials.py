"""One-off repair of a tuned table from a tuner that did not time the built-in rules' own choice (before commit
bfaff14): each entry gets that choice as a trial, timed as the dispatcher was (``current_us``, the dispatcher's time
with no table installed, which is that choice), then the rules are fitted again. The GPU's facts are given, not
asked (this runs on a CPU): sm_90, the SM count, the CUDA kernels available.

    PYTHONPATH=src python lab/suite/builtin_trials.py IN_JSON OUT_JSON --sms 132

The dispatcher was timed first in each entry of those runs, which favours it by up to ~16% at compute-bound M (the
tuner now re-times finalists beside it): entries therefore lean to keeping the built-in choice.
"""
from __future__ import annotations

import argparse
import types
from unittest import mock

import torch

from kbit.bench import tune as T
from kbit.tuning.space import Candidate
from kbit.tuning.tuned import Trial, TunedTable, fit_rules
from kbit.utils import device as udev


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("inp")
    p.add_argument("out")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--name", default="NVIDIA H200")
    a = p.parse_args()
    table = TunedTable.load(a.inp)
    dev = torch.device("cuda", 0)
    props = types.SimpleNamespace(multi_processor_count=a.sms, name=a.name)
    added = kept = 0
    with mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)), \
            mock.patch.object(torch.cuda, "get_device_name", lambda device=None: a.name), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props), \
            mock.patch.object(T, "kernels_available", lambda device: True):
        udev._sm_count.cache_clear()
        for (k, N, K, b), e in table.entries.items():
            own: Candidate | None = T.builtin_candidate(k, b, N, K, dev)
            trials = table.trials((k, N, K, b))
            if own is None or not e.get("current_us") or any(t.candidate == own for t in trials):
                kept += 1
                continue
            trials.append(Trial(own, float(e["current_us"])))
            best = min((t for t in trials if t.us is not None), key=lambda t: t.us)
            e["trials"] = [t.as_dict() for t in trials]
            e["best"] = best.as_dict()
            added += 1
    rules = fit_rules(table)
    table.meta["repair"] = "built-in choice added as a trial timed as the dispatcher (lab/suite/builtin_trials.py)"
    table.save(a.out)
    print(f"{added} entries got the built-in choice as a trial, {kept} had it or none; {len(rules)} rules -> {a.out}")


if __name__ == "__main__":
    main()
