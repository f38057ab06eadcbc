"""The on-disk CUBIN cache of ``kbit.cuda.runtime`` (CPU: NVRTC replaced by a counting stub)."""

from __future__ import annotations

import os

import pytest

from kbit.cuda import runtime as rt


@pytest.fixture
def stub(monkeypatch, tmp_path):
    calls = []

    def fake_compile(source, arch, options=(), name="kbit.cu"):
        calls.append((source, arch, tuple(options)))
        return b"\x7fELF" + f"{source}|{arch}|{len(calls)}".encode(), ""

    monkeypatch.setattr(rt, "nvrtc_compile", fake_compile)
    monkeypatch.setattr(rt, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setenv("KBIT_CACHE_DIR", str(tmp_path / "c"))
    return calls


def test_cache_hit_across_calls(stub, tmp_path):
    a = rt.compile_cached("src A", "sm_90")
    assert rt.compile_cached("src A", "sm_90") == a and len(stub) == 1  # the second read from disk
    files = [f for _, _, fs in os.walk(tmp_path / "c") for f in fs]
    assert len(files) == 1 and files[0].endswith(".cubin")  # no temporary left behind


def test_cache_key_covers_source_arch_options_and_nvrtc(stub, monkeypatch):
    rt.compile_cached("src A", "sm_90")
    rt.compile_cached("src B", "sm_90")
    rt.compile_cached("src A", "sm_90a")
    rt.compile_cached("src A", "sm_90", ("-lineinfo",))
    assert len(stub) == 4
    monkeypatch.setattr(rt, "nvrtc_version", lambda: (13, 0))
    rt.compile_cached("src A", "sm_90")
    assert len(stub) == 5


def test_cache_off_refresh_and_bad_files(stub, monkeypatch, tmp_path):
    rt.compile_cached("src A", "sm_90")
    rt.compile_cached("src A", "sm_90", refresh=True)  # compiled and rewritten
    assert len(stub) == 2
    path = rt._cache_path("src A", "sm_90", ())
    with open(path, "wb") as f:  # not a CUBIN (e.g. truncated to nothing): compiled again
        f.write(b"")
    assert rt.compile_cached("src A", "sm_90")[:4] == b"\x7fELF" and len(stub) == 3
    for off in ("0", ""):
        monkeypatch.setenv("KBIT_CACHE_DIR", off)
        assert rt.cache_dir() is None
        rt.compile_cached("src A", "sm_90")
    assert len(stub) == 5
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("KBIT_CACHE_DIR", str(blocker / "sub"))  # cannot be created: compile without caching
    assert rt.compile_cached("src A", "sm_90")[:4] == b"\x7fELF" and len(stub) == 6


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("KBIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert rt.cache_dir() == os.path.join(str(tmp_path), "kbit", "cubin")
