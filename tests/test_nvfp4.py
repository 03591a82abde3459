"""NVFP4 format: encode/decode, rounding, quantization error bounds, packing and the swizzled layout."""

import math
import zlib

import pytest
import torch

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error

VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def brute_force_code(x: float) -> int:
    """Independent E2M1 rounding: nearest representable magnitude, ties to the even code, saturate at 6."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(VALUES[c] - mag), c % 2))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def test_every_representable_value_round_trips_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.e2m1_decode(codes)
    assert values[:8].tolist() == VALUES
    assert values[8:].tolist() == [-v for v in VALUES]
    re = nvfp4.e2m1_encode(values)
    # -0.0 encodes to code 8 (sign kept), every other value to itself.
    assert re.tolist() == list(range(16))


@pytest.mark.parametrize("x,expected", [
    (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (0.7499999, 0.5), (1.25, 1.0), (1.2500001, 1.5),
    (1.75, 2.0), (2.5, 2.0), (2.5000002, 3.0), (3.5, 4.0), (5.0, 4.0), (5.0000005, 6.0), (100.0, 6.0),
    (-0.75, -1.0), (-5.0, -4.0), (-1e9, -6.0), (float("inf"), 6.0),
])
def test_rounding_boundaries_ties_to_even_and_saturation(x, expected):
    got = nvfp4.e2m1_decode(nvfp4.e2m1_encode(torch.tensor([x]))).item()
    assert got == expected


def test_encode_matches_brute_force_on_random_values():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g) * 3
    # Sprinkle exact midpoints so ties are exercised, not just hit by luck.
    x[:14] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    got = nvfp4.e2m1_encode(x).tolist()
    assert got == [brute_force_code(v) for v in x.tolist()]


def test_encode_matches_torch_float4_cast_when_available():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2 dtype")
    codes = nvfp4.pack_fp4(torch.arange(16, dtype=torch.uint8).repeat(2))
    try:
        as_float = codes.view(torch.float4_e2m1fn_x2).to(torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"float4_e2m1fn_x2 has no conversion kernel on this device/torch: {exc}")
    assert as_float.flatten().tolist() == nvfp4.e2m1_decode(torch.arange(16).repeat(2)).tolist()


def test_packing_puts_even_index_in_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)
    with pytest.raises(Glm5Fp4Error, match="odd"):
        nvfp4.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def _half_gap_bound(w: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Largest error rounding can make for each element: half the E2M1 gap at its scaled magnitude."""
    s_eff = (scale.float()[..., None] * gs.reshape(gs.shape + (1,) * 2)[..., None]).expand(
        *scale.shape, nvfp4.BLOCK_SIZE).flatten(-2)
    v = (w.float().abs() / s_eff)
    half_gap = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    # Above 6 the code saturates: the error is exactly the excess. It happens only where the E4M3 block
    # scale was rounded down, by at most 1/16 for normal scales (so excess <= 0.375 s_eff), by more for
    # subnormal scales (tiny blocks next to a large global amax), as in ModelOpt.
    bound = torch.where(v <= 6, half_gap * s_eff, (v - 6) * s_eff)
    normal = scale.float().repeat_interleave(nvfp4.BLOCK_SIZE, -1) >= 2**-6
    assert torch.all(~normal | (v <= 6.375 * (1 + 1e-6))), "normal block scales never leave more than 1/16 headroom"
    return bound + 1e-5 * s_eff + 1e-30


@pytest.mark.parametrize("case", ["normal", "outliers", "tiny", "zeros", "zero_blocks", "mixed_scale_rows"])
def test_quantize_dequantize_error_within_nvfp4_bound(case):
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))  # hash() differs per process
    w = torch.randn(64, 256, generator=g)
    if case == "outliers":
        w[3, 17] = 1e4
        w[40, 200] = -3e3
    elif case == "tiny":
        w = w * 1e-30
    elif case == "zeros":
        w = torch.zeros(64, 256)
    elif case == "zero_blocks":
        w[:, :64] = 0
    elif case == "mixed_scale_rows":
        w = w * torch.logspace(-6, 3, 64)[:, None]
    packed, scale, gs = nvfp4.quantize(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8
    assert scale.shape == (64, 16) and scale.dtype == torch.float8_e4m3fn
    assert gs.shape == () and gs.dtype == torch.float32
    assert torch.all(scale.float() > 0), "zero blocks must get scale 1.0, never 0"
    deq = nvfp4.dequantize(packed, scale, gs, torch.float32)
    err = (deq - w).abs()
    assert torch.all(err <= _half_gap_bound(w, scale, gs)), f"max excess {(err - _half_gap_bound(w, scale, gs)).max()}"
    if case in ("zeros",):
        assert torch.all(deq == 0)
    if case == "zero_blocks":
        assert torch.all(scale[:, :4].float() == 1.0) and torch.all(deq[:, :64] == 0)
    if case == "normal":
        # Typical NVFP4 weight error is ~5-10 % relative RMS; a broken quantizer is far off.
        rel = (deq - w).norm() / w.norm()
        assert 0.02 < rel < 0.15


def test_global_scale_and_block_scales_follow_modelopt():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g, dtype=torch.float64)
    packed, scale, gs = nvfp4.quantize(w)
    amax = w.abs().max().item()
    assert gs.item() == pytest.approx(amax / (6 * 448), rel=1e-6)
    for row in range(32):
        for blk in range(4):
            block_amax = w[row, blk * 16:(blk + 1) * 16].abs().max().item()
            expected = torch.tensor(min(block_amax / (6 * gs.item()), 448.0)).to(torch.float8_e4m3fn).float().item()
            assert scale[row, blk].float().item() == expected


