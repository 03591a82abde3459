"""benchmarks/moe_kernel.py --sweep's variant list (the sweep itself needs a GPU): GEMM2's splits along H."""

from __future__ import annotations

import dataclasses

import pytest
from script_modules import load_script

from glm5_fp4.kernels import configs as C


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/moe_kernel.py", "moe_kernel_bench")


@pytest.mark.parametrize("t,intermediate", [(64, 256), (256, 256), (512, 256), (256, 512)])
def test_sweep_tries_every_gemm2_split_of_the_default_tile(bench, t, intermediate):
    """Each split of GEMM2_SPLITS that cuts H into whole N tiles, for the default tile and every candidate of its
    shape, named by tile and split, each variant the base plan with only GEMM2's tile and split changed."""
    base = C.plan("sm90", t, 256, 8, 6144, intermediate, sm_count=132)
    variants = bench.sweep_variants(base, 6144, intermediate, "sm90")
    n_tiles = 6144 // base.gemm2.bn
    splits = {v.gemm2_n_split for n, v in variants.items() if n.startswith("g2 n")}
    assert splits == {s for s in bench.GEMM2_SPLITS if n_tiles % s == 0} - {base.gemm2_n_split}
    same_shape = [g for g in C.GEMM2_CANDIDATES["sm90"] if (g.bn, g.bm) == (base.gemm2.bn, base.gemm2.bm)]
    for g2 in same_shape:
        tried = {v.gemm2_n_split for v in variants.values() if v.gemm2 == g2}
        assert {s for s in bench.GEMM2_SPLITS if n_tiles % s == 0} <= tried | {base.gemm2_n_split}, g2
    for name, v in variants.items():
        if name.startswith("g2 ") and "slots" not in name:
            assert dataclasses.replace(v, gemm2=base.gemm2, gemm2_n_split=base.gemm2_n_split,
                                       gemm2_unroll=base.gemm2_unroll) == base, name
            assert name.endswith(f" n{v.gemm2_n_split}"), name


@pytest.mark.parametrize("form", [None, "dedup_by_arrival"])
def test_sweep_splits_the_slot_dedups_gemm2_along_h(bench, form):
    """At T = 4 (slot dedup, the default's or the opt-in form's), GEMM2 is the grouped kernel over groups: the sweep
    tries DEDUP_GEMM2_SPLITS for its tile, each variant keeping the base's form (--form sweeps around an opt-in
    form's plan)."""
    base = C.plan("sm90", 4, 256, 8, 6144, 256, sm_count=132, form=form)
    assert base.slot_dedup and base.dedup_fused_finalize == (form is not None)
    variants = bench.sweep_variants(base, 6144, 256, "sm90")
    splits = {v.gemm2_n_split for n, v in variants.items() if n.startswith("g2 n")}
    assert splits == set(bench.DEDUP_GEMM2_SPLITS) - {base.gemm2_n_split}
    assert all(v.dedup_fused_finalize == base.dedup_fused_finalize for v in variants.values())


@pytest.mark.parametrize("argv,msg", [(["--form", "dedup_by_arrival"], "needs --sweep"),
                                      (["--sweep", "--form", "nope"], "unknown --form")])
def test_sweep_form_is_checked_before_any_gpu_work(bench, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("form", [None, "dedup_by_arrival", "finalize_4096", "per_slot_split"])
def test_a_swept_plan_reads_back_from_its_json(bench, form):
    """--plans rebuilds the sweep's best plans from its JSON: every Plan field, so a form's own fields
    (dedup_fused_finalize, finalize_block...) are what the table and ncu then time."""
    t = 4
    plan = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132, form=form)
    assert bench._plan_of(dataclasses.asdict(plan)) == plan
