"""The MoE benchmark's distinct layers per CUDA graph against the GPU's L2: replays of layers whose weights fit in L2
read them from there and report more than DRAM can deliver (no GPU needed: the rule and the table's mark)."""

from __future__ import annotations

import math

import pytest

from glm5_fp4.bench import moe as B
from glm5_fp4.bench.experts import nvfp4_weight_bytes

MB = 1024**2


@pytest.mark.parametrize("shard,l2_mb,want", [
    ("tp8", 50, 5),    # H100 / H200: k=8 experts of the TP8 shard are 21.2 MB a layer; 4 layers were 1.7x the L2
    ("tp8", 128, 13),  # RTX PRO 6000 (GB202): 4 layers (85 MB) fit in its L2 whole
    ("tp4", 50, 4),    # 42.5 MB a layer: the floor of 4 is enough
    ("tp8", None, 4),  # L2 unknown (not a CUDA device): the floor
])
def test_enough_layers_that_the_fewest_touched_experts_overflow_l2(shard, l2_mb, want):
    sh = B.glm5_shard(shard)
    l2 = None if l2_mb is None else l2_mb * MB
    n = B.layers_for(sh, l2)
    assert n == want
    if l2:
        fewest = nvfp4_weight_bytes(sh.top_k, sh.hidden, sh.intermediate)
        assert n * fewest >= B.L2_MARGIN * l2 and (n == B.DEFAULT_LAYERS or (n - 1) * fewest < B.L2_MARGIN * l2)


def test_memory_caps_the_layers_but_never_below_the_floor():
    sh = B.glm5_shard("tp8")  # 680 MB a layer, 13 wanted for a 128 MB L2
    layer = nvfp4_weight_bytes(sh.num_experts, sh.hidden, sh.intermediate)
    assert B.layers_for(sh, 128 * MB, free_bytes=12 * layer * B.LAYER_COPIES) == 6  # half the free memory
    assert B.layers_for(sh, 128 * MB, free_bytes=layer) == B.DEFAULT_LAYERS


def test_rows_whose_layers_fit_in_l2_are_marked_in_the_table():
    meta = dict(gpu="test", date="d", git_sha="s", copy_gbs=1000.0, bf16_tflops=100.0, layers={"tp8": 4},
                l2_bytes=128 * MB)
    base = dict(shard="tp8", routing="balanced", experts_touched=8, max_tokens_per_expert=1, floor_us=20.0,
                pct_copy_bw=90.0, tflops=1.0, pct_bf16=1.0, skew_ratio=1.0)
    rows = [dict(base, tokens=1, us=22.0, l2_may_serve=True), dict(base, tokens=512, us=300.0, l2_may_serve=False)]
    md = B.markdown(meta, rows)
    t1 = next(ln for ln in md.splitlines() if ln.startswith("| tp8 | 1 |"))
    t512 = next(ln for ln in md.splitlines() if ln.startswith("| tp8 | 512 |"))
    assert "22.0 †" in t1 and "†" not in t512
    assert "† " in md and "L2 (128 MB)" in md and "4 distinct layers" in md
    assert "(tp8: 13, tp4: 7) distinct layers" in B.markdown(dict(meta, layers={"tp8": 13, "tp4": 7}), rows)
    assert math.isclose(B.L2_MARGIN, 2.0)


def test_the_l2_rule_is_one_function_the_table_and_the_sweep_share():
    """The sweep's points had no mark at all (only the table's rows did): both now ask B.l2_may_serve."""
    import torch
    from script_modules import load_script

    eight = nvfp4_weight_bytes(8, 6144, 256)  # the TP8 shard's k experts: 21.2 MB
    assert B.l2_may_serve(4, eight, 50 * MB) is True and B.l2_may_serve(5, eight, 50 * MB) is False
    assert B.l2_may_serve(4, eight, None) is None  # not a CUDA device: unknown, not "no"
    mk = load_script("benchmarks/moe_kernel.py", "moe_kernel_bench")
    sh = B.glm5_shard("tp8")
    same_k = torch.arange(8).repeat(64, 1)  # 64 tokens all on experts 0-7
    point = mk.sweep_point(sh, 64, "same_k", "grouped", 4, same_k, 50 * MB)
    assert point["experts_touched"] == 8 and point["l2_may_serve"] is True and point["layers"] == 4
    assert mk.sweep_point(sh, 64, "same_k", "grouped", 5, same_k, 50 * MB)["l2_may_serve"] is False
    spread = torch.arange(64 * 8).view(64, 8) % 256  # 256 experts touched: 680 MB a layer
    assert mk.sweep_point(sh, 64, "balanced", "grouped", 4, spread, 50 * MB)["l2_may_serve"] is False


def test_an_expert_parallel_tables_skew_is_said_to_be_load_imbalance():
    """On an EP shard the skewed routings put their hot experts on the measured rank (the worst case for it), which
    then has more slots than a balanced rank: H100, 2026-12-07, ep8 T=512 same_k 3.26x balanced at 39 % of bf16.
    That ratio is the ranks' load imbalance, not the kernel's schedule, and the table says so where EP rows are."""
    meta = dict(gpu="test", date="d", git_sha="s", copy_gbs=1000.0, bf16_tflops=100.0, layers={"ep8": 5})
    base = dict(routing="same_k", tokens=512, experts_touched=8, max_tokens_per_expert=512, floor_us=60.0,
                pct_copy_bw=6.0, tflops=290.0, pct_bf16=39.0, skew_ratio=3.26, us=1064.0)
    assert "load imbalance" in B.markdown(meta, [dict(base, shard="ep8")])
    assert "load imbalance" not in B.markdown(dict(meta, layers={"tp8": 5}), [dict(base, shard="tp8")])