def test_batched_quantize_equals_per_matrix():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 32, 64, generator=g) * torch.tensor([1.0, 100.0, 1e-3])[:, None, None]
    packed, scale, gs = nvfp4.quantize(w)
    assert gs.shape == (3,)
    for e in range(3):
        p, s, g1 = nvfp4.quantize(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scale[e].float(), s.float()) and gs[e] == g1
    deq = nvfp4.dequantize(packed, scale, gs, torch.float32)
    for e in range(3):
        assert torch.equal(deq[e], nvfp4.dequantize(*nvfp4.quantize(w[e]), dtype=torch.float32))


def test_bad_shapes_name_the_culprit():
    with pytest.raises(Glm5Fp4Error, match="not a multiple"):
        nvfp4.quantize(torch.randn(4, 24))
    packed, scale, gs = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(Glm5Fp4Error, match="block scale shape"):
        nvfp4.dequantize(packed, scale[:, :1], gs)


def _activation_reference(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """Independent per-block loop in float64: e4m3(g*amax/6) block scales, E2M1 rounding by brute force."""
    out = torch.empty_like(x, dtype=torch.float64)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 16):
            blk = x[r, b * 16:(b + 1) * 16].double()
            s = torch.tensor(min(global_scale * blk.abs().max().item() / 6, 448.0), dtype=torch.float32)
            s = s.to(torch.float8_e4m3fn).double().item()
            for i, v in enumerate(blk.tolist()):
                q = 0.0 if s == 0 else VALUES[brute_force_code(float(torch.tensor(v * global_scale / s, dtype=torch.float32))) & 7]
                sign = -1.0 if v < 0 else 1.0
                out[r, b * 16 + i] = sign * q * s / global_scale
    return out


def test_activation_quantization_matches_blackwell_formula():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g) * 2
    x[0, :16] = 0
    input_scale = x.abs().max() / (6 * 448)
    assert nvfp4.activation_global_scale(x).item() == pytest.approx(1 / input_scale.item(), rel=1e-6)
    got = nvfp4.fake_quantize_activation(x, input_scale, dtype=torch.float64)
    ref = _activation_reference(x, 1 / input_scale.item())
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("m,kc", [(128, 4), (256, 8), (100, 3), (300, 17), (1, 1)])
def test_swizzle_matches_offset_formula_and_inverts(m, kc):
    g = torch.Generator().manual_seed(m * 1000 + kc)
    scale = (torch.rand(m, kc, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
    sw = nvfp4.swizzle_scales(scale)
    m_pad, kc_pad = -(-m // 128) * 128, -(-kc // 4) * 4
    assert sw.shape == (m_pad, kc_pad)
    flat = sw.view(torch.uint8).flatten()
    raw = scale.view(torch.uint8)
    for r in range(0, m, max(1, m // 37)):
        for c in range(kc):
            assert flat[nvfp4.swizzled_offset(r, c, kc_pad)] == raw[r, c]
    assert torch.equal(nvfp4.unswizzle_scales(sw, m, kc).view(torch.uint8), raw)


def test_swizzle_batched_and_bad_input():
    scale = torch.randint(0, 255, (2, 130, 5), dtype=torch.uint8)
    sw = nvfp4.swizzle_scales(scale)
    assert sw.shape == (2, 256, 8)
    assert torch.equal(nvfp4.unswizzle_scales(sw, 130, 5), scale)
    with pytest.raises(Glm5Fp4Error, match="padded"):
        nvfp4.unswizzle_scales(torch.zeros(100, 4, dtype=torch.uint8), 100, 4)


def test_large_batched_quantize_is_chunked_exactly(monkeypatch):
    """Whole GLM-5 experts quantized at once needed 48 GiB of scratch on the H200 (test fixture OOM); above a size
    the experts go a few at a time, with the same bits."""
    from glm5_fp4 import nvfp4

    w = torch.randn(7, 32, 64) * torch.rand(7, 1, 1) * 3
    whole = nvfp4.quantize(w)
    shared = nvfp4.quantize(w, global_scale=0.01)
    monkeypatch.setattr(nvfp4, "QUANTIZE_CHUNK_ELEMENTS", 2 * 32 * 64 + 5)  # 2 experts per chunk, 4 chunks
    calls = []
    real = nvfp4._quantize_by_expert_chunks
    monkeypatch.setattr(nvfp4, "_quantize_by_expert_chunks", lambda *a: calls.append(1) or real(*a))
    chunked = nvfp4.quantize(w)
    assert calls
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                  b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    for a, b in zip(shared, nvfp4.quantize(w, global_scale=0.01)):
        assert torch.equal(a.float(), b.float())
