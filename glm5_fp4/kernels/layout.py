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


@dataclass
class PreparedExperts:
    """Experts in the fused kernel's layout. Build with :func:`prepare_experts`.

    ``w13``: ``[E, 2I, H/2]`` uint8 nibble-split, gate rows then up rows; ``w13_scale``: ``[E, 2I, H/16]``
    e4m3 viewed as uint8. ``w2``: ``[E, H, I/2]``; ``w2_scale``: ``[E, H, I/16]``. ``w13_alpha``/``w2_alpha``:
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
    # "checkpoint": unchanged packing for the native FP4 MMA path (native_fp4.py; alphas = global scales).
    layout: str = "split"

    @property
    def decode_factor(self) -> float:
        return DECODE_FACTOR if self.layout == "split" else 1.0

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
        unpack = merge_nibbles if self.layout == "split" else (lambda t: t)
        return NvFp4Experts(
            w13=unpack(self.w13),
            w13_scale=self.w13_scale.view(f8),
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


def _split_chunked(packed: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    # Unpacking a whole layer at once needs 2 bytes per element of scratch (~1.6 GB at GLM-5 TP4 sizes);
    # a few experts at a time keep the transient small on a GPU that already holds the model.
    out = torch.empty_like(packed)
    for start in range(0, packed.shape[0], chunk):
        out[start : start + chunk] = split_nibbles(packed[start : start + chunk])
    return out


LAYOUTS = ("split", "checkpoint")


def prepare_experts(experts: NvFp4Experts, layout: str = "split") -> PreparedExperts:
    """Repack engine-layout experts once after loading. Validates shapes first.

    ``layout="checkpoint"`` keeps the checkpoint packing for the native FP4 MMA path (SM100/SM120, W4A4
    only, unverified: see :mod:`glm5_fp4.kernels.native_fp4`).
    """
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
    split = layout == "split"
    pack = _split_chunked if split else (lambda t: t)
    factor = DECODE_FACTOR if split else 1.0
    return PreparedExperts(
        w13=pack(experts.w13.contiguous()),
        w13_scale=experts.w13_scale.contiguous().view(torch.uint8),
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
