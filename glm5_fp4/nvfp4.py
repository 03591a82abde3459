"""NVFP4: E2M1 elements in 16-element blocks with an E4M3 scale each, plus one FP32 global scale.

Pure torch, any device. Rounding, packing and scale layouts follow what ModelOpt writes and
what Blackwell hardware and the engines (vLLM, SGLang, FlashInfer, CUTLASS) read:

* E2M1 cast: round to nearest, ties to even code, saturate at 6 (PTX `cvt.rn.satfinite.e2m1x2`).
* Weights (ModelOpt): ``weight_scale_2 = amax / (6 * 448)``; per-16 block scale
  ``e4m3(block_amax / (6 * weight_scale_2))``, a zero scale becomes 1.0.
* Activations (Blackwell kernels): global ``g = 448 * 6 / amax`` (``1 / input_scale``),
  block scale ``e4m3(g * block_amax / 6)``, element ``fp4(x * g / block_scale)``.
* Packing: two codes per byte, even index in the low nibble, packed shape ``[..., K/2]``.
* Scales: linear ``[..., N, K/16]`` in checkpoints; 128x4 swizzled for CUTLASS/FlashInfer.
"""

from __future__ import annotations

import torch

from glm5_fp4.errors import Glm5Fp4Error

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Bytes per element in memory: a 4-bit code plus one 1-byte scale per 16 elements.
BYTES_PER_ELEMENT = 0.5 + 1.0 / BLOCK_SIZE

# Magnitudes of codes 0..7; codes 8..15 are the same values, negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a tie goes up (the upper code is even).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)

_SWIZZLE_ROWS = 128
_SWIZZLE_COLS = 4


def shape_matches(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A checkpoint tensor's shape against the expected one; ModelOpt stores scalars (global and input scales) as
    0-d tensors or as [1], and both are one value."""
    return tuple(got) == tuple(want) or (tuple(want) == () and tuple(got) == (1,))


def _table(device: torch.device) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values])


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to E2M1 codes (uint8 in 0..15) as the hardware does: nearest, ties to even, saturating."""
    mag = x.float().abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_GOES_UP):
        above = mag >= midpoint if tie_up else mag > midpoint
        code += above.to(torch.uint8)
    # Negative inputs, -0.0 included, keep their sign bit, as cvt.rn.satfinite does.
    negative = torch.signbit(x.float())
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map E2M1 codes (uint8 0..15) to their values."""
    return _table(codes.device)[codes.long()].to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` into bytes ``[..., K/2]``: even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise Glm5Fp4Error(f"cannot pack an odd last dimension {tuple(codes.shape)} into FP4 pairs")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., K/2]`` bytes to ``[..., K]`` codes."""
    if packed.dtype != torch.uint8:
        raise Glm5Fp4Error(f"packed FP4 data must be uint8, got {packed.dtype}")
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _to_e4m3(scale: torch.Tensor) -> torch.Tensor:
    # torch's cast does not saturate (overflow becomes NaN), so clamp first; float rounding can
    # push an exact 448 a hair over.
    return scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def _check_blocks(t: torch.Tensor, what: str) -> None:
    if t.dim() < 2:
        raise Glm5Fp4Error(f"{what} must be at least 2-D [N, K], got shape {tuple(t.shape)}")
    if t.shape[-1] % BLOCK_SIZE:
        raise Glm5Fp4Error(
            f"{what} has K={t.shape[-1]} (shape {tuple(t.shape)}), not a multiple of the NVFP4 block size {BLOCK_SIZE}"
        )


def weight_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2``: amax / (6 * 448) over the last two dims (one per matrix).

    An all-zero matrix gets 1.0: any positive value encodes it exactly and it keeps later divisions finite.
    """
    amax = w.float().abs().amax(dim=(-2, -1))
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def quantize(
    w: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize weights ``[N, K]`` or ``[E, N, K]`` as ModelOpt does.

    Returns ``(packed uint8 [..., N, K/2], block_scale float8_e4m3fn [..., N, K/16], global_scale float32)``;
    the global scale is a 0-d tensor for 2-D input and ``[E]`` for batched input. Pass ``global_scale`` to
    share one scale between tensors that engines fuse (gate and up projections).
    """
    _check_blocks(w, "weight")
    if w.dim() == 3 and w.numel() > QUANTIZE_CHUNK_ELEMENTS and w.shape[0] > 1:
        return _quantize_by_expert_chunks(w, global_scale)
    wf = w.float()
    if global_scale is None:
        gs = weight_global_scale(wf)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).expand(w.shape[:-2]).clone()
    gs_b = gs[..., None, None]
    blocks = wf.unflatten(-1, (-1, BLOCK_SIZE))
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = _to_e4m3(block_amax / (E2M1_MAX * gs_b))
    block_scale = torch.where(block_scale.float() == 0, torch.ones_like(block_scale.float()), block_scale.float())
    block_scale = block_scale.to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float()[..., None] * gs_b[..., None])
    packed = pack_fp4(e2m1_encode(scaled).flatten(-2))
    return packed, block_scale, gs


