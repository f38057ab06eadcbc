"""Damaged kbit files (hypothesis): bit flips in the header and in the data, truncation, deleted metadata keys and
edited shapes always give a ValueError naming the file (and the tensor, where the damage is in one); nothing
loads silently and no other exception escapes. Also every "Silent, files" example of issue 34."""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kbit
from kbit.format import serialize as S

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _state():
    g = torch.Generator().manual_seed(11)
    return {
        "w": kbit.quantize(torch.randn(8, 64, generator=g), k=4),
        "experts": kbit.quantize(torch.randn(2, 4, 40, generator=g), k=3, scale_format="fp16"),
        "bias": torch.randn(8, generator=g),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path to damage, the intact file's bytes)."""
    d = tmp_path_factory.mktemp("fuzz")
    kbit.save_file(_state(), d / "good.safetensors")
    return d / "damaged.safetensors", (d / "good.safetensors").read_bytes()


def split(data: bytes) -> tuple[dict, bytes]:
    """(header JSON, data section) of a safetensors file."""
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8: 8 + n]), data[8 + n:]


def join(header: dict, body: bytes) -> bytes:
    """A safetensors file from a header and a data section (the header padded with spaces to 8 bytes, as written)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def tensor_at(data: bytes, byte: int) -> str | None:
    """The tensor whose data holds file byte ``byte`` (None for the header)."""
    (n,) = struct.unpack_from("<Q", data)
    header, _ = split(data)
    pos = byte - 8 - n
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][0] <= pos < info["data_offsets"][1]:
            return name
    return None


def assert_rejected(path, data: bytes, tensor: str | None = None):
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        kbit.load_file(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    if tensor is not None:
        assert repr(tensor) in msg, (tensor, msg)
    return msg


def test_intact_file_loads(saved):
    path, good = saved
    path.write_bytes(good)
    assert set(kbit.load_file(path)) == {"w", "experts", "bias"}


@FUZZ
@given(data=st.data())
def test_bit_flips_anywhere(saved, data):
    path, good = saved
    flips = data.draw(st.lists(st.integers(0, 8 * len(good) - 1), min_size=1, max_size=3, unique=True))
    b = bytearray(good)
    for f in flips:
        b[f // 8] ^= 1 << (f % 8)
    named = {tensor_at(good, f // 8) for f in flips}
    # one damaged tensor (and an intact header) must be named; several flips may hit several tensors
    assert_rejected(path, bytes(b), tensor=named.pop() if len(named) == 1 else None)


@FUZZ
@given(data=st.data())
def test_bit_flips_in_the_header(saved, data):
    path, good = saved
    (n,) = struct.unpack_from("<Q", good)
    f = data.draw(st.integers(0, 8 * (8 + n) - 1))
    b = bytearray(good)
    b[f // 8] ^= 1 << (f % 8)
    assert_rejected(path, bytes(b))


@FUZZ
@given(data=st.data())
def test_bit_flips_in_the_data(saved, data):
    path, good = saved
    (n,) = struct.unpack_from("<Q", good)
    f = data.draw(st.integers(8 * (8 + n), 8 * len(good) - 1))
    b = bytearray(good)
    b[f // 8] ^= 1 << (f % 8)
    assert_rejected(path, bytes(b), tensor=tensor_at(good, f // 8))


@FUZZ
@given(data=st.data())
def test_truncation(saved, data):
    path, good = saved
    assert_rejected(path, good[: data.draw(st.integers(0, len(good) - 1))])


@FUZZ
@given(data=st.data())
def test_deleted_metadata_keys(saved, data):
    path, good = saved
    header, body = split(good)
    meta = header["__metadata__"]
    for key in data.draw(st.lists(st.sampled_from(sorted(meta)), min_size=1, unique=True)):
        del meta[key]
    assert_rejected(path, join(header, body))


@FUZZ
@given(data=st.data())
def test_deleted_entries_inside_the_metadata(saved, data):
    path, good = saved
    header, body = split(good)
    meta = header["__metadata__"]
    key = data.draw(st.sampled_from([S.WEIGHTS_KEY, S.TENSORS_KEY]))
    entries = json.loads(meta[key])
    del entries[data.draw(st.sampled_from(sorted(entries)))]
    meta[key] = json.dumps(entries)
    assert_rejected(path, join(header, body))


@FUZZ
@given(data=st.data())
def test_edited_tensor_shapes_in_the_header(saved, data):
    """A tensor's shape changed; its data offsets too where the new size differs (else safetensors itself objects),
    so the damage reaches kbit's own checks: the tensor is named."""
    path, good = saved
    header, body = split(good)
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    info = header[name]
    shape = data.draw(st.lists(st.integers(0, 80), min_size=0, max_size=3).filter(lambda s: s != info["shape"]))
    size = {"F32": 4, "F16": 2, "I32": 4, "U8": 1}[info["dtype"]]
    nbytes = size * int(torch.tensor(shape, dtype=torch.int64).prod())
    start, end = info["data_offsets"]
    if data.draw(st.booleans()) or nbytes == end - start:  # consistent: same bytes, or the data re-cut to fit
        new_body = body[:start] + (body[start:end] + bytes(nbytes))[:nbytes] + body[end:]
        delta = nbytes - (end - start)
        for other in header.values():
            if "data_offsets" in other and other["data_offsets"][0] >= end and other is not info:
                other["data_offsets"] = [o + delta for o in other["data_offsets"]]
        info["data_offsets"] = [start, start + nbytes]
        info["shape"] = shape
        assert_rejected(path, join(header, new_body), tensor=name)
    else:  # the shape alone: the sizes no longer agree
        info["shape"] = shape
        assert_rejected(path, join(header, body))


