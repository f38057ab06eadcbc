"""``kbit.cuda.runtime`` without a GPU: the on-disk CUBIN cache (NVRTC replaced by a counting stub) and the settings
it reads from ``kbit.options``."""

from __future__ import annotations

import os

import pytest

from kbit import options
from kbit.cuda import runtime as rt


@pytest.fixture
def stub(monkeypatch, tmp_path):
    calls = []

    def fake_compile(source, arch, options=(), name="kbit.cu", headers=None):
        calls.append((source, arch, tuple(options), name, dict(headers or {})))
        return b"\x7fELF" + f"{source}|{arch}|{len(calls)}".encode(), ""

    monkeypatch.setattr(rt, "nvrtc_compile", fake_compile)
    monkeypatch.setattr(rt, "nvrtc_version", lambda: (12, 9))
    with options.override(cache_dir=str(tmp_path / "c")):
        yield calls


def test_cache_hit_across_calls(stub, tmp_path):
    a = rt.compile_cached("src A", "sm_90")
    assert rt.compile_cached("src A", "sm_90") == a and len(stub) == 1  # the second read from disk
    files = [f for _, _, fs in os.walk(tmp_path / "c") for f in fs]
    assert len(files) == 1 and files[0].endswith(".cubin")  # no temporary left behind


def test_cache_key_covers_source_arch_options_headers_and_nvrtc(stub, monkeypatch):
    rt.compile_cached("src A", "sm_90")
    rt.compile_cached("src B", "sm_90")
    rt.compile_cached("src A", "sm_90a")
    rt.compile_cached("src A", "sm_90", ("-DX=1",))
    assert len(stub) == 4
    rt.compile_cached("src A", "sm_90", headers={"a.cuh": "int x;"})
    rt.compile_cached("src A", "sm_90", headers={"a.cuh": "int y;"})  # a header's text changed: compiled again
    rt.compile_cached("src A", "sm_90", headers={"b.cuh": "int y;"})
    assert len(stub) == 7
    rt.compile_cached("src A", "sm_90", headers={"a.cuh": "int y;"}, name="other.cu")  # the name is not the key
    assert len(stub) == 7
    monkeypatch.setattr(rt, "nvrtc_version", lambda: (13, 0))
    rt.compile_cached("src A", "sm_90")
    assert len(stub) == 8


def test_compile_passes_name_and_headers(stub):
    rt.compile_cached("src", "sm_90", ("-DK=2",), name="k.cu", headers={"h.cuh": "x"})
    assert stub[-1] == ("src", "sm_90", ("-DK=2",), "k.cu", {"h.cuh": "x"})


def test_cache_off_refresh_and_bad_files(stub, tmp_path):
    rt.compile_cached("src A", "sm_90")
    rt.compile_cached("src A", "sm_90", refresh=True)  # compiled and rewritten
    assert len(stub) == 2
    path = rt._cache_path("src A", "sm_90", ())
    with open(path, "wb") as f:  # not a CUBIN (e.g. truncated to nothing): compiled again
        f.write(b"")
    assert rt.compile_cached("src A", "sm_90")[:4] == b"\x7fELF" and len(stub) == 3
    with options.override(cache_dir=None):
        assert rt.cache_dir() is None
        rt.compile_cached("src A", "sm_90")
        rt.compile_cached("src A", "sm_90")
    assert len(stub) == 5
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with options.override(cache_dir=str(blocker / "sub")):  # cannot be created: compile without caching
        assert rt.compile_cached("src A", "sm_90")[:4] == b"\x7fELF" and len(stub) == 6


def test_cache_dir_from_options(tmp_path):
    with options.override(cache_dir=str(tmp_path)):
        assert rt.cache_dir() == str(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert options.from_environment(env).cache_dir == os.path.join(str(tmp_path), "kbit", "cubin")


def test_available_follows_the_options(monkeypatch):
    monkeypatch.setattr(rt.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rt.torch.version, "hip", None)
    monkeypatch.setattr(rt, "_nvrtc_at", lambda path: object())
    monkeypatch.setattr(rt, "_libcuda", lambda: object())
    rt._available.cache_clear()
    try:
        with options.override(cuda_kernels=True, interpret=False):
            assert rt.available()
            with options.override(cuda_kernels=False):
                assert not rt.available()
            with options.override(interpret=True):
                assert not rt.available()
            assert rt.available()
    finally:
        rt._available.cache_clear()


def test_nvrtc_library_from_options(monkeypatch):
    seen = []
    monkeypatch.setattr(rt, "_nvrtc_at", lambda path: seen.append(path))
    with options.override(nvrtc_lib="/x/libnvrtc.so"):
        rt._nvrtc()
    with options.override(nvrtc_lib=None):
        rt._nvrtc()
    assert seen == ["/x/libnvrtc.so", None]


def test_pdl_follows_the_options(monkeypatch):
    monkeypatch.setattr(rt, "_cc_major", lambda index: 9)
    with options.override(pdl=True):
        assert rt.pdl_enabled("cuda:0")
        with options.override(pdl=False):
            assert not rt.pdl_enabled("cuda:0")
    monkeypatch.setattr(rt, "_cc_major", lambda index: 8)
    with options.override(pdl=True):
        assert not rt.pdl_enabled("cuda:0")
