"""Random NVFP4 experts and the same-run baselines of the MoE benchmark.

Timing experts carry random codes and scales drawn straight in the checkpoint layout (the content does not
change the kernels' speed, but zeros would: random bytes everywhere, block scales 2^-2 .. 2^2 so every
value is finite), then repacked by :func:`glm5_fp4.kernels.prepare_experts` exactly as an engine would.
Baselines on the same shapes: ``torch._grouped_mm`` on bf16 weights and ``torch._scaled_grouped_mm`` on
fp8 weights (row-wise scales, dynamic activation quantization), each including the token gather, SwiGLU
and the weighted combine; their routing sort is precomputed outside the timing.
"""

from __future__ import annotations

import torch

from glm5_fp4.reference import NvFp4Experts


def random_nvfp4_experts(e: int, h: int, i: int, gen: torch.Generator, device="cuda") -> NvFp4Experts:
    """Random-code experts in the checkpoint layout, with static input scales for W4A4."""

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)

    def scales(*shape):
        # e4m3 bytes 0x28..0x47: 2^-2 .. 2^2 (no NaN encodings)
        return torch.randint(0x28, 0x48, shape, dtype=torch.uint8, device=device, generator=gen).view(torch.float8_e4m3fn)

    def glob():
        return (torch.rand(e, device=device, generator=gen) * 1e-3 + 1e-3).float()

    return NvFp4Experts(
        w13=codes(e, 2 * i, h // 2), w13_scale=scales(e, 2 * i, h // 16), w13_global=glob(),
        w2=codes(e, h, i // 2), w2_scale=scales(e, h, i // 16), w2_global=glob(),
        a13_scale=torch.full((e,), 3.5 / 2688, device=device), a2_scale=torch.full((e,), 1.5 / 2688, device=device),
    )


def nvfp4_weight_bytes(e: int, h: int, i: int) -> int:
    """NVFP4 bytes of ``e`` experts' three projections (codes, E4M3 block scales, global scales)."""
    from glm5_fp4 import nvfp4

    return e * nvfp4.nvfp4_bytes(3 * i * h)


class GroupedBaselines:
    """bf16 / fp8 grouped GEMMs over padded, pre-sorted token groups (sort outside the timing)."""

    def __init__(self, e: int, h: int, i: int, gen: torch.Generator):
        self.e, self.h, self.i = e, h, i
        self.w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
        self.w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).to(torch.bfloat16)
        fp8 = torch.float8_e4m3fn
        s13 = self.w13.float().abs().amax(-1) / 448
        s2 = self.w2.float().abs().amax(-1) / 448
        self.w13_f8 = (self.w13.float() / s13[..., None]).to(fp8)
        self.w2_f8 = (self.w2.float() / s2[..., None]).to(fp8)
        self.s13, self.s2 = s13.float(), s2.float()

    @staticmethod
    def groups(topk_ids: torch.Tensor, e: int, align: int = 16):
        """Padded gather order: each expert's rows padded to a multiple of ``align`` (pad rows repeat row 0)."""
        flat = topk_ids.flatten().long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        padded = (counts + align - 1) // align * align
        starts = torch.cumsum(counts, 0) - counts
        pstarts = torch.cumsum(padded, 0) - padded
        total = int(padded.sum())
        row = torch.arange(total, device=flat.device)
        ex = torch.repeat_interleave(torch.arange(e, device=flat.device), padded)
        within = row - pstarts[ex]
        valid = within < counts[ex]
        slot_idx = torch.where(valid, order[(starts[ex] + within).clamp(max=flat.numel() - 1)], 0)
        offs = torch.cumsum(padded, 0).to(torch.int32)
        return slot_idx, valid, offs

    def bf16(self, x, tw, topk_ids, slot_idx, valid, offs):
        k = topk_ids.shape[1]
        tok = slot_idx // k
        wt = torch.where(valid, tw.flatten()[slot_idx], 0.0)

        def run():
            xg = x.index_select(0, tok)
            gu = torch._grouped_mm(xg, self.w13.transpose(1, 2), offs=offs)
            g, u = gu.chunk(2, dim=-1)
            act = torch.nn.functional.silu(g) * u
            y = torch._grouped_mm(act, self.w2.transpose(1, 2), offs=offs)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, (y.float() * wt[:, None]).to(x.dtype))
            return out

        return run

    def fp8(self, x, tw, topk_ids, slot_idx, valid, offs):
        k = topk_ids.shape[1]
        tok = slot_idx // k
        wt = torch.where(valid, tw.flatten()[slot_idx], 0.0)
        fp8 = torch.float8_e4m3fn

        def q(a):
            s = a.float().abs().amax(-1).clamp(min=1e-12) / 448
            return (a.float() / s[:, None]).to(fp8), s

        def run():
            xg = x.index_select(0, tok)
            xq, xs = q(xg)
            gu = torch._scaled_grouped_mm(xq, self.w13_f8.transpose(1, 2), xs, self.s13, offs=offs,
                                          out_dtype=torch.bfloat16)
            g, u = gu.chunk(2, dim=-1)
            aq, as_ = q(torch.nn.functional.silu(g) * u)
            y = torch._scaled_grouped_mm(aq, self.w2_f8.transpose(1, 2), as_, self.s2, offs=offs,
                                         out_dtype=torch.bfloat16)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, (y.float() * wt[:, None]).to(x.dtype))
            return out

        return run
