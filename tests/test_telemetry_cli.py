"""`glm5-fp4 telemetry record|report`, in-process with a fake NVML and as a real subprocess without one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glm5_fp4 import cli
from glm5_fp4.telemetry import nvml_reader
from glm5_fp4.telemetry.fake_nvml import FakeNvml
from glm5_fp4.telemetry.series import MARKDOWN_FILE, META_FILE, PNG_FILE, SAMPLES_FILE, SUMMARY_FILE
from test_telemetry_sampler import full_disk  # noqa: F401 - a fixture, shared


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = FakeNvml(n_gpus=2)
    monkeypatch.setattr(nvml_reader, "import_nvml", lambda nvml=None: fake)
    return fake


def test_record_runs_command_and_writes_report(tmp_path, fake_nvml, capsys):
    out = tmp_path / "tel"
    marker = tmp_path / "ran"
    code = f"import pathlib, sys, time; time.sleep(0.3); pathlib.Path({str(marker)!r}).write_text('x'); sys.exit(3)"
    rc = cli.main(
        [
            "telemetry",
            "record",
            "--out",
            str(out),
            "--interval",
            "0.02",
            "--settle",
            "0.1",
            "--",
            sys.executable,
            "-c",
            code,
        ]
    )
    assert rc == 3  # the command's status passes through
    assert marker.read_text() == "x"
    for name in (SAMPLES_FILE, META_FILE, SUMMARY_FILE, MARKDOWN_FILE, PNG_FILE):
        assert (out / name).is_file(), name
    meta = json.loads((out / META_FILE).read_text())
    assert [m["name"] for m in meta["marks"]] == ["idle-before", "command", "idle-after"]
    assert meta["end_s"] >= 0.5
    assert fake_nvml.shutdowns == 1
    assert "2 GPU(s)" in capsys.readouterr().err


def test_record_gpus_option(tmp_path, fake_nvml):
    rc = cli.main(
        [
            "telemetry",
            "record",
            "--out",
            str(tmp_path),
            "--gpus",
            "1",
            "--no-report",
            "--interval",
            "0.05",
            "--",
            sys.executable,
            "-c",
            "pass",
        ]
    )
    assert rc == 0
    assert [g["index"] for g in json.loads((tmp_path / META_FILE).read_text())["gpus"]] == [1]
    assert not (tmp_path / PNG_FILE).exists()


def test_report_with_tokens_and_phase(tmp_path, fake_nvml, capsys):
    cli.main(
        [
            "telemetry",
            "record",
            "--out",
            str(tmp_path),
            "--interval",
            "0.02",
            "--no-report",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(0.2)",
        ]
    )
    capsys.readouterr()
    assert cli.main(["telemetry", "report", str(tmp_path), "--tokens", "4000", "--phase", "command"]) == 0
    printed = capsys.readouterr().out
    assert "tokens/J" in printed and "phase `command`" in printed
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["tokens"] == 4000
    assert summary["tokens_per_joule"] == pytest.approx(4000 / summary["energy_j"])
    assert (tmp_path / PNG_FILE).is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["record", "--out", "{tmp}/x"], "give the command"),
        (["record", "--out", "{tmp}/x", "--gpus", "a,b", "--", "true"], "--gpus"),
        (["record", "--out", "{tmp}/x", "--gpus", "0,1,0", "--", "sh", "-c", "exit 3"],
         "--gpus '0,1,0': GPU 0 is listed twice"),
        (["record", "--out", "{tmp}/x", "--gpus", "5", "--", "sh", "-c", "exit 3"],
         "GPU 5 does not exist: NVML sees 2 GPU(s): 0, 1"),
        (["record", "--out", "{tmp}/x", "--interval", "0", "--", "true"], "interval_s"),
        (["record", "--out", "{tmp}/x", "--", "/no/such/program"], "cannot run"),
        (["report", "{tmp}/missing"], "not a directory"),
        (["report", "{tmp}", "--tokens", "-3"], "--tokens"),
    ],
)
def test_user_errors_are_one_clear_line(tmp_path, fake_nvml, capsys, argv, message):
    rc = cli.main(["telemetry", *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 1
    assert message in err and "Traceback" not in err
    if argv[0] == "record":  # refused before recording: no files of a command that never ran
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("sig", ["TERM", "KILL"])
def test_a_command_ended_by_a_signal_exits_as_a_shell_reports_it(tmp_path, fake_nvml, sig):
    """128 + the signal's number, as sh and bash report it (Popen's negative code, passed on, became 241 for
    SIGTERM); the recording is kept."""
    import signal

    rc = cli.main(["telemetry", "record", "--out", str(tmp_path), "--", "sh", "-c", f"kill -{sig} $$"])
    assert rc == 128 + signal.Signals[f"SIG{sig}"].value
    assert (tmp_path / "telemetry_meta.json").is_file()


@pytest.mark.parametrize("settle", ["-1", "nan", "inf", "1e400"])
def test_settle_is_checked_while_parsing(tmp_path, fake_nvml, capsys, settle):
    """Before: NaN / inf reached time.sleep (a ValueError / OverflowError traceback) after the output folder was made."""
    with pytest.raises(SystemExit) as e:
        cli.main(["telemetry", "record", "--out", str(tmp_path / "x"), "--settle", settle, "--", "true"])
    assert e.value.code == 2 and "argument --settle" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("meta,culprit", [(b"[1]", "expected a JSON object, got list"),
                                          (b'{"format": "\xff"}', "not UTF-8 text"), (b"\xff\xfe", "not UTF-8 text")])
def test_report_of_a_foreign_meta_file(tmp_path, capsys, meta, culprit):
    from glm5_fp4.telemetry.series import META_FILE

    (tmp_path / META_FILE).write_bytes(meta)
    assert cli.main(["telemetry", "report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert META_FILE in err and culprit in err and "Traceback" not in err, err


def test_report_unknown_phase(tmp_path, fake_nvml, capsys):
    cli.main(
        [
            "telemetry",
            "record",
            "--out",
            str(tmp_path),
            "--interval",
            "0.05",
            "--no-report",
            "--",
            sys.executable,
            "-c",
            "pass",
        ]
    )
    assert cli.main(["telemetry", "report", str(tmp_path), "--phase", "decode"]) == 1
    assert "'decode' was not marked" in capsys.readouterr().err


def test_subprocess_without_gpu_says_no_telemetry(tmp_path):
    """The installed entry point on a GPU-less machine: warns once, runs the command, nothing fails."""
    out = tmp_path / "tel"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm5_fp4.cli",
            "telemetry",
            "record",
            "--out",
            str(out),
            "--",
            sys.executable,
            "-c",
            "print('payload ran')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "payload ran" in proc.stdout
    if json.loads((out / META_FILE).read_text())["available"]:  # pragma: no cover - GPU machine
        return
    assert proc.stderr.count("no GPU telemetry") == 1
    assert "no GPU telemetry" in (out / MARKDOWN_FILE).read_text()
    listed = subprocess.run([sys.executable, "-m", "glm5_fp4.cli", "--help"], capture_output=True, text=True)
    assert "telemetry" in listed.stdout


def test_record_default_interval_is_auto(tmp_path, fake_nvml):
    rc = cli.main(["telemetry", "record", "--out", str(tmp_path), "--", sys.executable, "-c", "pass"])
    assert rc == 0
    meta = json.loads((tmp_path / META_FILE).read_text())
    # FakeNvml answers in microseconds, so the 100 ms default fits the CPU budget
    assert meta["interval_s"] == 0.1 and meta["sampler"]["auto_interval"]["chosen_s"] == 0.1
    md = (tmp_path / MARKDOWN_FILE).read_text()
    assert "chosen automatically" in md and "NVML calls per GPU per tick" in md
    assert "wrap every 4 GiB" in md  # the fake has PCIe counters: say where they alias


def test_a_missing_gpu_is_refused_before_the_command_runs(tmp_path, fake_nvml, capsys):
    """Before: `--gpus 5` on a 2-GPU machine ran the command, printed "nothing recorded" and exited 0."""
    marker = tmp_path / "ran"
    rc = cli.main(["telemetry", "record", "--out", str(tmp_path / "x"), "--gpus", "1,5", "--",
                   "sh", "-c", f"touch {marker}"])
    err = capsys.readouterr().err
    assert rc == 1 and "GPU 5 does not exist" in err and "nothing recorded" not in err
    assert not marker.exists() and not (tmp_path / "x").exists()
    assert fake_nvml.shutdowns == fake_nvml.initialised == 1


@pytest.mark.parametrize("status, expected", [(0, 74), (3, 3)])
def test_a_full_disk_keeps_the_commands_status_and_says_so(tmp_path, fake_nvml, full_disk, capsys, status, expected):
    """Before: an OSError traceback from the end of the `with` block; the command's status and the summary were lost
    and NVML stayed open. Now: the command's status if it failed, else 74; one error line either way."""
    marker = tmp_path / "ran"
    code = f"import pathlib, sys, time; time.sleep(0.3); pathlib.Path({str(marker)!r}).touch(); sys.exit({status})"
    rc = cli.main(["telemetry", "record", "--out", str(tmp_path), "--interval", "0.01", "--", sys.executable, "-c",
                   code])
    err = capsys.readouterr().err
    assert rc == expected and marker.exists()
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "telemetry is incomplete" in errors[0] and "No space left" in errors[0], err
    assert fake_nvml.shutdowns == 1
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["complete"] is False
    # and the recording, reported later, says so too
    assert cli.main(["telemetry", "report", str(tmp_path), "--no-plot"]) == 1
    assert "No space left" in capsys.readouterr().err


