"""The CUDA sources as files (``kbit/cuda/csrc``), checked without a GPU: every kernel of the contract defined once
in its file, shipped as package data, no lab variants or source patching; with NVRTC loadable, every kernel file
compiles for sm_90 and a compile error names the real file."""

from __future__ import annotations

import fnmatch
import glob
import os
import re

import pytest
import tomllib

from kbit import options
from kbit.cuda import runtime, sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_PY = os.path.join(ROOT, "src", "kbit", "cuda")


def _files():
    return sorted(os.listdir(sources.CSRC))


def test_every_kernel_file_exists_and_nothing_else():
    headers = [f for f in _files() if f.endswith(".cuh")]
    assert sorted(sources.KERNELS) == [f for f in _files() if f.endswith(".cu")]
    assert headers and set(_files()) == set(sources.KERNELS) | set(headers)
    assert sorted(sources.headers()) == headers


def test_csrc_files_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["kbit"]
    for f in _files():
        rel = f"cuda/csrc/{f}"
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)


@pytest.mark.parametrize("file", sorted(sources.KERNELS))
def test_each_extern_name_defined_once(file):
    text = sources.read_source(file)
    defined = re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(', text)
    assert sorted(defined) == sorted(sources.KERNELS[file])  # each once, and no kernel outside the contract


@pytest.mark.parametrize("file", _files())
def test_no_lab_variants_and_known_includes(file):
    text = sources.read_source(file)
    assert not re.search(r"#\s*(el)?if.*\bKERNEL\b", text)
    assert "LAB_" not in text and "WS4U" not in text and "TLS(" not in text
    assert not re.search(r"session\s*[0-9]", text, re.I)
    for inc in re.findall(r'#include\s+"([^"]+)"', text):
        assert inc in sources.headers(), inc
    assert not re.search(r"#include\s+<", text)  # NVRTC gets no system headers


@pytest.mark.parametrize("file", sorted(sources.KERNELS))
def test_kernel_files_document_their_defines(file):
    head = sources.read_source(file)[:4000]
    assert head.startswith("/*") and re.search(r"[Dd]efines", head)


def test_no_cuda_in_python_strings():
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CUDA_PY, "*.py")))
    assert names == ["__init__.py", "runtime.py", "sources.py"]
    for n in names:
        text = open(os.path.join(CUDA_PY, n)).read()
        assert not re.search(r'(?<!os)\.replace\(', text)  # no source patching (os.replace: the cache's rename)
        assert "__global__" not in text and "#define" not in text


def test_define_options_and_unknown_kernel():
    assert sources.define_options({"NG": 2, "K_BITS": 4, "DET": True}) == ("-DDET=1", "-DK_BITS=4", "-DNG=2")
    with pytest.raises(ValueError, match="kernel"):
        sources.compile_kernel("gemv_mma_split.cu", "kbit_nope", {}, "cuda:0")


def _nvrtc_ok() -> bool:
    try:
        runtime.nvrtc_version()
    except Exception:  # noqa: BLE001 - no NVRTC here: the compile tests are skipped
        return False
    return True


