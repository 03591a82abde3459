"""The `glm5-fp4` entry point itself: what every command gets from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A command whose output is far larger than a pipe's buffer, so the reader's early exit hits it mid-write.
BIG_OUTPUT = """
import sys
from glm5_fp4 import cli
import glm5_fp4.launch.plan_cli as m


def run(args):
    for _ in range(20000):
        print("y" * 200)


m.run = run
sys.exit(cli.main(["plan"]))
"""


def test_a_reader_that_stops_early_gets_no_traceback():
    """`glm5-fp4 inspect CKPT --json | head -1`: the pipe closing is not an error worth a traceback; the exit status is
    a shell's for SIGPIPE (141), since the output was cut."""
    proc = subprocess.Popen([sys.executable, "-c", BIG_OUTPUT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


def test_a_broken_pipe_elsewhere_is_not_taken_for_a_closed_stdout():
    """A socket or a child's stdin breaking is an error of its own: not the quiet 141 of `| head`."""
    code = BIG_OUTPUT.replace('''def run(args):
    for _ in range(20000):
        print("y" * 200)''', '''def run(args):
    raise BrokenPipeError(32, "Broken pipe (a socket)")''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode not in (0, 141) and "a socket" in proc.stderr
