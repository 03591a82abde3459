"""improvements/: the committed index matches the files; `improvements new` numbers, fills and re-indexes."""

import re
import shutil
from pathlib import Path

import pytest

from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.improvements.writeups import PACKAGED_TEMPLATE, list_writeups, read_writeup, regenerate_index

REPO_IMPROVEMENTS = Path(__file__).resolve().parents[1] / "improvements"


def test_committed_index_is_up_to_date():
    assert regenerate_index(REPO_IMPROVEMENTS, check=True), "run `glm5-fp4 improvements index`"
    text = (REPO_IMPROVEMENTS / "README.md").read_text()
    for w in list_writeups(REPO_IMPROVEMENTS):
        assert f"]({w.path.name})" in text and w.headline in text


@pytest.fixture()
def workdir(tmp_path):
    d = tmp_path / "improvements"
    d.mkdir()
    shutil.copy(PACKAGED_TEMPLATE, d)
    shutil.copy(REPO_IMPROVEMENTS / "README.md", d)
    regenerate_index(d)
    return d


# what `glm5-fp4 compare` writes (loadtest.compare.markdown_block): its heading, the runs, the table
COMPARE_BLOCK = ("### B vs A\n\n- Baseline **A**: c512 (1 run: `a.json`)\n- Candidate **B**: c512 (1 run: `b.json`)\n\n"
                 "| metric | A | B | delta |\n|---|---|---|---|\n| output_throughput | 100 | 120 | +20.0 % |\n")


def test_new_writeups_are_numbered_and_indexed(workdir, tmp_path):
    compare = tmp_path / "compare.md"
    compare.write_text(COMPARE_BLOCK)
    assert main(["improvements", "new", "--title", "Fused MoE kernel!", "--dir", str(workdir)]) == 0
    assert main(["improvements", "new", "--title", "CUDA graphs", "--from", str(compare), "--dir", str(workdir)]) == 0
    files = sorted(p.name for p in workdir.glob("0*.md"))
    assert files == ["01-fused-moe-kernel.md", "02-cuda-graphs.md"]
    second = read_writeup(workdir / files[1])
    assert second.status == "measured"
    assert "| output_throughput | 100 | 120 | +20.0 % |" in (workdir / files[1]).read_text()
    assert regenerate_index(workdir, check=True)
    readme = (workdir / "README.md").read_text()
    assert "[Fused MoE kernel!](01-fused-moe-kernel.md)" in readme and "[CUDA graphs](02-cuda-graphs.md)" in readme
    # A hand edit to a write-up's headline makes the index stale until regenerated.
    p = workdir / files[0]
    p.write_text(p.read_text().replace("TODO: one line with the measured number", "3.1x faster"))
    assert not regenerate_index(workdir, check=True)
    assert main(["improvements", "index", "--check", "--dir", str(workdir)]) == 1
    assert main(["improvements", "index", "--dir", str(workdir)]) == 0
    assert "3.1x faster" in (workdir / "README.md").read_text()


def test_bad_writeups_name_the_file_and_field(workdir):
    bad = workdir / "03-bad.md"
    bad.write_text("---\nnumber: 3\ntitle: x\nstatus: done\nheadline: y\n---\nbody\n")
    with pytest.raises(Glm5Fp4Error, match="03-bad.md: field 'status'"):
        list_writeups(workdir)
    bad.write_text("---\nnumber: 4\ntitle: x\nstatus: measured\nheadline: y\n---\n")
    with pytest.raises(Glm5Fp4Error, match="file name says 3"):
        list_writeups(workdir)
    bad.unlink()
    before = sorted(workdir.iterdir())
    assert main(["improvements", "new", "--title", "t", "--from", "/nonexistent.md", "--dir", str(workdir)]) == 1
    assert sorted(workdir.iterdir()) == before, "a failed `new` must not leave a half-written file"


