"""`compare` on inputs off the happy path: duplicate repeats, degenerate noise, non-finite metrics, a bad
--out, compressed or inconsistent per-request files, malformed summaries and rows.

Every input is built here, in tmp_path, in the shapes `glm5-fp4 loadtest` writes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest import compare as compare_mod
from glm5_fp4.loadtest.compare import compare_files
from loadtest_rows import make_rows

# The documented floor; read from the module so the tests follow it (20 when it is not defined yet).
MIN_BOOTSTRAP_REQUESTS = getattr(compare_mod, "MIN_BOOTSTRAP_REQUESTS", 20)

def _write_run(folder: Path, name: str, rows: list[dict] | None, *, gz: bool = False, **summary) -> str:
    """S.json (+ S.requests.jsonl, or .jsonl.gz as committed) with the summary numbers of `rows`."""
    folder.mkdir(parents=True, exist_ok=True)
    res = {"date": name, "label": name, "model_id": "m", "num_prompts": 40, "request_rate": "inf",
           "max_concurrency": 4, "completed": 0, "failed": 0, "requests_file": f"{name}.requests.jsonl",
           "metadata": {"endpoint": "completions", "input_len": 16, "output_len": 10}}
    if rows:
        ok = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("e2el_ms"), (int, float))]
        res.update(completed=len(ok), failed=len(rows) - len(ok))
        if ok:
            res.update(mean_ttft_ms=float(np.mean([r["ttft_ms"] for r in ok])),
                       mean_tpot_ms=float(np.mean([r["tpot_ms"] for r in ok])),
                       mean_e2el_ms=float(np.mean([r["e2el_ms"] for r in ok])),
                       output_throughput=4 * 10 / float(np.mean([r["e2el_ms"] for r in ok])) * 1e3)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        req = folder / f"{name}.requests.jsonl"
        if gz:
            req.with_name(req.name + ".gz").write_bytes(gzip.compress(text.encode()))
        else:
            req.write_text(text)
    res.update(summary)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(res))
    return str(path)

def _by_key(rows):
    return {r.key: r for r in rows}

# --- 1. duplicate repeats, zero spread --------------------------------------------------------------------

def test_the_same_file_twice_as_repeats_is_refused(tmp_path) -> None:
    a = _write_run(tmp_path, "a", None, completed=40, output_throughput=100.0)
    b = _write_run(tmp_path, "b", None, completed=40, output_throughput=90.0)
    with pytest.raises(Glm5Fp4Error, match=r"a\.json.*twice"):
        compare_files([f"{a},{a}", f"{b},{b}"])
    copy = tmp_path / "a_copy.json"
    copy.write_bytes(Path(a).read_bytes())
    with pytest.raises(Glm5Fp4Error, match=r"a_copy\.json.*same content"):
        compare_files([f"{a},{copy}", b])

def test_repeats_with_zero_spread_get_no_verdict(tmp_path) -> None:
    # Distinct runs whose numbers happen to agree exactly: the t interval has zero width, which is no estimate.
    a = [_write_run(tmp_path, f"a{i}", None, completed=40, output_throughput=100.0) for i in range(2)]
    b = [_write_run(tmp_path, f"b{i}", None, completed=40, output_throughput=90.0) for i in range(2)]
    _, tables, md = compare_files([",".join(a), ",".join(b)])
    thr = _by_key(tables[0])["output_throughput"]
    assert thr.ci is None and thr.verdict == "no noise estimate", thr
    assert "Significant:" not in md and "no run-to-run spread" in md

# --- 2. too few requests for the bootstrap ----------------------------------------------------------------

@pytest.mark.parametrize("n", [1, MIN_BOOTSTRAP_REQUESTS - 1])
def test_too_few_requests_give_no_bootstrap(tmp_path, n) -> None:
    a = _write_run(tmp_path / "a", "c", make_rows(n, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(n, 15.0, 1))
    _, tables, md = compare_files([a, b], n_boot=100)
    for r in tables[0]:
        if r.key not in ("completed", "failed"):
            assert r.ci is None and r.verdict in ("no noise estimate", "same", "missing"), r
    assert f"fewer than {MIN_BOOTSTRAP_REQUESTS}" in md and "Significant:" not in md

def test_enough_requests_still_bootstrap(tmp_path) -> None:
    a = _write_run(tmp_path / "a", "c", make_rows(MIN_BOOTSTRAP_REQUESTS, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(MIN_BOOTSTRAP_REQUESTS, 15.0, 1))
    _, tables, _ = compare_files([a, b], n_boot=100)
    assert _by_key(tables[0])["mean_tpot_ms"].verdict == "worse"

# --- 3. non-finite metrics --------------------------------------------------------------------------------

def test_a_nan_metric_gets_no_verdict_and_is_named(tmp_path, capsys) -> None:
    a = _write_run(tmp_path / "a", "c", make_rows(40, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(40, 10.0, 1), output_throughput=float("nan"))
    _, tables, md = compare_files([a, b], n_boot=100)
    thr = _by_key(tables[0])["output_throughput"]
    assert thr.verdict not in ("better", "worse", "within noise") and thr.ci is None, thr
    assert "output_throughput" not in (md.split("- Significant:")[1].splitlines()[0] if "Significant:" in md else "")
    assert "output_throughput" in md and f"{Path(b)}" in md and "not finite" in md
    assert cli_main(["compare", a, b, "--bootstrap", "100"]) == 1
    err = capsys.readouterr().err
    assert "output_throughput" in err and "Traceback" not in err

@pytest.mark.parametrize("field,value", [("output_throughput", "fast"), ("output_throughput", -12.5),
                                         ("mean_ttft_ms", -3.0), ("p99_itl_ms", True), ("duration", [1])])
def test_a_metric_of_the_wrong_type_or_sign_is_named(tmp_path, capsys, field, value) -> None:
    """Before: a string metric was shown as "missing" and a negative one got a better / worse verdict, exit 0."""
    a = _write_run(tmp_path / "a", "c", make_rows(40, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(40, 10.0, 1), **{field: value})
    assert cli_main(["compare", a, b, "--bootstrap", "100"]) == 1
    err = capsys.readouterr().err
    assert f"{b}: field {field!r} is {json.dumps(value)}, expected a number >= 0" in err and "Traceback" not in err

# --- 4. --out ---------------------------------------------------------------------------------------------

def test_out_refuses_an_input_and_bad_paths_before_writing(tmp_path, capsys) -> None:
    a = _write_run(tmp_path, "a", None, completed=40, output_throughput=100.0)
    b = _write_run(tmp_path, "b", None, completed=40, output_throughput=90.0)
    before = Path(a).read_bytes()
    assert cli_main(["compare", a, b, "--out", a]) == 1
    out = capsys.readouterr()
    assert Path(a).read_bytes() == before
    assert "--out" in out.err and "a.json" in out.err and out.out == ""
    (tmp_path / "adir").mkdir()
    for target, needle in ((tmp_path / "adir", "is a directory"), (tmp_path / "nope" / "x.md", "does not exist")):
        assert cli_main(["compare", a, b, "--out", str(target)]) == 1
        out = capsys.readouterr()
        assert needle in out.err and "Traceback" not in out.err and out.out == "", (target, out)
    assert not (tmp_path / "nope").exists()

# --- 5. committed .requests.jsonl.gz ----------------------------------------------------------------------

def test_the_gz_twin_of_the_requests_file_is_read(tmp_path) -> None:
    a = _write_run(tmp_path / "a", "c512", make_rows(40, 10.0, 0), gz=True)
    b = _write_run(tmp_path / "b", "c512", make_rows(40, 15.0, 1), gz=True)
    assert json.loads(Path(a).read_text())["requests_file"] == "c512.requests.jsonl"  # as committed: name kept
    _, tables, md = compare_files([a, b], n_boot=100)
    assert _by_key(tables[0])["mean_tpot_ms"].method == "bootstrap"
    assert _by_key(tables[0])["mean_tpot_ms"].verdict == "worse"

def test_a_missing_requests_file_is_named(tmp_path) -> None:
    a = _write_run(tmp_path, "a", None, completed=40, output_throughput=100.0)
    b = _write_run(tmp_path, "b", None, completed=40, output_throughput=90.0)
    _, _, md = compare_files([a, b])
    assert "a.requests.jsonl" in md and "a.requests.jsonl.gz" in md

# --- 6. per-request file vs summary -----------------------------------------------------------------------

def test_a_requests_file_of_another_size_is_refused(tmp_path) -> None:
    a = _write_run(tmp_path / "a", "c", make_rows(40, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(5, 10.0, 1), completed=40)
    with pytest.raises(Glm5Fp4Error, match=r"c\.requests\.jsonl.*5 rows.*completed 40"):
        compare_files([a, b], n_boot=100)

def test_two_summaries_sharing_one_requests_file_are_refused(tmp_path) -> None:
    a = _write_run(tmp_path, "a", make_rows(40, 10.0, 0))
    b = _write_run(tmp_path, "b", None, **{k: v for k, v in json.loads(Path(a).read_text()).items()
                                           if k not in ("date", "label")})
    with pytest.raises(Glm5Fp4Error, match=r"a\.requests\.jsonl.*a\.json.*b\.json"):
        compare_files([a, b], n_boot=100)

# --- 7. malformed inputs: one clear error each ------------------------------------------------------------

def _bad_row_file(tmp_path: Path, lines: list[str]) -> str:
    good = make_rows(40, 10.0, 0)
    path = _write_run(tmp_path, "bad", good)
    req = tmp_path / "bad.requests.jsonl"
    text = req.read_text().splitlines()
    req.write_text("\n".join(text[:3] + lines + text[3 + len(lines):]) + "\n")
    return path

@pytest.mark.parametrize("make,needle", [
    (lambda d: _write_run(d, "bad", None, completed=40, metadata=None), r"bad\.json.*'metadata'"),
    (lambda d: _write_run(d, "bad", None, completed=40, metadata="oops"), r"bad\.json.*'metadata'"),
    (lambda d: _write_run(d, "bad", None, completed=40, requests_file=123), r"bad\.json.*'requests_file'"),
    (lambda d: _write_run(d, "bad", None, completed=40, requests_file="../../etc/passwd"),
     r"bad\.json.*'requests_file'.*beside"),
    (lambda d: _write_run(d, "bad", None, completed="40"), r"bad\.json.*'completed'"),
    (lambda d: _write_run(d, "bad", None, completed=40, failed=None), r"bad\.json.*'failed'"),
    (lambda d: _bad_row_file(d, ['{"status": "ok", "ttft']), r"bad\.requests\.jsonl:4: not JSON"),
    (lambda d: _bad_row_file(d, ['{"status": "ok", "ttft_ms": 1.0}']), r"bad\.requests\.jsonl:4:.*'e2el_ms'"),
    (lambda d: _bad_row_file(d, ['{"status": "ok", "ttft_ms": 1.0, "e2el_ms": 2.0, "tpot_ms": 0.1, '
                                 '"output_tokens": null, "itl_ms": []}']), r"bad\.requests\.jsonl:4:.*'output_tokens'"),
    (lambda d: _bad_row_file(d, ['{"status": "ok", "ttft_ms": NaN, "e2el_ms": 2.0, "tpot_ms": 0.1, '
                                 '"output_tokens": 3, "itl_ms": []}']), r"bad\.requests\.jsonl:4:.*'ttft_ms'"),
    (lambda d: _bad_row_file(d, ['[1, 2]']), r"bad\.requests\.jsonl:4:.*object"),
])
def test_malformed_inputs_give_one_clear_error(tmp_path, capsys, make, needle) -> None:
    base = _write_run(tmp_path / "base", "base", make_rows(40, 10.0, 2))
    bad = make(tmp_path)
    with pytest.raises(Glm5Fp4Error, match=needle):
        compare_files([base, bad], n_boot=100)
    assert cli_main(["compare", base, bad, "--bootstrap", "100"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1, out

def test_a_truncated_gz_requests_file_is_named(tmp_path) -> None:
    base = _write_run(tmp_path / "base", "base", make_rows(40, 10.0, 2))
    bad = _write_run(tmp_path, "bad", make_rows(40, 10.0, 0), gz=True)
    gz = tmp_path / "bad.requests.jsonl.gz"
    gz.write_bytes(gz.read_bytes()[:-30])
    with pytest.raises(Glm5Fp4Error, match=r"bad\.requests\.jsonl\.gz"):
        compare_files([base, bad], n_boot=100)

def test_a_gz_or_a_directory_as_result_is_named(tmp_path) -> None:
    base = _write_run(tmp_path / "base", "base", make_rows(40, 10.0, 2))
    gz = tmp_path / "x.requests.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"status": "ok"}\n'))
    with pytest.raises(Glm5Fp4Error, match=r"x\.requests\.jsonl\.gz.*gzip"):
        compare_files([base, str(gz)])
    (tmp_path / "d").mkdir()
    with pytest.raises(Glm5Fp4Error, match=r"is a directory"):
        compare_files([base, str(tmp_path / "d")])
