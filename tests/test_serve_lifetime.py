"""`serve`'s server never outlives `serve`: SIGKILL, an SSH drop (SIGHUP) or SIGTERM of the wrapper ends it.

The engine is a stand-in: an executable named `sglang` first on PATH that answers /health (what `serve
--profile launch/tp8-sglang.yaml` starts), so the real launch path runs without an engine installed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A server answering /health, the tail of each stand-in engine below (port: from its --port argument)
HEALTH_SERVER = """
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

FAKE_ENGINE = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
""" + HEALTH_SERVER


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie waiting for its reaper is dead


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _serve_env(tmp_path: Path) -> dict:
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}


def _serve_cmd(tmp_path: Path, engine: str, port: int) -> list[str]:
    """`serve --profile launch/tp8-sglang.yaml` with ``engine`` installed as the `sglang` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sglang"
    fake.write_text(engine)
    fake.chmod(0o755)
    return [sys.executable, "-m", "glm5_fp4.cli", "serve", "--profile", str(ROOT / "launch" / "tp8-sglang.yaml"),
            "--port", str(port), "--log-file", str(tmp_path / "server.log"), "--timeout", "30"]


def _start_serve(tmp_path: Path, engine: str | None = None) -> tuple[subprocess.Popen, int]:
    cmd = _serve_cmd(tmp_path, engine or FAKE_ENGINE.format(python=sys.executable), _free_port())
    env = _serve_env(tmp_path)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid, lines = None, []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "server PID" in line:
            pid = int(line.split("server PID")[1].split()[0])
        if line.startswith("ready after"):
            break
    if pid is None or not lines[-1].startswith("ready after"):
        proc.terminate()  # not SIGKILL: that is what is under test, and would leave the server behind
        proc.wait(30)
        pytest.fail("serve did not print the server PID and become ready:\n" + "".join(lines))
    return proc, pid


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name)
def test_the_server_dies_with_serve(tmp_path, sig):
    proc, pid = _start_serve(tmp_path)
    assert _alive(pid)
    _stop_and_expect_gone(proc, pid, lambda: proc.send_signal(sig), f"the server (PID {pid})", f"killed by {sig.name}")


def _stop_and_expect_gone(proc: subprocess.Popen, pid: int, stop, who: str, how: str) -> None:
    """``stop()`` `serve` (``proc``), then process ``pid`` must die with it; neither outlives the test."""
    try:
        stop()
        proc.wait(30)
        assert _wait_dead(pid), f"{who} outlived `serve` {how}"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def test_a_spawned_server_gets_sigterm_when_its_parent_dies(tmp_path):
    """The mechanism alone: a parent that spawned a server and is then SIGKILLed takes the server with it."""
    code = ("import os, sys; from pathlib import Path; from glm5_fp4.server_process import spawn; "
            "p = spawn([sys.executable, '-c', 'import time; time.sleep(120)'], dict(os.environ), "
            f"Path({str(tmp_path / 'child.log')!r}), 'test child'); print(p.pid, flush=True); "
            "import time; time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        assert _wait_dead(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
    assert "# test child" in (tmp_path / "child.log").read_text()


STUBBORN_ENGINE = """#!{python}
import http.server, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # an engine that does not stop on SIGINT (a hung shutdown)
port = int(sys.argv[sys.argv.index("--port") + 1])
worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"])
open({pid_file!r}, "w").write(str(worker.pid))
""" + HEALTH_SERVER


def test_a_second_stop_signal_while_stopping_still_kills_the_engines_workers(tmp_path):
    """Ctrl-C, then Ctrl-C again during the wait for the engine to shut down: the process group's SIGKILL still runs,
    so a worker that ignores SIGTERM (what hangs when users press twice) does not outlive `serve`."""
    pid_file = tmp_path / "worker.pid"
    engine = STUBBORN_ENGINE.format(python=sys.executable, pid_file=str(pid_file))
    proc, _ = _start_serve(tmp_path, engine)
    worker = int(pid_file.read_text())

    def stop_twice():
        proc.send_signal(signal.SIGTERM)  # serve starts stopping: SIGINT to the engine, which ignores it
        deadline = time.monotonic() + 20
        seen = ""
        while "stopping" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # the second signal, inside stop()'s wait

    _stop_and_expect_gone(proc, worker, stop_twice, f"the engine's worker (PID {worker})", "stopped twice")


def test_a_port_another_server_answers_on_is_refused_before_starting(tmp_path):
    """`serve` on a port where another server already answers /health used to print "ready" for that server (the
    engine then failed to bind): the port is checked before the engine starts."""
    other_script = tmp_path / "other.py"
    other_script.write_text(FAKE_ENGINE.format(python=sys.executable))
    port = _free_port()
    other = subprocess.Popen([sys.executable, str(other_script), "--port", str(port)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        proc = subprocess.run(_serve_cmd(tmp_path, FAKE_ENGINE.format(python=sys.executable), port),
                              env=_serve_env(tmp_path), capture_output=True, text=True, timeout=60)
    finally:
        other.kill()
        other.wait(10)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"port {port} on 127.0.0.1 is already in use" in out and "ready after" not in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_a_stop_signal_after_ready_exits_128_plus_its_number(tmp_path, sig, code):
    """SIGTERM to a ready `serve` exited 0, so a supervisor could not tell a stop from a clean finish."""
    proc, pid = _start_serve(tmp_path)
    try:
        proc.send_signal(sig)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == code, out
        assert _wait_dead(pid) and "Traceback" not in out, out
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


# A stand-in that becomes ready, then goes away by itself after a second: {how}
DYING_ENGINE = """#!{python}
import http.server, os, signal, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
threading.Thread(target=lambda: (time.sleep(1.5), {how}), daemon=True).start()
""" + HEALTH_SERVER


@pytest.mark.parametrize("how,code,status", [
    ("os.kill(os.getpid(), signal.SIGKILL)", 137, "killed by SIGKILL"),
    ("os._exit(3)", 3, "exit code 3"),
    # vLLM 0.33 when its engine core dies: the watchdog sets should_exit and the API server returns normally
    ("os._exit(0)", 1, "exit code 0"),
], ids=["sigkill", "exit-3", "exit-0"])
def test_a_server_that_goes_away_after_ready_fails_serve(tmp_path, how, code, status):
    """A server SIGKILLed after ready made `serve` exit 247 (run() returned -9), one that exited 0 by itself made it
    exit 0: any exit `serve` did not ask for is a failure, named on one line with the server's status."""
    proc, pid = _start_serve(tmp_path, DYING_ENGINE.format(python=sys.executable, how=how))
    try:
        out = proc.communicate(timeout=30)[0]
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == code, out
    lines = [line for line in out.splitlines() if "exited unexpectedly" in line]
    assert len(lines) == 1 and status in lines[0] and "server.log" in lines[0], out
    assert "Traceback" not in out, out