def test_new_without_index_markers_leaves_nothing_behind(workdir, capsys):
    (workdir / "README.md").write_text("# Improvements\n\nno markers here\n")
    for _ in range(2):  # a rerun must not skip a number either
        assert main(["improvements", "new", "--title", "x test", "--dir", str(workdir)]) == 1
        assert "index markers not found" in capsys.readouterr().err
        assert sorted(p.name for p in workdir.glob("*.md")) == ["README.md", "TEMPLATE.md"]


def test_not_comparable_compare_block_does_not_mark_measured(workdir, tmp_path, capsys):
    compare = tmp_path / "compare.md"
    compare.write_text(
        "### b vs a\n\n**Not comparable**, so no verdicts: failed requests differ: 0 vs 32.\n\n"
        "- Baseline **a**: c32 (1 run: `a.json`)\n- Candidate **b**: c32 (1 run: `b.json`)\n\n"
        "| Metric | a | b | verdict |\n|---|---|---|---|\n| completed | 32 | 0 | not comparable |\n"
    )
    assert main(["improvements", "new", "--title", "bad run", "--from", str(compare), "--dir", str(workdir)]) == 0
    w = read_writeup(workdir / "01-bad-run.md")
    assert w.status == "proposed"
    assert "not comparable" in capsys.readouterr().out


@pytest.mark.parametrize(
    "front, culprit",
    [
        ("number: three\ntitle: x\nstatus: proposed\nheadline: y\n", "field 'number' is 'three', expected an integer"),
        ("- a\n- b\n", "front matter is a YAML list"),
    ],
)
def test_malformed_front_matter_is_one_clear_error(workdir, capsys, front, culprit):
    (workdir / "01-bad.md").write_text(f"---\n{front}---\nbody\n")
    assert main(["improvements", "index", "--dir", str(workdir)]) == 1
    err = capsys.readouterr().err
    assert "01-bad.md" in err and culprit in err and "Traceback" not in err


def test_non_utf8_writeup_is_one_clear_error(workdir, capsys):
    (workdir / "01-latin.md").write_bytes("---\nnumber: 1\ntitle: t\nstatus: proposed\nheadline: café\n---\n".encode("latin-1"))
    assert main(["improvements", "index", "--dir", str(workdir)]) == 1
    err = capsys.readouterr().err
    assert "01-latin.md: not UTF-8" in err and "Traceback" not in err


def test_from_a_directory_is_one_clear_error(workdir, tmp_path, capsys):
    assert main(["improvements", "new", "--title", "y", "--from", str(tmp_path), "--dir", str(workdir)]) == 1
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err
    assert not list(workdir.glob("01-*.md"))


def test_a_title_with_a_pipe_stays_one_index_cell_and_blank_or_multiline_titles_are_refused(tmp_path):
    """Before: 'A | B' split its index row into an extra column (and `index --check` still passed); an empty title
    became "untitled"; a newline broke the table."""
    from glm5_fp4.improvements import writeups as W

    d = tmp_path / "imp"
    d.mkdir()
    (d / "TEMPLATE.md").write_text("---\nnumber: 0\ntitle: t\nstatus: proposed\nheadline: h\n---\n# {{title}}\n")
    (d / "README.md").write_text(f"# Improvements\n\n{W.INDEX_BEGIN}\n{W.INDEX_END}\n")
    W.new_writeup(d, "A | B")
    rows = [line for line in (d / "README.md").read_text().splitlines() if line.startswith("| 01")]
    cells = re.split(r"(?<!\\)\|", rows[0])[1:-1]  # markdown's cells: split at the unescaped pipes
    assert len(rows) == 1 and len(cells) == 4 and "A \\| B" in cells[1]
    assert W.regenerate_index(d, check=True)
    for bad in ("", "  ", "two\nlines"):
        with pytest.raises(Glm5Fp4Error, match="one-line title"):
            W.new_writeup(d, bad)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("0")) == ["01-a-b.md"]


