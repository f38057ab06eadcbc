"""kbit.options: the environment read once, overridable in code; kbit.utils: checks and the tensor cache."""

import pytest
import torch

from kbit import options
from kbit.utils.cache import TensorCache
from kbit.utils.checks import check_choice, check_int, check_tensor, fail


def test_from_environment_defaults_and_values():
    o = options.from_environment({})
    assert o.cuda_kernels and not o.deterministic and o.backend == "auto" and not o.interpret and o.pdl
    assert o.cache_dir.endswith("kbit/cubin")
    o = options.from_environment({"KBIT_CACHE_DIR": "0", "KBIT_NO_CUDA_KERNELS": "1", "KBIT_DETERMINISTIC": "1",
                                  "KBIT_BACKEND": "Triton", "TRITON_INTERPRET": "1", "KBIT_NVRTC_LIB": "/x.so"})
    assert o.cache_dir is None and not o.cuda_kernels and o.deterministic and o.backend == "triton"
    assert o.interpret and o.nvrtc_lib == "/x.so"
    assert options.from_environment({"XDG_CACHE_HOME": "/c"}).cache_dir == "/c/kbit/cubin"
    assert options.from_environment({"KBIT_CACHE_DIR": "/d"}).cache_dir == "/d"


@pytest.mark.parametrize("env, name", [({"KBIT_BACKEND": "gpu"}, "KBIT_BACKEND"),
                                       ({"KBIT_DETERMINISTIC": "maybe"}, "KBIT_DETERMINISTIC")])
def test_bad_environment_names_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        options.from_environment(env)


def test_override_restores_and_rejects_unknown_fields():
    before = options.get()
    with options.override(pdl=False, deterministic=True) as o:
        assert o is options.get() and not o.pdl and o.deterministic
    assert options.get() is before
    with pytest.raises(TypeError, match="unknown field"):
        with options.override(no_such_switch=1):
            pass
    with pytest.raises(ValueError, match="backend"):
        with options.override(backend="gpu"):
            pass
    with pytest.raises(TypeError, match="pdl"):
        options.Options(pdl=1)
    assert options.get() is before


def test_options_are_hashable_cache_keys():
    assert hash(options.get()) == hash(options.get())
    with options.override(pdl=False):
        assert options.get() != options.Options(**{**options.get().__dict__, "pdl": True})


def test_checks_say_name_expected_got():
    with pytest.raises(ValueError, match=r"^k: expected one of \(2, 3\), got 7$"):
        check_choice("k", 7, (2, 3))
    with pytest.raises(TypeError, match="^n: expected an int, got bool$"):
        check_int("n", True)
    with pytest.raises(ValueError, match=r"^n: expected an int in \[1, inf\], got 0$"):
        check_int("n", 0, minimum=1)
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor, got list$"):
        check_tensor("x", [1], torch.float32)
    with pytest.raises(TypeError, match="^x: expected dtype torch.float16 or torch.bfloat16, got torch.float32$"):
        check_tensor("x", torch.zeros(2), (torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match=r"^x: expected shape \(3,\), got \(2,\)$"):
        check_tensor("x", torch.zeros(2), torch.float32, shape=(3,))
    with pytest.raises(ValueError, match="contiguous"):
        check_tensor("x", torch.zeros(4, 4).t(), torch.float32, contiguous=True)
    with pytest.raises(KeyError):
        fail(KeyError, "a", "b", "c")


def test_tensor_cache_follows_identity_and_version():
    cache = TensorCache(max_entries=4)
    a, b = torch.zeros(3), torch.zeros(3)
    assert cache.get((a,), "x") is None
    assert cache.put((a,), "x", 1) == 1
    assert cache.get((a,), "x") == 1 and cache.get((a,), "y") is None and cache.get((b,), "x") is None
    a.add_(1)  # a new version: the entry no longer serves
    assert cache.get((a,), "x") is None
    cache.put((a, b), None, 2)
    assert cache.get((a, b), None) == 2
    b.mul_(2)
    assert cache.get((a, b), None) is None
    n = len(cache)
    del a  # the entry goes with its first tensor
    assert len(cache) < n
    for i in range(10):
        cache.put((torch.zeros(1),), i, i)
    assert len(cache) <= 4
    cache.clear()
    assert len(cache) == 0
    unbounded = TensorCache(max_entries=None)  # entries stay while their tensors live, however many
    keep = [torch.zeros(1) for _ in range(300)]
    for i, t in enumerate(keep):
        unbounded.put((t,), None, i)
    assert len(unbounded) == 300 and all(unbounded.get((t,), None) == i for i, t in enumerate(keep))
    del keep, t
    assert len(unbounded) == 0
