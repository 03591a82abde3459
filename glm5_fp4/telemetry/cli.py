"""`glm5-fp4 telemetry record --out DIR -- CMD ...` and `glm5-fp4 telemetry report DIR`."""

from __future__ import annotations

import argparse
import sys
import time

from glm5_fp4.argtypes import ranged
from glm5_fp4.errors import Glm5Fp4Error

# sysexits' EX_IOERR: the command succeeded but its telemetry did not (nearly always a write, a full disk)
TELEMETRY_FAILED = 74


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{record,report}")
    rec = sub.add_parser(
        "record",
        help="record GPU telemetry while a command runs",
        description="Run CMD and record GPU power, clocks and utilisation until it exits; "
        "exits with CMD's status. If the telemetry itself fails while CMD runs (a full disk), CMD is left to "
        f"finish, one error line says so, and the status is CMD's if non-zero, else {TELEMETRY_FAILED}. "
        "Example: glm5-fp4 telemetry record --out out/tel -- python bench.py",
    )
    rec.add_argument("--out", required=True, help="directory for telemetry.jsonl, summary, plot and table")
    rec.add_argument(
        "--interval",
        type=_interval,
        default="auto",
        help="seconds between samples, or 'auto' (default): 0.1 s unless sampling that often would take more "
        "than 1 %% of one core (several GPUs on a GSP-based driver), then the shortest interval that does not",
    )
    rec.add_argument("--gpus", help="comma-separated NVML GPU indices (default: CUDA_VISIBLE_DEVICES, else all)")
    rec.add_argument(
        "--settle",
        type=ranged("settle", float, lambda v: 0 <= v <= 86_400, "between 0 and 86400 seconds"),
        default=0.0,
        help="also record this many idle seconds before and after the command (phases idle-before/idle-after)",
    )
    rec.add_argument(
        "--pcie-legacy",
        action="store_true",
        help="where NVML lacks PCIe byte counters, read nvmlDeviceGetPcieThroughput (blocks ~20 ms per call)",
    )
    rec.add_argument("--no-report", action="store_true", help="skip the PNG and markdown report")
    rec.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    rep = sub.add_parser(
        "report",
        help="summarise a recorded directory",
        description="Write telemetry.png, telemetry.md and telemetry_summary.json for DIR and print the table.",
    )
    rep.add_argument("dir", help="directory written by `telemetry record` or TelemetrySampler")
    rep.add_argument("--tokens", type=int, help="tokens produced during the window, for tokens per joule")
    rep.add_argument("--phase", help="summarise only this marked phase (e.g. measure)")
    rep.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _interval(text: str) -> float | str:
    return text if text == "auto" else float(text)


def _parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Glm5Fp4Error(f"--gpus {text!r}: expected comma-separated GPU indices such as 0,1") from None
    if not gpus or any(g < 0 for g in gpus):
        raise Glm5Fp4Error(f"--gpus {text!r}: expected comma-separated GPU indices such as 0,1")
    twice = next((g for i, g in enumerate(gpus) if g in gpus[:i]), None)
    if twice is not None:  # it would be recorded twice and its energy counted twice
        raise Glm5Fp4Error(f"--gpus {text!r}: GPU {twice} is listed twice")
    return gpus


def _record(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from glm5_fp4.telemetry.report import render_report
    from glm5_fp4.telemetry.sampler import TelemetrySampler

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise Glm5Fp4Error("telemetry record: give the command to run after --, e.g. `-- python bench.py`")
    if shutil.which(cmd[0]) is None:  # before the sampler writes anything: no recording of a command that never ran
        raise Glm5Fp4Error(f"telemetry record: cannot run {cmd[0]!r} (not found, or not an executable file)")
    sampler = TelemetrySampler(
        args.out, interval_s=args.interval, gpus=_parse_gpus(args.gpus), pcie_legacy=args.pcie_legacy
    )
    rc = 0
    with sampler:
        if args.settle:
            sampler.mark("idle-before")
            time.sleep(args.settle)
        sampler.mark("command")
        try:
            proc = subprocess.Popen(cmd)
        except OSError as exc:
            raise Glm5Fp4Error(f"telemetry record: cannot run {cmd[0]!r} ({exc})") from exc
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            rc = proc.wait()  # the child got the same Ctrl-C; keep what was recorded
            rc = rc if rc else 130
        if rc < 0:  # Popen's -N for "ended by signal N"; a shell reports 128 + N, and exit codes are 0-255
            rc = 128 - rc
        if args.settle:
            sampler.mark("idle-after")
            time.sleep(args.settle)
    failure = sampler.run.sampler.get("error")
    summary = None
    if not args.no_report:
        try:
            files = render_report(args.out)
            summary, where = files.summary, files.markdown_path
        except Glm5Fp4Error as exc:  # the command ran: its status must not be lost to a report that failed
            failure = failure or f"the report failed: {exc}"
    if summary is None:
        summary, where = sampler.summary(), args.out
    if summary["available"]:
        energy = "energy not measurable" if summary["energy_j"] is None else f"{summary['energy_j']:.0f} J"
        print(
            f"telemetry: {len(summary['gpus'])} GPU(s), {summary['window']['duration_s']:.1f} s, "
            f"{energy} -> {where}",
            file=sys.stderr,
        )
    else:
        print(f"telemetry: nothing recorded -> {where}", file=sys.stderr)  # the reason was logged once already
    if failure:
        print(f"glm5-fp4 telemetry: error: telemetry is incomplete ({failure})", file=sys.stderr)
        return rc or TELEMETRY_FAILED
    return rc


def _report(args: argparse.Namespace) -> int:
    from glm5_fp4.telemetry.report import render_report

    if args.tokens is not None and args.tokens < 0:
        raise Glm5Fp4Error(f"--tokens {args.tokens}: must be >= 0")
    files = render_report(args.dir, tokens=args.tokens, phase=args.phase, plot=not args.no_plot)
    print(files.markdown_path.read_text(), end="")
    summary = files.summary
    if not summary.get("complete", True):
        # the table is printed for what it is worth, but the headline number the report exists for is missing
        failed = (summary.get("sampler") or {}).get("error")
        why = summary.get("reason") or (f"the recording failed ({failed})" if failed else None)
        why = why or "energy could not be computed"
        print(f"telemetry report: {args.dir}: {why}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    return _record(args) if args.action == "record" else _report(args)