@pytest.mark.parametrize("stray", ["02-Fast-Path.md", "3-c.md", "notes.md", "04-x.MD.md"])
def test_a_writeup_named_off_pattern_is_one_clear_error(workdir, capsys, stray):
    """Before: such files were skipped, so `index --check` passed without them and `new` reused their number
    (01-a.md, 02-Fast-Path.md, 3-c.md -> `new --title Next` made 02-next.md)."""
    (workdir / "01-a.md").write_text("---\nnumber: 1\ntitle: a\nstatus: proposed\nheadline: h\n---\n")
    main(["improvements", "index", "--dir", str(workdir)])
    capsys.readouterr()
    (workdir / stray).write_text("---\nnumber: 2\ntitle: b\nstatus: proposed\nheadline: h\n---\n")
    before = sorted(workdir.iterdir())
    for argv in (["index", "--check"], ["index"], ["new", "--title", "Next"]):
        assert main(["improvements", *argv, "--dir", str(workdir)]) == 1
        err = capsys.readouterr().err
        assert stray in err and "NN-slug.md" in err and "Traceback" not in err, err
    assert sorted(workdir.iterdir()) == before


@pytest.mark.parametrize("field", ["title", "headline"])
@pytest.mark.parametrize("value", ["", "''", "'  '", "null"])
def test_an_empty_title_or_headline_is_refused(workdir, capsys, field, value):
    """Before: an empty field showed as "None" in the index."""
    front = {"number": "1", "title": "a", "status": "proposed", "headline": "h"}
    front[field] = value
    (workdir / "01-a.md").write_text("---\n" + "".join(f"{k}: {v}\n" for k, v in front.items()) + "---\n")
    assert main(["improvements", "index", "--dir", str(workdir)]) == 1
    err = capsys.readouterr().err
    assert f"01-a.md: field '{field}' is empty" in err and "Traceback" not in err, err
    assert "None" not in (workdir / "README.md").read_text()


# -- review of 2026-12-07 ----------------------------------------------------------------------------------------------
def test_index_markers_out_of_order_are_one_error(workdir, capsys):
    """The end marker before the begin marker was a ValueError traceback from every command."""
    from glm5_fp4.improvements.writeups import INDEX_BEGIN, INDEX_END

    readme = workdir / "README.md"
    text = readme.read_text().replace(INDEX_END, "")
    readme.write_text(text.replace(INDEX_BEGIN, INDEX_END + "\n" + INDEX_BEGIN))
    for argv in (["index"], ["index", "--check"], ["new", "--title", "x"]):
        assert main(["improvements", *argv, "--dir", str(workdir)]) == 1
        assert "the end marker must follow the begin marker" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.glob("*.md")) == ["README.md", "TEMPLATE.md"]


def test_from_must_be_a_compare_output(workdir, capsys):
    """Any markdown with a table was pasted as results and made the write-up 'measured' (the README itself)."""
    for text in ((workdir / "README.md").read_text(), "| a | b |\n|---|---|\n| 1 | 2 |\n"):
        md = workdir.parent / "x.md"
        md.write_text(text)
        assert main(["improvements", "new", "--title", "x", "--from", str(md), "--dir", str(workdir)]) == 1
        assert "not the output of `glm5-fp4 compare`" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.glob("*.md")) == ["README.md", "TEMPLATE.md"]


def test_an_explicit_status_is_kept(workdir, tmp_path):
    compare = tmp_path / "compare.md"
    compare.write_text(COMPARE_BLOCK)
    assert main(["improvements", "new", "--title", "x", "--from", str(compare), "--status", "proposed",
                 "--dir", str(workdir)]) == 0
    assert read_writeup(workdir / "01-x.md").status == "proposed"


def test_a_template_without_the_results_placeholder_is_refused_with_from(workdir, tmp_path, capsys):
    """The compare block was dropped without a word and the write-up still promoted to 'measured'."""
    from glm5_fp4.improvements.writeups import RESULTS_PLACEHOLDER

    t = workdir / "TEMPLATE.md"
    t.write_text(t.read_text().replace(RESULTS_PLACEHOLDER, "(paste results here)"))
    compare = tmp_path / "compare.md"
    compare.write_text(COMPARE_BLOCK)
    assert main(["improvements", "new", "--title", "x", "--from", str(compare), "--dir", str(workdir)]) == 1
    assert "has no results placeholder" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.glob("*.md")) == ["README.md", "TEMPLATE.md"]
