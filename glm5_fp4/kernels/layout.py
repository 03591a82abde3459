"""Load-time repacking of NVFP4 experts into the layout the fused MoE kernel reads.

The engines hold experts as :class:`glm5_fp4.reference.NvFp4Experts` (checkpoint order: two E2M1 codes per
byte, even K index in the low nibble). The kernel instead reads 32-bit words, each holding one group of 8
K-elements: byte ``j`` (0..3) of the word holds element ``j`` in its low nibble and element ``4 + j`` in its
high nibble. Two consecutive words are one 16-element scale block. A thread of the MMA owns such a word
pair, and with this order four bitwise operations per word put every code into the bit positions of an
E4M3 byte (exact, value / 64); the hardware FP8 -> fp16 conversion then yields fp16 pairs that are already
the MMA's register pairs, for eight interleaved K subsets (see ``triton_moe``), all under one block scale.
Scales keep the checkpoint's linear ``[N, K/16]`` e4m3 layout; the per-expert global scales are folded
with the factor 64 that the decode leaves on every value.

The "tiled" layout stores GEMM1's weights (``w13`` and its scales) K-tile-major as well: per expert
``[H/KT, 2I, KT/2]`` bytes (scales ``[H/KT, 2I, KT/16]``), KT = :func:`w13_k_tile`, so that every K tile of a
weight tile is one contiguous run instead of one short run per row at the row stride. The tensors keep their
row-major shapes (``[E, 2I, H/2]``): only the order of the bytes inside each expert changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import NvFp4Experts

# K elements per nibble-split group (one 32-bit word): low nibbles are K offsets 0..3, high nibbles 4..7.
K_GROUP = 8
# The kernel's K tiles are whole scale blocks.
K_ALIGN = 16
# Decoding E2M1 through E4M3 (magnitude bits moved up by 2, sign to bit 7) yields value / 64.
DECODE_FACTOR = 64.0


def split_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint packing ``[..., K/2]`` -> kernel packing (per 8-group: byte j = k_j | k_{4+j} << 4)."""
    k = packed.shape[-1] * 2
    if k % K_ALIGN:
        raise Glm5Fp4Error(
            f"fused MoE kernel needs K to be a multiple of {K_ALIGN}; packed weight {tuple(packed.shape)} has K={k}"
        )
    codes = nvfp4.unpack_fp4(packed).unflatten(-1, (k // K_GROUP, 2, K_GROUP // 2))
    out = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return out.flatten(-2).contiguous()


def merge_nibbles(split: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_nibbles`."""
    k = split.shape[-1] * 2
    groups = split.unflatten(-1, (k // K_GROUP, K_GROUP // 2))
    codes = torch.stack((groups & 0xF, groups >> 4), dim=-2).flatten(-3)
    return nvfp4.pack_fp4(codes)


# The "placed" layout (and "tiled", the default, which is "placed" K-tile-major): the same 8-group words
# with each code's bits moved where triton_moe's placed decode wants them (5 bit operations per word instead of
# 7). Byte j (0..3) holds code j at the E4M3 positions (sign bit 7, magnitude bits 4..2), so ``w & 0x9C9C9C9C``
# is its E4M3 pattern; code 4+j is spread over the free bits {6,5,1,0} so that
# ``(rotl(w, 6) & 0x98989898) | ((w << 2) & 0x04040404)`` gives its pattern in byte j:
# (code bit, word bit) for code 4+j = sign (bit 3) at 8j+1, magnitude bit 2 at 8(j-1)+6 and bit 1 at 8(j-1)+5
# (mod 32: the rotate wraps), bit 0 at 8j.
# Overrides default_layout() (A/B runs, memcheck): "split", "placed" or "tiled".
LAYOUT_ENV = "GLM5_FP4_EXPERT_LAYOUT"


def _placed_hi_bits(j: int) -> tuple[tuple[int, int], ...]:
    """(code bit, word bit) of code 4+j of a placed word."""
    return ((3, 8 * j + 1), (2, (8 * j - 2) % 32), (1, (8 * j - 3) % 32), (0, 8 * j))


def _placed_lo_bits(j: int) -> tuple[tuple[int, int], ...]:
    """(code bit, word bit) of code j of a placed word: the E4M3 byte ``(c & 8) << 4 | (c & 7) << 2``."""
    return ((3, 8 * j + 7), (2, 8 * j + 4), (1, 8 * j + 3), (0, 8 * j + 2))


def place_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint packing ``[..., K/2]`` -> the placed layout (same shape; 4 bytes per 8-group word)."""
    k = packed.shape[-1] * 2
    if k % K_ALIGN:
        raise Glm5Fp4Error(
            f"fused MoE kernel needs K to be a multiple of {K_ALIGN}; packed weight {tuple(packed.shape)} has K={k}"
        )
    codes = nvfp4.unpack_fp4(packed).unflatten(-1, (k // K_GROUP, K_GROUP)).to(torch.int32)
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=packed.device)
    for j in range(4):
        for code, bits in ((codes[..., j], _placed_lo_bits(j)), (codes[..., 4 + j], _placed_hi_bits(j))):
            for cb, wb in bits:
                word |= ((code >> cb) & 1).to(torch.int64) << wb
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)
    return out.flatten(-2).contiguous()


def unplace_nibbles(placed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`place_nibbles` (placed bytes -> checkpoint packing)."""
    k = placed.shape[-1] * 2
    by = placed.unflatten(-1, (k // K_GROUP, 4)).to(torch.int64)
    word = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)
    codes = []
    for j in range(8):
        bits = _placed_lo_bits(j) if j < 4 else _placed_hi_bits(j - 4)
        c = torch.zeros_like(word)
        for cb, wb in bits:
            c |= ((word >> wb) & 1) << cb
        codes.append(c)
    return nvfp4.pack_fp4(torch.stack(codes, dim=-1).flatten(-2).to(torch.uint8))


@dataclass
class PreparedExperts:
    """Experts in the fused kernel's layout. Build with :func:`prepare_experts`.

    ``w13``: ``[E, 2I, H/2]`` uint8 nibble-split, gate rows then up rows; ``w13_scale``: ``[E, 2I, H/16]``
    e4m3 viewed as uint8 (layout "tiled": both K-tile-major inside each expert, :func:`tile_k`). ``w2``: ``[E, H, I/2]``; ``w2_scale``: ``[E, H, I/16]``. ``w13_alpha``/``w2_alpha``:
    ``[E]`` float32 epilogue factors = weight global scale * 64. ``a13_scale``/``a2_scale``: static activation
    ``input_scale`` per expert (W4A4), ``a13_gscale``/``a2_gscale`` their inverses (the quantizer's global).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_alpha: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_alpha: torch.Tensor
    a13_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None
    a13_gscale: torch.Tensor | None
    a2_gscale: torch.Tensor | None
    # The checkpoint-layout experts, kept only for CPU tensors (the CPU path computes from them).
    source: NvFp4Experts | None = field(default=None, repr=False)
    # "split": the W4A16/W4A4-emulation kernels' nibble order (alphas include DECODE_FACTOR).
    # "placed": the split kernels with the cheaper decode (place_nibbles; same alphas as "split").
    # "tiled": "placed", with w13 and its scales stored K-tile-major (tile_k; GEMM2's w2 stays row-major).
    # "checkpoint": unchanged packing for the native FP4 MMA path (native_fp4.py; alphas = global scales).
    layout: str = "split"

    @property
    def decode_factor(self) -> float:
        return 1.0 if self.layout == "checkpoint" else DECODE_FACTOR

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def has_input_scales(self) -> bool:
        return self.a13_scale is not None and self.a2_scale is not None

    def to_experts(self) -> NvFp4Experts:
        """Rebuild the checkpoint-layout experts (for the CPU path and tests)."""
        if self.source is not None:
            return self.source
        f8 = torch.float8_e4m3fn
        unpack = _NIBBLES[self.layout][1] if self.layout in _NIBBLES else (lambda t: t)
        kt = w13_k_tile(self.layout, self.hidden_size)
        return NvFp4Experts(
            w13=unpack(untile_k(self.w13, kt, 2)),
            w13_scale=untile_k(self.w13_scale, kt, 16).view(f8),
            w13_global=self.w13_alpha / self.decode_factor,
            w2=unpack(self.w2),
            w2_scale=self.w2_scale.view(f8),
            w2_global=self.w2_alpha / self.decode_factor,
            a13_scale=self.a13_scale,
            a2_scale=self.a2_scale,
        )

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors the custom op takes, by name (a stable order for ``torch.library``)."""
        return {
            "w13": self.w13,
            "w13_scale": self.w13_scale,
            "w13_alpha": self.w13_alpha,
            "w2": self.w2,
            "w2_scale": self.w2_scale,
            "w2_alpha": self.w2_alpha,
            "a13_scale": self.a13_scale,
            "a2_scale": self.a2_scale,
            "a13_gscale": self.a13_gscale,
            "a2_gscale": self.a2_gscale,
        }


def _chunked(fn, packed: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    # Unpacking a whole layer at once needs 2 bytes per element of scratch (~1.6 GB at GLM-5 TP4 sizes; the
    # placed layout's int64 words 8 bytes per 8 elements more); a few experts at a time keep the transient
    # small on a GPU that already holds the model.
    out = torch.empty_like(packed)
    for start in range(0, packed.shape[0], chunk):
        out[start : start + chunk] = fn(packed[start : start + chunk])
    return out


# Layouts the decoding (W4A16 / W4A4-emulation) kernels read, and all layouts ("checkpoint": the native path's).
DECODE_LAYOUTS = ("split", "placed", "tiled")
LAYOUTS = (*DECODE_LAYOUTS, "checkpoint")
# Layouts whose words are in place_nibbles order (the decode kernels' PLACED form).
PLACED_LAYOUTS = ("placed", "tiled")
# Checkpoint packing -> stored words, per decode layout (and back, for to_experts).
_NIBBLES = {"split": (split_nibbles, merge_nibbles), **{n: (place_nibbles, unplace_nibbles) for n in PLACED_LAYOUTS}}
# K elements per contiguous run of a "tiled" w13 row: 256 = one 128-byte line of words per row (16 scale bytes).
# Which GEMM1 tiles can read the runs is launch._check's rule (the kernel asserts it too).
W13_K_TILE = 256


def w13_k_tile(layout: str, hidden: int) -> int:
    """K elements per contiguous run of w13 under ``layout``: 0 = row-major (whole rows).

    "tiled": :data:`W13_K_TILE`, or 128 where H is not a multiple of it (prepare_experts allows H = 128 * odd)."""
    if layout != "tiled":
        return 0
    return W13_K_TILE if hidden % W13_K_TILE == 0 else W13_K_TILE // 2


def tile_k(t: torch.Tensor, k_tile: int, k_per_unit: int) -> torch.Tensor:
    """``[E, R, K/k_per_unit]`` row-major -> the same shape holding ``[E, K/k_tile, R, k_tile/k_per_unit]``
    (``k_per_unit``: K elements per stored element: 2 for packed codes, 16 for block scales). 0 = unchanged."""
    if not k_tile:
        return t
    e, r, n = t.shape
    w = k_tile // k_per_unit
    return t.reshape(e, r, n // w, w).transpose(1, 2).contiguous().reshape(e, r, n)


def untile_k(t: torch.Tensor, k_tile: int, k_per_unit: int) -> torch.Tensor:
    """Inverse of :func:`tile_k`."""
    if not k_tile:
        return t
    e, r, n = t.shape
    w = k_tile // k_per_unit
    return t.reshape(e, n // w, r, w).transpose(1, 2).contiguous().reshape(e, r, n)


def default_layout() -> str:
    """The layout prepare_experts uses when none is asked for: "tiled", or what LAYOUT_ENV names (A/B).

    "placed" became the default on 2026-12-01 (faster than "split", bit-identical output), "tiled" ("placed" with
    GEMM1's weights K-tile-major) on 2026-12-03: improvements/15 has the H200 A/B. Not measured on sm_120."""
    return layout_from_env()


def layout_from_env(environ=None) -> str:
    """LAYOUT_ENV's layout ("tiled" where unset or empty), refused by name where it is not a decode layout."""
    import os

    name = (os.environ if environ is None else environ).get(LAYOUT_ENV) or "tiled"
    if name not in DECODE_LAYOUTS:
        raise Glm5Fp4Error(f"{LAYOUT_ENV}={name!r}: choose one of {', '.join(DECODE_LAYOUTS)} (the native path's "
                           "checkpoint layout is asked for by the caller, not by default)")
    return name


def prepare_experts(experts: NvFp4Experts, layout: str | None = None) -> PreparedExperts:
    """Repack engine-layout experts once after loading. Validates shapes first.

    ``layout`` (default: :func:`default_layout`): "tiled" ("placed" with GEMM1's weights K-tile-major,
    :func:`tile_k`), "placed" (the cheaper decode's nibble order), "split" (the same kernels with the plain nibble
    order and two more bit operations per decoded word), or "checkpoint" (the checkpoint packing kept for the
    native FP4 MMA path, SM100/SM120, W4A4 only, unverified: see :mod:`glm5_fp4.kernels.native_fp4`).
    """
    layout = layout or default_layout()
    if layout not in LAYOUTS:
        raise Glm5Fp4Error(f"unknown expert layout {layout!r}; choose one of {LAYOUTS}")
    experts.validate()
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    for name, dim in (("hidden_size", h), ("intermediate_size", i)):
        # each of the 8 K subsets of a tile must give the MMA at least 16 K values
        if dim % 128:
            raise Glm5Fp4Error(f"fused MoE kernel needs {name} to be a multiple of 128, got {dim}")
    keep_source = experts.w13.device.type == "cpu"

    def inv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else (1.0 / t.float()).contiguous()

    a13 = None if experts.a13_scale is None else experts.a13_scale.float().contiguous()
    a2 = None if experts.a2_scale is None else experts.a2_scale.float().contiguous()
    nibbles = _NIBBLES[layout][0] if layout in _NIBBLES else None
    factor = 1.0 if layout == "checkpoint" else DECODE_FACTOR
    kt = w13_k_tile(layout, h)

    def pack(t: torch.Tensor, k_tile: int = 0) -> torch.Tensor:
        if nibbles is None:
            return t
        return _chunked(lambda c: tile_k(nibbles(c), k_tile, 2), t)

    return PreparedExperts(
        w13=pack(experts.w13.contiguous(), kt),
        w13_scale=tile_k(experts.w13_scale.contiguous().view(torch.uint8), kt, 16),
        w13_alpha=(experts.w13_global.float() * factor).contiguous(),
        w2=pack(experts.w2.contiguous()),
        w2_scale=experts.w2_scale.contiguous().view(torch.uint8),
        w2_alpha=(experts.w2_global.float() * factor).contiguous(),
        a13_scale=a13,
        a2_scale=a2,
        a13_gscale=inv(a13),
        a2_gscale=inv(a2),
        source=experts if keep_source else None,
        layout=layout,
    )
