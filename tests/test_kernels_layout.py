"""Load-time repacking for the fused MoE kernel: nibble order, exact decode trick, validation."""

import pytest
import torch

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import prepare_experts
from glm5_fp4.kernels.layout import (DECODE_FACTOR, K_GROUP, LAYOUT_ENV, merge_nibbles, place_nibbles, split_nibbles,
                                     tile_k, unplace_nibbles, untile_k, w13_k_tile)
from glm5_fp4.reference import NvFp4Experts, random_experts


def test_split_nibbles_places_k_and_k_plus_4_in_one_byte():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8, generator=g)
    codes = nvfp4.unpack_fp4(packed)  # [3, 7, 128]
    split = split_nibbles(packed)
    assert split.shape == packed.shape
    lo, hi = split & 0xF, split >> 4
    byte = torch.arange(64)
    k_lo = (byte // 4) * K_GROUP + byte % 4  # byte j of group g holds k = 8g + j and 8g + j + 4
    assert torch.equal(lo, codes[..., k_lo])
    assert torch.equal(hi, codes[..., k_lo + 4])
    assert torch.equal(merge_nibbles(split), packed)


def test_e2m1_to_e4m3_bit_move_is_exact_over_64():
    # The decode moves magnitude bits 0-2 to bits 2-4 and the sign to bit 7 (for either nibble); the
    # resulting E4M3 byte must be exactly the E2M1 value / 64 for all 16 codes.
    codes = torch.arange(16, dtype=torch.int32)
    e4m3 = (((codes & 7) << 2) | ((codes & 8) << 4)).to(torch.uint8)
    got = e4m3.view(torch.float8_e4m3fn).float() * DECODE_FACTOR
    want = nvfp4.e2m1_decode(codes.to(torch.uint8))
    assert torch.equal(got, want)
    # the high-nibble variant of the asm: ((b >> 2) & 0x1C) | (b & 0x80) on byte b = code << 4
    hi_bytes = (codes << 4).to(torch.int32)
    e4m3_hi = (((hi_bytes >> 2) & 0x1C) | (hi_bytes & 0x80)).to(torch.uint8)
    assert torch.equal(e4m3_hi.view(torch.float8_e4m3fn).float() * DECODE_FACTOR, want)


def test_prepared_roundtrips_to_the_same_experts():
    g = torch.Generator().manual_seed(2)
    ex = random_experts(4, 256, 128, generator=g)
    prep = prepare_experts(ex)
    ex.validate()
    back = prep.to_experts()
    assert back is ex  # CPU keeps the source
    prep.source = None
    back = prep.to_experts()
    for name in ("w13", "w2"):
        assert torch.equal(getattr(back, name), getattr(ex, name))
    for name in ("w13_scale", "w2_scale"):
        assert torch.equal(getattr(back, name).view(torch.uint8), getattr(ex, name).view(torch.uint8))
    assert torch.allclose(back.w13_global, ex.w13_global) and torch.allclose(back.w2_global, ex.w2_global)
    assert torch.equal(prep.a13_gscale, 1.0 / ex.a13_scale)


def test_prepare_rejects_shapes_the_kernel_cannot_tile():
    w13 = torch.randn(2, 2 * 96, 256)
    w2 = torch.randn(2, 256, 96)
    with pytest.raises(Glm5Fp4Error, match="intermediate_size.*128"):
        prepare_experts(NvFp4Experts.from_float(w13, w2))


def test_prepare_validates_dtypes():
    ex = random_experts(2, 128, 128, generator=torch.Generator().manual_seed(3))
    ex.w13_scale = ex.w13_scale.float()
    with pytest.raises(Glm5Fp4Error, match="w13_scale"):
        prepare_experts(ex)


def test_checkpoint_layout_keeps_packing_and_global_scales():
    ex = random_experts(2, 128, 128, generator=torch.Generator().manual_seed(4))
    prep = prepare_experts(ex, layout="checkpoint")
    assert torch.equal(prep.w13, ex.w13) and torch.equal(prep.w13_alpha, ex.w13_global)
    prep.source = None
    back = prep.to_experts()
    assert torch.equal(back.w2, ex.w2) and torch.equal(back.w2_global, ex.w2_global)
    with pytest.raises(Glm5Fp4Error, match="layout"):
        prepare_experts(ex, layout="swizzled")


def _placed_decode_bytes(placed: torch.Tensor) -> torch.Tensor:
    """The placed decode's bit operations (triton_moe._PLACED_WORD), in int64 on the CPU: E4M3 bytes of the
    eight codes of every word, in K order."""
    by = placed.unflatten(-1, (placed.shape[-1] // 4, 4)).to(torch.int64)
    w = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)
    lo = w & 0x9C9C9C9C
    hi = ((((w << 6) | (w >> 26)) & 0x98989898) | ((w << 2) & 0x04040404)) & 0xFFFFFFFF
    return torch.stack([(r >> (8 * j)) & 0xFF for r in (lo, hi) for j in range(4)], dim=-1).flatten(-2)


def test_placed_layout_decodes_to_the_e4m3_bytes_of_every_code():
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8, generator=g)
    placed = place_nibbles(packed)
    assert placed.shape == packed.shape and torch.equal(unplace_nibbles(placed), packed)
    codes = nvfp4.unpack_fp4(packed).to(torch.int64)
    want = ((codes & 8) << 4) | ((codes & 7) << 2)  # the E4M3 trick of the split layout: value / 64
    assert torch.equal(_placed_decode_bytes(placed), want)
    f8 = _placed_decode_bytes(placed).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(f8 * DECODE_FACTOR, nvfp4.e2m1_decode(codes.to(torch.uint8)).float())


def test_tiled_layout_is_the_default_the_others_on_request_and_all_roundtrip(monkeypatch):
    ex = random_experts(2, 512, 128, generator=torch.Generator().manual_seed(6))  # two runs of the tiled layout
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert prepare_experts(ex).layout == "tiled"
    for name in ("split", "placed", "tiled"):
        monkeypatch.setenv(LAYOUT_ENV, name)
        prep = prepare_experts(ex)
        assert prep.layout == name and torch.equal(prep.w13_alpha, ex.w13_global * DECODE_FACTOR)
        prep.source = None
        back = prep.to_experts()
        assert torch.equal(back.w13, ex.w13) and torch.equal(back.w2, ex.w2)
    for bad in ("checkpoint", "rows"):
        monkeypatch.setenv(LAYOUT_ENV, bad)
        with pytest.raises(Glm5Fp4Error, match=LAYOUT_ENV):
            prepare_experts(ex)


@pytest.mark.parametrize("h,kt", [(512, 256), (384, 128)])
def test_tiled_layout_puts_each_k_tile_of_a_row_range_in_one_run_and_roundtrips(h, kt):
    """layout="tiled": inside each expert, K tile j of rows r0..r1 is one contiguous run of the stored bytes
    (words and scales) at (k // KT) * 2I * KT/U + r * KT/U (the interpreter tests check the kernel reads it so);
    w2 is untouched."""
    ex = random_experts(3, h, 128, generator=torch.Generator().manual_seed(7))
    placed, tiled = prepare_experts(ex, layout="placed"), prepare_experts(ex, layout="tiled")
    assert w13_k_tile("tiled", h) == kt and w13_k_tile("placed", h) == 0
    assert tiled.w13.shape == placed.w13.shape and tiled.w13_scale.shape == placed.w13_scale.shape
    assert torch.equal(tiled.w2, placed.w2) and torch.equal(tiled.w2_scale, placed.w2_scale)
    rows = placed.w13.shape[1]
    for stored, ref, per in ((tiled.w13, placed.w13, 2), (tiled.w13_scale, placed.w13_scale, 16)):
        run = kt // per  # stored elements of one row in one K tile
        flat = stored.reshape(stored.shape[0], -1)
        for j in range(h // kt):
            start = j * rows * run + 5 * run  # rows 5..12 of K tile j: (k // KT) * ROWS * KT/U + r * KT/U
            got = flat[:, start:start + 8 * run].reshape(-1, 8, run)
            assert torch.equal(got, ref[:, 5:13, j * run:(j + 1) * run])
    assert torch.equal(untile_k(tiled.w13, kt, 2), placed.w13)
    assert torch.equal(untile_k(tile_k(placed.w13_scale, kt, 16), kt, 16), placed.w13_scale)
    tiled.source = None
    back = tiled.to_experts()
    assert torch.equal(back.w13, ex.w13) and torch.equal(back.w2, ex.w2)
    assert torch.equal(back.w13_scale.view(torch.uint8), ex.w13_scale.view(torch.uint8))
