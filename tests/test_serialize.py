"""kbit.save_file / kbit.load_file (format version 2): round trip, checksums, the metadata schema, name clashes,
version 1 files, and the value invariants of KbitWeight."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file as raw_save

import kbit
from kbit.format import serialize as S


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "mlp.weight": kbit.quantize(torch.randn(40, 70, generator=g), k=3, codebook="nf0"),
        "experts.w": kbit.quantize(torch.randn(3, 16, 96, generator=g), k=5, blocksize=64, scale_format="fp16"),
        "custom.w": kbit.quantize(torch.randn(8, 32, generator=g), k=2, codebook=[-1.0, -0.2, 0.3, 1.0]),
        "norm.weight": torch.randn(70, generator=g),
        "half.b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.int64),
    }


def _saved(tmp_path, state=None):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state() if state is None else state, path)
    return path


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def _rewrite(path, tensors=None, fix_checksums=False, drop=(), **changes):
    """Rewrite ``path`` with metadata entries changed / dropped (and tensors replaced); ``fix_checksums`` recomputes
    every checksum, as a careful forger would, so that the checks behind them are reached."""
    meta, old = _read(path)
    tensors = old if tensors is None else tensors
    meta.update(changes)
    for key in drop:
        meta.pop(key)
    if fix_checksums:
        meta[S.TENSORS_KEY] = json.dumps({n: {"dtype": str(t.dtype)[6:], "shape": list(t.shape),
                                              "crc32": S.tensor_crc32(t)} for n, t in tensors.items()})
        meta[S.METADATA_CRC_KEY] = str(S.metadata_crc32(meta))
    raw_save(tensors, str(path), metadata=meta)


def _weights(path):
    return json.loads(_read(path)[0][S.WEIGHTS_KEY])


def _assert_same(back, state):
    assert set(back) == set(state)
    for name, v in state.items():
        if isinstance(v, torch.Tensor):
            assert back[name].dtype == v.dtype and torch.equal(back[name], v), name
            continue
        b = back[name]
        assert isinstance(b, kbit.KbitWeight)
        assert b.metadata() == v.metadata()
        for part, t in v.tensors().items():
            assert torch.equal(b.tensors()[part], t), (name, part)


def test_round_trip_is_bit_exact(tmp_path):
    state = _state()
    path = _saved(tmp_path, state)
    _assert_same(kbit.load_file(path), state)
    _assert_same(kbit.load_file(path, verify=False), state)
    meta, _ = _read(path)
    assert meta[S.VERSION_KEY] == "2" == str(kbit.FORMAT_VERSION)
    records = json.loads(meta[S.TENSORS_KEY])
    assert set(records) == set(_read(path)[1]) and records["scalar"]["shape"] == []


def test_user_metadata_kept_and_kbit_keys_reserved(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file(_state(), path, metadata={"author": "me"})
    assert _read(path)[0]["author"] == "me"
    with pytest.raises(ValueError, match=r"metadata: expected no key starting with 'kbit.'.*'kbit.weights'"):
        kbit.save_file(_state(), path, metadata={"kbit.weights": "{}"})
    with pytest.raises(TypeError, match="metadata: expected a dict of str -> str"):
        kbit.save_file(_state(), path, metadata={"n": 3})


def test_shared_storage_saves(tmp_path):
    stack = kbit.quantize(torch.randn(3, 8, 32), k=4)
    state = {"a": stack[0], "b": stack[2], "c": stack}  # views of one stack, one codebook
    _assert_same(kbit.load_file(_saved(tmp_path, state)), state)


def test_name_clash_raises_naming_both(tmp_path):
    qw = kbit.quantize(torch.randn(8, 32), k=4)
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=r"entries 'w' and 'w.codes' both write the tensor 'w.codes'"):
        kbit.save_file({"w": qw, "w.codes": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=r"entries 'w.scales' and 'w' both write the tensor 'w.scales'"):
        kbit.save_file({"w.scales": torch.zeros(3), "w": qw}, path)
    assert not path.exists() and os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="expected non-empty str names"):
        kbit.save_file({"": torch.zeros(1)}, path)


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(S, "_save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        kbit.save_file({"x": torch.ones(2)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_unknown_version_raises(tmp_path):
    path = _saved(tmp_path)
    for v in ("99", "3", "", "2.0"):
        _rewrite(path, fix_checksums=True, **{S.VERSION_KEY: v})
        with pytest.raises(ValueError, match=f"w.safetensors: expected kbit format version 1 or 2, got '{v}'"):
            kbit.load_file(path)


def test_not_a_kbit_file_raises(tmp_path):
    path = tmp_path / "plain.safetensors"
    raw_save({"a": torch.ones(2)}, str(path))
    with pytest.raises(ValueError, match="plain.safetensors: not a kbit file"):
        kbit.load_file(path)


def test_directory_and_missing_file(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}: expected a safetensors file, got a directory"):
        kbit.load_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.safetensors: no such file"):
        kbit.load_file(tmp_path / "nope.safetensors")


def test_save_to_a_directory_or_missing_folder(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}: expected a file name, got a directory"):
        kbit.save_file({"a": torch.ones(1)}, tmp_path)
    with pytest.raises(FileNotFoundError, match="the folder .*nope does not exist"):
        kbit.save_file({"a": torch.ones(1)}, tmp_path / "nope" / "w.safetensors")
    assert os.listdir(tmp_path) == []


def test_truncated_file_raises(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    for n in (len(data) - 100, len(data) - 1, 100, 8, 3, 0):
        path.write_bytes(data[:n])
        with pytest.raises(ValueError, match="w.safetensors: cannot read safetensors file .truncated or corrupt"):
            kbit.load_file(path)


def test_flipped_data_bit_names_the_tensor(tmp_path):
    path = _saved(tmp_path)
    _, tensors = _read(path)
    ts = tensors["experts.w.scales"].clone()
    ts.view(torch.uint8).view(-1)[5] ^= 1  # one bit of one fp16 scale: a finite value, only the checksum sees it
    tensors["experts.w.scales"] = ts
    _rewrite(path, tensors=tensors)
    with pytest.raises(ValueError, match=r"w.safetensors: tensor 'experts.w.scales': checksum mismatch"):
        kbit.load_file(path)
    assert not torch.equal(kbit.load_file(path, verify=False)["experts.w"].scales, _state()["experts.w"].scales)


def test_edited_metadata_fails_its_checksum(tmp_path):
    path = _saved(tmp_path)
    w = _weights(path)
    w["custom.w"]["shape"] = [8, 20]  # K padded to the same 32: without the checksum this would load
    _rewrite(path, **{S.WEIGHTS_KEY: json.dumps(w)})
    with pytest.raises(ValueError, match="w.safetensors: metadata checksum mismatch"):
        kbit.load_file(path)
    for key in (S.WEIGHTS_KEY, S.TENSORS_KEY, S.METADATA_CRC_KEY):
        path = _saved(tmp_path)
        _rewrite(path, drop=[key])
        with pytest.raises(ValueError, match=f"w.safetensors: metadata lacks '{key}'"):
            kbit.load_file(path)


def test_shape_mismatch_behind_good_checksums(tmp_path):
    path = _saved(tmp_path)
    w = _weights(path)
    w["mlp.weight"]["shape"] = [40, 200]
    _rewrite(path, fix_checksums=True, **{S.WEIGHTS_KEY: json.dumps(w)})
    with pytest.raises(ValueError, match="'mlp.weight' does not match its metadata: codes: expected shape"):
        kbit.load_file(path)


def test_tensor_list_must_match_the_records(tmp_path):
    path = _saved(tmp_path)
    _, tensors = _read(path)
    del tensors["mlp.weight.scales"]
    _rewrite(path, tensors=tensors)
    with pytest.raises(ValueError, match=r"not listed \[\], listed but absent \['mlp.weight.scales'\]"):
        kbit.load_file(path)
    _rewrite(path, tensors=tensors, fix_checksums=True)
    with pytest.raises(ValueError, match=r"w.safetensors: quantized weight 'mlp.weight' lacks tensors \['scales'\]"):
        kbit.load_file(path)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("k", 7, r"k: expected one of \(2, 3, 4, 5\), got 7"),
    ("k", "3", r"k: expected one of \(2, 3, 4, 5\), got '3'"),
    ("k", True, r"k: expected one of .*, got True"),
    ("blocksize", 48, r"blocksize: expected one of \(32, 64, 128\), got 48"),
    ("scale_format", "fp8", r"scale_format: expected one of \('log8', 'fp16'\), got 'fp8'"),
    ("codebook", "mine", r"codebook: expected one of .*'custom'\), got 'mine'"),
    ("shape", [40, 0], r"shape: expected a list of at least 2 ints >= 1, got \[40, 0\]"),
    ("shape", [70], r"shape: expected a list of at least 2 ints >= 1, got \[70\]"),
    ("shape", "40x70", r"shape: expected a list of at least 2 ints >= 1, got '40x70'"),
    ("shape", [40, 70.0], r"shape: expected a list of at least 2 ints >= 1"),
    ("extra", 1, r"expected the fields \['blocksize', 'codebook', 'k', 'scale_format', 'shape'\], got"),
])
def test_weights_schema(tmp_path, field, value, match):
    path = _saved(tmp_path)
    w = _weights(path)
    w["mlp.weight"][field] = value
    _rewrite(path, fix_checksums=True, **{S.WEIGHTS_KEY: json.dumps(w)})
    with pytest.raises(ValueError, match=r"w.safetensors: metadata 'kbit.weights', weight 'mlp.weight': " + match):
        kbit.load_file(path)


def test_bad_json_names_the_file(tmp_path):
    path = _saved(tmp_path)
    for key, text in ((S.WEIGHTS_KEY, "{not json"), (S.TENSORS_KEY, "[1, 2]"), (S.WEIGHTS_KEY, '{"w": 3}')):
        _rewrite(path, fix_checksums=key != S.TENSORS_KEY, **{key: text})
        if key == S.TENSORS_KEY:  # keep the bad records: recompute only the metadata checksum
            meta, tensors = _read(path)
            meta[S.METADATA_CRC_KEY] = str(S.metadata_crc32(meta))
            raw_save(tensors, str(path), metadata=meta)
        with pytest.raises(ValueError, match=f"w.safetensors: metadata '{key}'"):
            kbit.load_file(path)


def test_bad_records_schema(tmp_path):
    path = _saved(tmp_path)
    meta, tensors = _read(path)
    rec = json.loads(meta[S.TENSORS_KEY])
    rec["scalar"]["crc32"] = -1
    meta[S.TENSORS_KEY] = json.dumps(rec)
    meta[S.METADATA_CRC_KEY] = str(S.metadata_crc32(meta))
    raw_save(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"tensor 'scalar': crc32: expected an int in \[0, 2\*\*32\), got -1"):
        kbit.load_file(path)


def test_bad_values_behind_good_checksums_name_the_field(tmp_path):
    path = _saved(tmp_path)
    for part, value in (("tensor_scale", -1.0), ("tensor_scale", float("nan")), ("codebook", float("inf"))):
        _, tensors = _read(_saved(tmp_path))
        tensors[f"mlp.weight.{part}"] = tensors[f"mlp.weight.{part}"].clone().fill_(value)
        _rewrite(path, tensors=tensors, fix_checksums=True)
        with pytest.raises(ValueError, match=f"quantized weight 'mlp.weight' does not match its metadata: {part}: "
                                             "expected finite values"):
            kbit.load_file(path)


def _write_v1(state, path, drop_weight=None):
    tensors, weights = {}, {}
    for name, v in state.items():
        if isinstance(v, kbit.KbitWeight):
            tensors.update({f"{name}.{p}": t.contiguous() for p, t in v.tensors().items()})
            if name != drop_weight:
                weights[name] = v.metadata()
        else:
            tensors[name] = v
    raw_save(tensors, str(path), metadata={S.VERSION_KEY: "1", S.WEIGHTS_KEY: json.dumps(weights)})


def test_version_1_loads_with_a_note(tmp_path):
    state, path = _state(), tmp_path / "v1.safetensors"
    _write_v1(state, path)
    S._warned_v1.discard(str(path))
    with pytest.warns(UserWarning, match="v1.safetensors: kbit format version 1 has no checksums"):
        back = kbit.load_file(path)
    _assert_same(back, state)


def test_version_1_without_weights_entry_raises(tmp_path):
    state, path = _state(), tmp_path / "v1.safetensors"
    _write_v1(state, path, drop_weight="custom.w")
    S._warned_v1.discard(str(path))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"v1.safetensors: tensors \['custom.w.codes'"):
        kbit.load_file(path)
    _write_v1(state, path)
    _rewrite(path, drop=[S.WEIGHTS_KEY])
    with pytest.raises(ValueError, match="v1.safetensors: metadata lacks 'kbit.weights'"):
        kbit.load_file(path)


def test_plain_tensors_named_like_parts_round_trip(tmp_path):
    # a KbitLinear's state_dict holds plain "fc.codes", "fc.scales", ...: in version 2 the records say they are plain
    qw = kbit.quantize(torch.randn(8, 32), k=4)
    state = {f"fc.{p}": t for p, t in qw.tensors().items()}
    _assert_same(kbit.load_file(_saved(tmp_path, state)), state)


def test_bad_values_raise_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"state_dict\['x'\]"):
        kbit.save_file({"x": 3}, tmp_path / "x.safetensors")


def test_save_checks_values_of_weights(tmp_path):
    qw = kbit.quantize(torch.randn(8, 32), k=4)
    qw.tensor_scale.fill_(float("nan"))  # changed in place after construction (as a GPU-built weight is unchecked)
    with pytest.raises(ValueError, match=r"state_dict\['w'\]: tensor_scale: expected finite values >= 0, got nan"):
        kbit.save_file({"w": qw}, tmp_path / "x.safetensors")


def _parts(scale_format="log8", shape=(2, 8, 64)):
    qw = kbit.quantize(torch.randn(*shape), k=4, scale_format=scale_format)
    return {**{n: t.clone() for n, t in qw.tensors().items()}, "shape": qw.shape, "k": 4, "blocksize": 32,
            "scale_format": scale_format}


@pytest.mark.parametrize(("scale_format", "field", "index", "value", "match"), [
    ("log8", "codebook", 3, float("nan"), r"codebook: expected finite values, got nan at index \(3,\)"),
    ("log8", "codebook", 0, float("-inf"), r"codebook: expected finite values, got -inf"),
    ("log8", "tensor_scale", 1, -0.5, r"tensor_scale: expected finite values >= 0, got -0.5 at index \(1,\)"),
    ("log8", "tensor_scale", 0, float("nan"), r"tensor_scale: expected finite values >= 0, got nan"),
    ("log8", "tensor_scale", 0, float("inf"), r"tensor_scale: expected finite values >= 0, got inf"),
    ("fp16", "scales", (1, 3, 1), float("nan"), r"scales: expected finite values >= 0, got nan at index \(1, 3, 1\)"),
    ("fp16", "scales", (0, 0, 0), float("inf"), r"scales: expected finite values >= 0, got inf"),
    ("fp16", "scales", (0, 7, 1), -2.0, r"scales: expected finite values >= 0, got -2.0"),
])
def test_kbit_weight_value_invariants(scale_format, field, index, value, match):
    parts = _parts(scale_format)
    parts[field][index] = value
    with pytest.raises(ValueError, match=match):
        kbit.KbitWeight(**parts)


def test_value_invariants_accept_valid_edges():
    parts = _parts("fp16")
    parts["scales"][0, 0, 0] = -0.0
    parts["scales"][0, 0, 1] = 65504.0
    kbit.KbitWeight(**parts)
    zero = kbit.quantize(torch.zeros(8, 32), k=4)  # an all-zero matrix: tensor_scale 0
    assert float(zero.tensor_scale) == 0.0
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _parts().items()}
    meta["tensor_scale"] = torch.full((2,), float("nan"), device="meta")
    kbit.KbitWeight(**meta)  # no values on the meta device: nothing to check
    parts = _parts()
    qw = kbit.KbitWeight(**parts)
    qw.codebook[0] = float("nan")
    with pytest.raises(ValueError, match="codebook: expected finite values"):
        qw.check_values()


def test_version_1_shape_edited_within_the_padding(tmp_path):
    state, path = _state(), tmp_path / "v1.safetensors"
    state["w8"] = kbit.quantize(torch.randn(8, 64), k=4)
    _write_v1(state, path)
    meta, _ = _read(path)
    w = json.loads(meta[S.WEIGHTS_KEY])
    for name, shape in (("w8", [8, 40]), ("mlp.weight", [40, 65]), ("experts.w", [3, 16, 70])):
        edited = dict(w, **{name: dict(w[name], shape=shape)})  # K padded to the same Kp: the parts still fit
        _rewrite(path, **{S.WEIGHTS_KEY: json.dumps(edited)})
        S._warned_v1.discard(str(path))
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=f"'{name}': the padding columns"):
            kbit.load_file(path)


def test_every_safetensors_dtype_round_trips(tmp_path):
    state = {"f8": torch.randn(4).to(torch.float8_e4m3fn), "u16": torch.arange(3, dtype=torch.int32).to(torch.uint16),
             "c64": torch.ones(2, dtype=torch.complex64), "b": torch.tensor([True, False]), "i8": -torch.ones(5).char()}
    back = kbit.load_file(_saved(tmp_path, state))
    assert all(back[n].dtype == t.dtype and torch.equal(back[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in state.items())


@pytest.mark.gpu
def test_gpu_weights_save_load_and_checks(tmp_path):
    state = {n: (v.cuda() if isinstance(v, kbit.KbitWeight) else v) for n, v in _state().items()}
    back = kbit.load_file(_saved(tmp_path, state), device="cuda")
    assert back["mlp.weight"].device.type == "cuda" and back["norm.weight"].device.type == "cuda"
    _assert_same({n: v.cpu() for n, v in back.items()}, _state())
    parts = {n: t.cuda() for n, t in _state()["mlp.weight"].tensors().items()}
    parts["tensor_scale"] = torch.tensor(float("nan"), device="cuda")
    bad = kbit.KbitWeight(**parts, shape=(40, 70), k=3, blocksize=32)  # no host sync on a GPU: not checked here
    with pytest.raises(ValueError, match="tensor_scale: expected finite values >= 0, got nan"):
        bad.check_values()
    with pytest.raises(ValueError, match=r"state_dict\['w'\]: tensor_scale: expected finite values"):
        kbit.save_file({"w": bad}, tmp_path / "bad.safetensors")