# Batched input is quantized a few experts at a time above this size: the float32 temporaries are ~4x the input,
# and all 256 whole GLM-5 experts at once (39 GB of float weights) asked for 48 GiB more on a 140 GiB H200.
# Exact: every scale is per expert or per block.
QUANTIZE_CHUNK_ELEMENTS = 1 << 28


def _quantize_by_expert_chunks(w: torch.Tensor, global_scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e = w.shape[0]
    per = max(1, QUANTIZE_CHUNK_ELEMENTS // (w[0].numel()))
    gs_all = None if global_scale is None else \
        torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).expand(w.shape[:-2])
    parts = [quantize(w[i:i + per], None if gs_all is None else gs_all[i:i + per]) for i in range(0, e, per)]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(3))


def dequantize(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Exact inverse of the storage format: ``e2m1 * block_scale * global_scale`` as ``dtype``."""
    k = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], k // BLOCK_SIZE)
    if tuple(block_scale.shape) != expected:
        raise Glm5Fp4Error(
            f"block scale shape {tuple(block_scale.shape)} does not match packed weight "
            f"{tuple(packed.shape)} (expected {expected})"
        )
    values = e2m1_decode(unpack_fp4(packed)).unflatten(-1, (-1, BLOCK_SIZE))
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    gs = gs.reshape(gs.shape + (1,) * (values.dim() - gs.dim()))
    out = values * block_scale.float()[..., None] * gs
    return out.flatten(-2).to(dtype)


def activation_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The runtime global scale Blackwell kernels take: ``448 * 6 / amax`` (= ``1 / input_scale``)."""
    amax = x.float().abs().amax()
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))


def quantize_activation(
    x: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-16 block quantization with a given global scale, as Blackwell NVFP4 kernels do.

    Returns ``(codes uint8 [..., K], block_scale float8_e4m3fn [..., K/16])``; the value of element i is
    ``e2m1(code) * block_scale / global_scale``.
    """
    _check_blocks(x if x.dim() >= 2 else x[None], "activation")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    blocks = x.float().unflatten(-1, (-1, BLOCK_SIZE))
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = _to_e4m3(g * block_amax / E2M1_MAX)
    s = block_scale.float()[..., None]
    # A block whose scale underflows to zero holds only values that round to zero anyway.
    scaled = torch.where(s > 0, blocks * g / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(blocks))
    return e2m1_encode(scaled).flatten(-2), block_scale


def fake_quantize_activation(
    x: torch.Tensor, input_scale: torch.Tensor | float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantize then dequantize activations with a static ``input_scale`` (W4A4 emulation)."""
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
    g = 1.0 / input_scale
    codes, block_scale = quantize_activation(x, g)
    values = e2m1_decode(codes).unflatten(-1, (-1, BLOCK_SIZE)) * block_scale.float()[..., None]
    return (values.flatten(-2) / g).to(dtype or x.dtype)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., M, Kc]`` scales to the 128x4 swizzled layout of CUTLASS/FlashInfer.

    Rows are padded to a multiple of 128 and columns to a multiple of 4 (padding is zero);
    the result has shape ``[..., M_pad, Kc_pad]`` whose row-major bytes are the swizzled order.
    """
    if scale.dim() < 2:
        raise Glm5Fp4Error(f"scales must be at least 2-D [M, K/16], got shape {tuple(scale.shape)}")
    *batch, m, kc = scale.shape
    m_pad, kc_pad = _round_up(m, _SWIZZLE_ROWS), _round_up(kc, _SWIZZLE_COLS)
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    padded = torch.zeros((*batch, m_pad, kc_pad), dtype=raw.dtype, device=scale.device)
    padded[..., :m, :kc] = raw
    b = padded.reshape(-1, m_pad // 128, 4, 32, kc_pad // 4, 4)
    out = b.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(*batch, m_pad, kc_pad)
    return out.view(scale.dtype) if scale.dtype == torch.float8_e4m3fn else out


def unswizzle_scales(swizzled: torch.Tensor, m: int, kc: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`, cropping the padding back to ``[..., m, kc]``."""
    *batch, m_pad, kc_pad = swizzled.shape
    if m_pad % 128 or kc_pad % 4 or m > m_pad or kc > kc_pad:
        raise Glm5Fp4Error(
            f"swizzled scales of shape {tuple(swizzled.shape)} cannot hold [{m}, {kc}] "
            "(rows must be padded to 128, columns to 4)"
        )
    raw = swizzled.view(torch.uint8) if swizzled.dtype == torch.float8_e4m3fn else swizzled
    b = raw.reshape(-1, m_pad // 128, kc_pad // 4, 32, 4, 4)
    out = b.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(*batch, m_pad, kc_pad)[..., :m, :kc]
    return out.view(swizzled.dtype) if swizzled.dtype == torch.float8_e4m3fn else out


def swizzled_offset(row: int, col: int, kc_pad: int) -> int:
    """Byte offset of the scale for (row, k-block col) in a swizzled matrix with ``kc_pad`` scale columns."""
    return (
        ((row // 128) * (kc_pad // 4) + col // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + (col % 4)
    )


def nvfp4_bytes(num_elements: int) -> float:
    """Bytes an NVFP4 tensor of this many elements occupies (codes + block scales, global scale ignored)."""
    return num_elements * BYTES_PER_ELEMENT
