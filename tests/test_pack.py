"""Bit-plane packing: bit-exact round trips for every k on odd shapes, and the documented byte layout."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kbit.format.pack import pack, unpack, words_per_row


@settings(max_examples=60, deadline=None)
@given(k=st.sampled_from([2, 3, 4, 5]), lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
       groups=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip(k, lead, groups, seed):
    kp = 32 * groups
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**k, (*lead, kp), generator=g, dtype=torch.int32)
    words = pack(codes, k)
    assert words.dtype == torch.int32
    assert words.shape == (*lead, words_per_row(k, kp))
    assert torch.equal(unpack(words, k, kp), codes)


def test_k4_layout_is_little_endian_nibbles():
    codes = torch.arange(32, dtype=torch.int32) % 16
    words = pack(codes, 4)
    # word w holds columns 8w..8w+7, column 8w+j in bits 4j..4j+3
    assert words[0].item() == 0x76543210
    assert (words[1].item() & 0xFFFFFFFF) == 0xFEDCBA98


def test_k3_planes_low_bits_then_high_bit():
    codes = torch.zeros(64, dtype=torch.int32)
    codes[0] = 0b111      # column 0: low bits 11 in word 0 bits 0-1; bit 2 in word 4 bit 0
    codes[17] = 0b100     # column 17: bit 2 only -> word 4 bit 17
    codes[40] = 0b010     # column 40: low bits 10 in word 2 (columns 32-47) at bits 16-17
    words = pack(codes, 3)
    assert words.shape == (6,)
    assert [w & 0xFFFFFFFF for w in words.tolist()] == [0b11, 0, 0b10 << 16, 0, 1 | (1 << 17), 0]


def test_k5_high_plane_all_ones_is_minus_one():
    codes = torch.full((32,), 31, dtype=torch.int32)
    words = pack(codes, 5)
    assert words.tolist() == [-1] * 5
