"""The ncu source-page reader (glm5_fp4.profiling.ncu_source, benchmarks/ncu_stalls.py): the shares improvements/27
cites recomputed from the committed export, a synthetic two-kernel export read plain and gzipped, and one clear error
(no traceback, exit 2) for each kind of bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling import ncu_source as N
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
T1024 = ROOT / "benchmarks" / "results" / "moe_kernel_h100_ncu_source_tp8_t1024_7635a60.csv.gz"
HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",' \
         '"# Samples","Instructions Executed","Thread Instructions Executed"'


def _row(addr, src, samples, executed):
    return f'"{addr}","{src}","{samples}","0","{samples}","{executed}","0"'


def _export(sections) -> str:
    out = []
    for name, rows in sections:
        out.append(f'"Kernel Name","{name}",')
        out.append(HEADER)
        out += [_row(f"0x{i:x}", *r) for i, r in enumerate(rows)]
    return "\n".join(out) + "\n"


SYNTH = _export([
    ("moe_gemm1_kernel", [("      LDC R1, c[0x0][0x28]", 5, 100), ("      @!P0  LDS.U8 R25, [R24+0xa000]", 60, "1,000"),
                          ("      WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 1000), ("      EXIT", 5, 100)]),
    ("moe_finalize_kernel", [("      LDG.E R2, desc[UR4][R2.64]", 9, 10), ("      EXIT", 1, 10)]),
])


def test_improvements_27_shares_recomputed_from_the_committed_file():
    (g2,) = N.pick(N.read(T1024), "gemm2")
    assert g2.name == "moe_gemm2_grouped_kernel" and g2.samples == 16_056 and len(g2.instructions) == 920
    by_index = {i.index: i for i in g2.instructions}
    assert by_index[499].source.startswith("DEPBAR.LE SB0") and by_index[500].samples == 2_153
    assert round(100 * g2.share(by_index[500]), 1) == 13.4  # the weight ring's wait, on the next instruction
    assert round(100 * g2.share(by_index[511]), 1) == 8.5
    depbar = sum(i.samples for i in g2.instructions if i.source.startswith("WARPGROUP.DEPBAR")) / g2.samples
    assert round(100 * depbar, 1) == 11.5
    assert [k.name for k in N.read(T1024)] == ["moe_align_kernel", "moe_scatter_kernel", "moe_gemm1_kernel",
                                               "moe_gemm2_grouped_kernel", "moe_finalize_kernel"]


@pytest.mark.parametrize("gz", [False, True])
def test_synthetic_export(tmp_path, gz):
    p = tmp_path / ("s.csv.gz" if gz else "s.csv")
    p.write_bytes(gzip.compress(SYNTH.encode()) if gz else SYNTH.encode())
    g1, fin = N.read(p)
    assert (g1.name, g1.samples, g1.executed, fin.samples) == ("moe_gemm1_kernel", 100, 2200, 10)
    assert [i.opcode for i in g1.instructions] == ["LDC", "LDS", "WARPGROUP", "EXIT"]  # predicate, modifiers dropped
    assert [i.index for i in g1.top(2)] == [1, 2]  # the two hottest, in listing order
    assert g1.by_opcode()[0] == ("LDS", 60)
    s = N.summary(g1, top=1)
    assert s["top"] == [{"index": 1, "samples": 60, "share": 0.6, "executed": 1000,
                         "source": "@!P0  LDS.U8 R25, [R24+0xa000]"}]
    assert "| 1 | 60 | 60.0 % | 1,000 | `@!P0  LDS.U8 R25, [R24+0xa000]` |" in N.markdown(s)
    assert [k.name for k in N.pick([g1, fin], "final")] == ["moe_finalize_kernel"]


@pytest.mark.parametrize("text,match", [
    ("", "not an ncu source-page CSV"),
    ('"Kernel Name","k",\n"Address","Source","# Samples"\n"0x0","EXIT","1"\n', r"header lacks \['Warp Stall"),
    (_export([("k", [("EXIT", "lots", 1)])]), r"kernel k, instruction 0: column .* is 'lots', not a number"),
    ('"Kernel Name","k",\n' + HEADER + '\n"0x0","EXIT"\n', "instruction 0: 2 fields"),
])
def test_bad_exports_get_one_clear_error(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(Glm5Fp4Error, match=match) as info:
        N.read(p)
    assert str(p) in str(info.value)


def test_corrupt_gzip_gets_one_clear_error(tmp_path):
    raw = gzip.compress(SYNTH.encode())
    p = tmp_path / "corrupt.csv.gz"
    p.write_bytes(raw[:10] + bytes(b ^ 0xFF for b in raw[10:30]) + raw[30:])  # header intact, deflate data not
    with pytest.raises(Glm5Fp4Error, match="cannot read it as text or gzip") as info:
        N.read(p)
    assert str(p) in str(info.value)


def test_cli_errors_exit_2_without_a_traceback(tmp_path, capsys):
    cli = load_script("benchmarks/ncu_stalls.py", "ncu_stalls_script")
    assert cli.main([str(tmp_path / "missing.csv.gz")]) == 2
    assert "no such file" in capsys.readouterr().err
    p = tmp_path / "s.csv"
    p.write_text(SYNTH)
    assert cli.main([str(p), "--kernel", "gemm2"]) == 2
    err = capsys.readouterr().err
    assert "no kernel matching 'gemm2'" in err and "moe_gemm1_kernel" in err and "Traceback" not in err
    out_json = tmp_path / "o.json"
    assert cli.main([str(p), "--kernel", "gemm1", "--top", "2", "--listing", "1:3", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "moe_gemm1_kernel, instructions 1..2:" in out and "WARPGROUP.DEPBAR" in out
    assert '"samples": 100' in out_json.read_text()
    with pytest.raises(SystemExit):
        cli.main([str(p), "--listing", "5:2"])