def test_record_help_states_the_exit_status_rule(capsys):
    with pytest.raises(SystemExit):
        cli.main(["telemetry", "record", "--help"])
    assert "74" in " ".join(capsys.readouterr().out.split())


def test_no_report_and_no_plot_leave_no_earlier_report_behind(tmp_path, fake_nvml):
    """Before: `record --no-report` kept the earlier run's telemetry.md / .png beside the new samples, and
    `report --no-plot` an old PNG beside the new table."""
    argv = ["telemetry", "record", "--out", str(tmp_path), "--interval", "0.05", "--", sys.executable, "-c", "pass"]
    assert cli.main(argv) == 0
    assert (tmp_path / PNG_FILE).is_file() and (tmp_path / MARKDOWN_FILE).is_file()
    assert cli.main(argv[:-4] + ["--no-report"] + argv[-4:]) == 0
    assert not (tmp_path / PNG_FILE).exists() and not (tmp_path / MARKDOWN_FILE).exists()
    assert (tmp_path / SUMMARY_FILE).is_file()
    assert cli.main(["telemetry", "report", str(tmp_path)]) == 0 and (tmp_path / PNG_FILE).is_file()
    assert cli.main(["telemetry", "report", str(tmp_path), "--no-plot"]) == 0
    assert not (tmp_path / PNG_FILE).exists() and (tmp_path / MARKDOWN_FILE).is_file()
    assert "telemetry.png" not in (tmp_path / MARKDOWN_FILE).read_text()
