import json

import pytest
import torch
from safetensors.torch import save_file as raw_save

import kbit


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "mlp.weight": kbit.quantize(torch.randn(40, 70, generator=g), k=3, codebook="nf0"),
        "experts.w": kbit.quantize(torch.randn(3, 16, 96, generator=g), k=5, blocksize=64, scale_format="fp16"),
        "custom.w": kbit.quantize(torch.randn(8, 32, generator=g), k=2, codebook=[-1.0, -0.2, 0.3, 1.0]),
        "norm.weight": torch.randn(70, generator=g),
    }


def test_round_trip_is_bit_exact(tmp_path):
    state = _state()
    path = tmp_path / "w.safetensors"
    kbit.save_file(state, path)
    back = kbit.load_file(path)
    assert set(back) == set(state)
    for name, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[name], v)
            continue
        b = back[name]
        assert isinstance(b, kbit.KbitWeight)
        assert b.metadata() == v.metadata()
        for part, t in v.tensors().items():
            assert torch.equal(b.tensors()[part], t), (name, part)


def _rewrite_metadata(path, **changes):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    meta.update(changes)
    raw_save(tensors, str(path), metadata=meta)


def test_unknown_version_raises(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state(), path)
    _rewrite_metadata(path, **{"kbit.format_version": "99"})
    with pytest.raises(ValueError, match="expected kbit format version 1, got '99'"):
        kbit.load_file(path)


def test_not_a_kbit_file_raises(tmp_path):
    path = tmp_path / "plain.safetensors"
    raw_save({"a": torch.ones(2)}, str(path))
    with pytest.raises(ValueError, match="not a kbit file"):
        kbit.load_file(path)


def test_truncated_file_raises(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        kbit.load_file(path)


def test_mismatched_shape_raises(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state(), path)
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        weights = json.loads(f.metadata()["kbit.weights"])
    weights["mlp.weight"]["shape"] = [40, 200]
    _rewrite_metadata(path, **{"kbit.weights": json.dumps(weights)})
    with pytest.raises(ValueError, match="'mlp.weight' does not match its metadata: codes: expected shape"):
        kbit.load_file(path)


def test_missing_part_raises(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state(), path)
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "mlp.weight.scales"}  # noqa: SIM118
    raw_save(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"lacks tensors \['scales'\]"):
        kbit.load_file(path)


def test_bad_values_raise_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"state_dict\['x'\]"):
        kbit.save_file({"x": 3}, tmp_path / "x.safetensors")