@FUZZ
@given(data=st.data())
def test_edited_weight_parameters(saved, data):
    path, good = saved
    header, body = split(good)
    weights = json.loads(header["__metadata__"][S.WEIGHTS_KEY])
    name = data.draw(st.sampled_from(sorted(weights)))
    field = data.draw(st.sampled_from(sorted(weights[name])))
    value = data.draw(st.one_of(st.integers(-5, 200), st.text(max_size=5), st.none(), st.booleans(),
                                st.lists(st.integers(0, 100), max_size=3)).filter(lambda v: v != weights[name][field]))
    weights[name][field] = value
    header["__metadata__"][S.WEIGHTS_KEY] = json.dumps(weights)
    assert_rejected(path, join(header, body))


# -- issue 34, "Silent, files": each example fails clearly ------------------------------------------------------------

def test_issue34_flipped_bit_in_tensor_scale(saved):
    path, good = saved
    header, _ = split(good)
    (n,) = struct.unpack_from("<Q", good)
    start = header["w.tensor_scale"]["data_offsets"][0]
    for bit in range(32):
        b = bytearray(good)
        b[8 + n + start + bit // 8] ^= 1 << (bit % 8)
        assert "checksum mismatch" in assert_rejected(path, bytes(b), tensor="w.tensor_scale")


def test_issue34_deleted_or_corrupt_weights_key(saved):
    path, good = saved
    header, body = split(good)
    del header["__metadata__"][S.WEIGHTS_KEY]
    assert "metadata lacks 'kbit.weights'" in assert_rejected(path, join(header, body))
    header, body = split(good)
    header["__metadata__"][S.WEIGHTS_KEY] = '{"w": {"k": 4,'
    assert_rejected(path, join(header, body))
    header["__metadata__"][S.WEIGHTS_KEY] = "{}"  # valid JSON, entries gone: parts must not come back as tensors
    assert_rejected(path, join(header, body))


def test_issue34_header_shape_64_to_40(saved):
    path, good = saved
    header, body = split(good)
    weights = json.loads(header["__metadata__"][S.WEIGHTS_KEY])
    assert weights["w"]["shape"] == [8, 64]
    weights["w"]["shape"] = [8, 40]  # K padded to 64 all the same: the parts' shapes still fit
    header["__metadata__"][S.WEIGHTS_KEY] = json.dumps(weights)
    assert "metadata checksum mismatch" in assert_rejected(path, join(header, body))


def test_issue34_name_clash_on_save(tmp_path):
    qw, t = _state()["w"], torch.ones(3)
    with pytest.raises(ValueError, match=r"'w' and 'w.codes' both write the tensor 'w.codes'"):
        kbit.save_file({"w": qw, "w.codes": t}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