#: a define set kbit.ops builds for each file
DEFINES = {
    "gemv_mma_split.cu": dict(K_BITS=4, NG=1, MAXW=8, MINB=2, BF16=0, FP16_SCALES=0, WS4=0, L2PF=16384, K1EARLY=1,
                              M1=1, K1WO=1),
    "gemv_mma_streamk.cu": dict(K_BITS=3, NG=1, MAXW=8, MINB=2, PD=3, XS=1, XK=0, BF16=1, FP16_SCALES=0, WS4=0,
                                M1=1, CAU=1, LFW=2),
    "mma_pipe.cu": dict(K_BITS=4, NG=4, D=2, MAXW=8, MINB=1, RT=1, BF16=0, FP16_SCALES=1, WS4=1),
    "grouped_mma_pipe.cu": dict(K_BITS=2, NG=1, D=2, MAXW=4, MINB=1, RT=1, BF16=1, FP16_SCALES=0),
    "wgmma.cu": dict(K_BITS=4, NG=8, D=6, MAXW=16, SK=1, BF16=0, FP16_SCALES=0, WS4=1),
    "x_tiles.cu": {},
    "dequant_mma.cu": dict(K_BITS=5, FP16_SCALES=0, BF16=1, VEC=1),
    "moe_blocks.cu": {},
    "grouped_mma.cu": dict(K_BITS=2, NG=2, MAXW=8, MINB=2, BF16=0, FP16_SCALES=1),
    "dequant.cu": dict(K_BITS=3, BLOCKSIZE=64, FP16_SCALES=0, OUT=1, VEC=1, U=4),
    "read.cu": dict(U=4, PDL=1),
}


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC not loadable here (options.nvrtc_lib / KBIT_NVRTC_LIB)")
@pytest.mark.parametrize("file", sorted(sources.KERNELS))
def test_kernel_files_compile_for_sm90(file):
    arch = "sm_90a" if file in sources.ARCH_SPECIFIC else "sm_90"
    with options.override(cache_dir=None):
        cubin = sources.compile_source(file, DEFINES[file], arch)
    assert cubin[:4] == b"\x7fELF"
    for name in sources.KERNELS[file]:
        assert name.encode() in cubin


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC not loadable here (options.nvrtc_lib / KBIT_NVRTC_LIB)")
def test_compile_error_names_the_header():
    bad = {**DEFINES["mma_pipe.cu"], "NG": 1, "WS4": 1}  # WS4 needs NG > 1: an #error in splitk.cuh
    with options.override(cache_dir=None), pytest.raises(runtime.NvrtcError, match=r"splitk\.cuh\(\d+\)"):
        sources.compile_source("mma_pipe.cu", bad, "sm_90")


def test_compile_kernel_caches_kernels_and_shares_a_file_module(monkeypatch):
    """One compile and load a (file, defines, device, NVRTC); one Kernel a name; a define change compiles again."""
    compiled, loaded = [], []

    def fake_compile(source, arch, opts, name, headers, refresh):
        compiled.append((name, arch, opts))
        return b"\x7fELF", False

    monkeypatch.setattr(runtime, "_compile_cached", fake_compile)
    monkeypatch.setattr(runtime, "load_module", lambda cubin, dev, rebuild=None: (loaded.append(dev) or "mod", cubin))
    monkeypatch.setattr(runtime, "get_kernel", lambda mod, cubin, name, dev: ("kernel", name, dev.index))
    monkeypatch.setattr(runtime, "device_arch", lambda dev, specific=False: "sm_90a" if specific else "sm_90")
    monkeypatch.setattr(sources, "_KERNELS", {})
    monkeypatch.setattr(sources, "_MODULES", {})
    a = sources.compile_kernel("x_tiles.cu", "kbit_x_tiles", {}, "cuda:0")
    assert sources.compile_kernel("x_tiles.cu", "kbit_x_tiles", {}, "cuda:0") is a
    sources.compile_kernel("x_tiles.cu", "kbit_x_tiles_g", {}, "cuda:0")
    assert len(compiled) == 1 and len(loaded) == 1  # the file's second kernel from the same module
    sources.compile_kernel("wgmma.cu", "kbit_wgmma", {"NG": 8}, "cuda:0")
    sources.compile_kernel("wgmma.cu", "kbit_wgmma", {"NG": 16}, "cuda:0")
    assert compiled[1:] == [("wgmma.cu", "sm_90a", ("-DNG=8",)), ("wgmma.cu", "sm_90a", ("-DNG=16",))]
    sources.compile_kernel("x_tiles.cu", "kbit_x_tiles", {}, "cuda:1")
    with options.override(nvrtc_lib="/other/libnvrtc.so"):  # another compiler: its own build
        sources.compile_kernel("x_tiles.cu", "kbit_x_tiles", {}, "cuda:0")
    assert len(compiled) == 5
