"""The dispatcher consuming a tuned table (``kbit tune``) from the cache directory: CPU only, the GPU's facts faked."""
from __future__ import annotations

import types

import pytest
import torch

from kbit import options
from kbit.dispatch import linear as D
from kbit.ops import gemv_mma
from kbit.tuning import tuned
from kbit.tuning.gemm import Choice, GemmConfig
from kbit.tuning.mma import LargeConfig, MmaConfig
from kbit.tuning.space import Candidate
from kbit.tuning.tuned import Trial, TunedTable, default_path
from kbit.utils import device as udev


@pytest.fixture
def h100(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132, name="H100"))
    # these tests are about the user's table alone: the table kbit ships for the H100 is hidden
    monkeypatch.setattr(tuned, "packaged_path", lambda gpu: tmp_path / "no-packaged-table.json")
    udev._sm_count.cache_clear()
    tuned.reload_tuned()
    with options.override(cache_dir=str(tmp_path)):
        yield torch.device("cuda", 0)
    udev._sm_count.cache_clear()
    tuned.reload_tuned()


def _save(entries):
    t = TunedTable("h100")
    for (k, M, N, K), cand in entries.items():
        t.add(k, N, K, M, [Trial(cand, 10.0)])
    t.save(default_path("h100"))


def test_no_table_changes_nothing(h100):
    assert D.tuned_choice(16, 28672, 4096, 4, h100, mma=True, large=True) is None
    want = gemv_mma._tmma.default_config(4, 16, 28672, 4096, sm90=True, sms=132, gpu="h100")
    assert gemv_mma.launch_config(4, 16, 28672, 4096, h100) == want


def test_tuned_entries_reach_the_dispatcher(h100):
    k3 = MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=8)
    fused = GemmConfig(BM=16, BN=64, BK=128, num_stages=4)
    _save({(4, 16, 28672, 4096): Candidate("mma", k3), (4, 64, 28672, 4096): Candidate("large", LargeConfig(8, 8)),
           (4, 256, 28672, 4096): Candidate("dequant_mm"), (4, 32, 28672, 4096): Candidate("fused", fused)})
    assert D.tuned_choice(16, 28672, 4096, 4, h100, mma=True, large=True) == Choice("gemv")
    assert D.tuned_choice(200, 28672, 4096, 4, h100, mma=True, large=True) == Choice("dequant_mm")
    assert D.tuned_choice(32, 28672, 4096, 4, h100, mma=True, large=True) == Choice("fused", fused)
    assert D.tuned_choice(64, 28672, 4096, 4, h100, mma=True, large=False) is None  # kernel 7 does not run there
    assert D.tuned_choice(16, 4096, 4096, 4, h100, mma=True, large=True) == Choice("gemv")  # the nearest shape's
    # M's own bucket; up to 16 rows the next tuned one; M = 1 only by bucket 1
    assert D.tuned_choice(2, 4096, 4096, 4, h100, mma=True, large=True) == Choice("gemv")  # bucket 16's
    assert D.tuned_choice(20, 28672, 4096, 4, h100, mma=True, large=True) == Choice("fused", fused)  # bucket 32's
    assert D.tuned_choice(1, 4096, 4096, 4, h100, mma=True, large=True) is None  # no bucket 1, no rule
    assert D.tuned_choice(100, 28672, 4096, 4, h100, mma=True, large=True) is None  # bucket 128 not tuned
    assert D.tuned_choice(300, 28672, 4096, 4, h100, mma=True, large=True) is None  # above bucket 256
    assert gemv_mma.launch_config(4, 16, 28672, 4096, h100) == k3
    assert gemv_mma._large_here(4, 64, 28672, 4096, h100) and not gemv_mma._large_here(4, 16, 28672, 4096, h100)
