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


def _cache_file(tmp_path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "c") for f in fs]
    assert len(files) == 1
    return files[0]


def test_cache_file_has_length_and_checksum(tmp_path):
    path = str(tmp_path / "x" / "k.cubin")
    cubin = b"\x7fELF" + bytes(range(256)) * 3
    assert rt.write_cache_file(path, cubin)
    data = open(path, "rb").read()
    assert data.startswith(rt.CACHE_MAGIC) and data.endswith(cubin) and len(data) == len(cubin) + 48
    assert rt.read_cache_file(path) == cubin
    assert os.listdir(tmp_path / "x") == ["k.cubin"]  # no temporary left behind
    assert rt.read_cache_file(str(tmp_path / "none.cubin")) is None


@pytest.mark.parametrize("damage", ["truncate", "truncate_header", "flip_cubin", "flip_header", "append", "headerless",
                                    "empty", "not_elf"])
def test_damaged_cache_file_is_deleted_never_returned(tmp_path, damage):
    path = str(tmp_path / "k.cubin")
    cubin = b"\x7fELF" + os.urandom(1000)
    rt.write_cache_file(path, cubin)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "truncate_header":
        data = data[:20]
    elif damage == "flip_cubin":
        data[500] ^= 0x10
    elif damage == "flip_header":
        data[20] ^= 0x01
    elif damage == "append":
        data += b"\0"
    elif damage == "headerless":  # a file of the old cache: a bare CUBIN
        data = bytearray(cubin)
    elif damage == "empty":
        data = bytearray()
    elif damage == "not_elf":  # a consistent header around something that is not a CUBIN
        rt.write_cache_file(path, b"MZ" + cubin[4:])
        data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(data))
    assert rt.read_cache_file(path) is None
    assert not os.path.exists(path)


def test_damaged_cache_file_is_compiled_again(stub, tmp_path):
    a = rt.compile_cached("src A", "sm_90")
    path = _cache_file(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # a flipped byte, the ELF magic intact
    open(path, "wb").write(bytes(data))
    assert rt._compile_cached("src A", "sm_90", (), "kbit.cu", None, False) == (b"\x7fELF" + b"src A|sm_90|2", False)
    assert len(stub) == 2 and a != rt.compile_cached("src A", "sm_90") and len(stub) == 2  # rewritten, then read
    open(path, "wb").write(open(path, "rb").read()[:-5])  # truncated
    rt.compile_cached("src A", "sm_90")
    assert len(stub) == 3


def test_cache_write_is_exclusive_and_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "k.cubin")
    opened = []
    real_open = os.open

    def spy(p, flags, mode=0o777):
        opened.append((p, flags))
        return real_open(p, flags, mode)

    monkeypatch.setattr(rt.os, "open", spy)
    assert rt.write_cache_file(path, b"\x7fELF1") and rt.write_cache_file(path, b"\x7fELF2")
    assert len(opened) == 2 and opened[0][0] != opened[1][0]  # a fresh temporary name each time
    assert all(p.startswith(path + ".") and p.endswith(".tmp") and f & os.O_EXCL and f & os.O_CREAT for p, f in opened)
    assert rt.read_cache_file(path) == b"\x7fELF2"
    # a planted file at the temporary's name is never written through: O_EXCL fails, the cache is skipped
    monkeypatch.setattr(rt.uuid, "uuid4", lambda: type("U", (), {"hex": "fixed"})())
    planted = f"{path}.{os.getpid()}.fixed.tmp"
    open(planted, "wb").write(b"planted")
    assert not rt.write_cache_file(path, b"\x7fELF3")
    assert open(planted, "rb").read() == b"planted" and rt.read_cache_file(path) == b"\x7fELF2"


def test_failed_cache_write_leaves_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "k.cubin")

    def broken_replace(a, b):
        raise OSError("rename failed")

    monkeypatch.setattr(rt.os, "replace", broken_replace)
    assert not rt.write_cache_file(path, b"\x7fELF")
    assert os.listdir(tmp_path) == []
