"""A server process started by glm5-fp4 (vLLM or SGLang): start, health polling, error extraction, clean stop.

:func:`spawn` is the one way a server is started. The process leads its own process group
(``start_new_session=True``), so a stop reaps the engine's helper processes (engine core, workers, TP ranks)
too; and it never outlives the command that started it: the kernel sends it SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``, set between fork and exec), whatever kills the parent (SIGKILL, the OOM killer, an
SSH drop), and the engine then shuts its own helpers down as on any SIGTERM. A parent that is merely told
to stop (Ctrl-C, SIGTERM, SIGHUP) stops the server itself, first with SIGINT (:meth:`ServerProcess.stop`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port(highest: int = 65535, host: str = "127.0.0.1") -> int:
    """A loopback port free right now, at most ``highest`` (an engine may derive more ports from its own:
    :attr:`glm5_fp4.engines.sglang.compat.ServerFlags.max_port`). The kernel's ephemeral pick runs up to
    ~61000, so below that limit ports are drawn at random from the unprivileged range instead."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind((host, 0 if highest >= 65535 else random.randint(20000, highest)))
            except OSError:
                continue
            port = s.getsockname()[1]
            if port <= highest:
                return port
    raise Glm5Fp4Error(f"no free port on {host} at or below {highest}")


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook asking the kernel for SIGTERM when the parent dies (Linux); None elsewhere.

    libc is looked up here, in the parent: the hook runs in the forked child before exec and does only the
    prctl call and a getppid check (the parent may have died before the call: then there is no one to
    serve). The death signal follows the *thread* that forked: spawn from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return hook


def _opened_log(log_path: Path):
    try:
        return log_path.open("ab")
    except OSError as exc:
        raise Glm5Fp4Error(f"--log-file {log_path}: cannot write ({exc.strerror or exc})") from None


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on. Otherwise the old server answers /health, the new one is called
    ready, and only then does the engine fail to bind (a second `serve` on the default port, say)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        # as servers bind: a closed server's connections in TIME_WAIT do not hold the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise Glm5Fp4Error(f"port {port} on {host} is already in use (another server?); pass --port, or stop "
                                   "what listens there") from None
            raise Glm5Fp4Error(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def local_model_dir(model: str | os.PathLike, where: str = "--model") -> bool:
    """Whether ``model`` is a local directory (else a Hugging Face id, left to the engine). A path the OS will not
    look up (a name over 255 bytes, a directory it may not enter) is one error naming ``where``, not an OSError."""
    try:
        return Path(model).is_dir()
    except OSError as exc:
        raise Glm5Fp4Error(f"{where} {model}: {exc.strerror or exc}") from None


_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_dir(model: str | Path, where: str = "--model") -> Path | None:
    """What a server is about to load, checked before it starts: a local directory must be a checkpoint
    (config.json and weights). A Hugging Face id (namespace/name, nothing of that name here) is left to the
    engine: returns None for it, else the directory. Torch-free, so that --dry-run checks what the real run does."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise Glm5Fp4Error(f"{where} {text}: is a file, not a checkpoint directory")
        if not (path / "config.json").is_file():
            raise Glm5Fp4Error(f"{where} {text}: no config.json, so not a Hugging Face checkpoint directory")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise Glm5Fp4Error(f"{where} {text}: no weights (*.safetensors) next to config.json")
        return path
    if _HF_REPO_ID.match(text):
        return None
    raise Glm5Fp4Error(f"{where} {text}: no such directory (a Hugging Face model id has the form namespace/name)")


def exit_status(returncode: int) -> str:
    """A server's return code as a shell would describe it."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, header: str,
          listen: tuple[str, int] | None = None) -> subprocess.Popen:
    """Start a server: output appended to ``log_path`` after a ``# header`` line, its own process group, and
    dying with this process (see the module docstring); ``listen`` (host, port), where it will serve, is checked to
    be free first. Raises FileNotFoundError if the program is missing."""
    from glm5_fp4.outputs import output_dir

    if listen is not None:
        check_port_free(*listen)
    log_path = Path(log_path)
    if log_path.is_dir():
        raise Glm5Fp4Error(f"--log-file {log_path} is a directory; give a file name")
    output_dir(log_path.parent, "--log-file")
    with _opened_log(log_path) as f:
        f.write(f"# {header}\n".encode())
        f.flush()
        return subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, env=dict(env),
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent())


def error_from_log(log_path: Path) -> str:
    """The most telling error line of a server log: our own error first, else the last exception, else the last line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        m = re.search(r"Glm5Fp4Error: (.+)", line)
        if m:
            return m.group(1).strip()
    for line in reversed(lines):
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)", line)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return lines[-1].strip() if lines else ""


class ServerProcess:
    """Mixin for dataclasses with fields ``process``, ``log_path``, ``started_at`` and ``ready_after_s``."""

    process: subprocess.Popen
    log_path: Path
    started_at: float
    ready_after_s: float | None
    name = "server"  # for messages: "vLLM", "sglang", ...

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until /health answers 200; returns seconds since start. Raises with the log's error if it died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise Glm5Fp4Error(f"{self.name} server exited with code {code} before becoming healthy: "
                                   f"{error_from_log(self.log_path)} (full log: {self.log_path})")
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return self.ready_after_s
            time.sleep(poll_s)
        raise Glm5Fp4Error(f"{self.name} server not healthy after {timeout:.0f} s (log: {self.log_path})")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT the server (engines shut their workers down), then SIGKILL its process group's stragglers.

        The SIGKILL runs however the wait ends: a second Ctrl-C or SIGTERM while the engine shuts down (what users
        send when it hangs) raises KeyboardInterrupt here, and the workers must not outlive us for it."""
        try:
            if self.process.poll() is None:
                try:
                    self.process.send_signal(signal.SIGINT)
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            return self.process.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class StopSignal(KeyboardInterrupt):
    """A stop signal turned into KeyboardInterrupt (install_stop_signals), so every cleanup written for Ctrl-C runs;
    it keeps the signal's number so the command can exit with a shell's 128 + N."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupt(signum, frame) -> None:
    raise StopSignal(signum)


def install_stop_signals(keep_ignored: bool = False) -> None:
    """Make Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt, so a foreground `serve` always stops its server (and
    `make-checkpoint` removes what it had begun to write).

    SIGINT is re-armed explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT as ignored, and Python then never raises KeyboardInterrupt. SIGTERM (a supervisor, CI, `kill`) and
    SIGHUP (the terminal or SSH session went away) stop the server like Ctrl-C.

    ``keep_ignored``: leave a signal this process inherited as ignored alone (`nohup`, a script's background job): for
    work that should outlive the terminal, unlike a foreground server.
    """
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None or (keep_ignored and signal.getsignal(sig) == signal.SIG_IGN):
            continue
        signal.signal(sig, _raise_interrupt)


def serve_until_stopped(handle: ServerProcess, timeout: float, url: str) -> int:
    """Wait for /health, then run until the server exits or the user stops it; always stops the server."""
    pid = handle.process.pid
    print(f"{handle.name} server PID {pid} (process group {pid}; it stops when this command ends), "
          f"log: {handle.log_path}", flush=True)
    try:
        took = handle.wait_healthy(timeout)
        print(f"ready after {took:.0f} s: {url} (Ctrl-C stops the server)", flush=True)
        while handle.process.poll() is None:
            time.sleep(1.0)
        # Only a stop signal ends a ready server on purpose: an engine whose core died can still exit 0 (vLLM 0.33's
        # watchdog just ends the API server), and a supervisor must see that as a failure.
        code = handle.process.returncode
        print(f"{handle.name} server exited unexpectedly ({exit_status(code)}; log: {handle.log_path})",
              file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code or 1
    except KeyboardInterrupt:
        print(f"stopping {handle.name} server", flush=True)
        raise  # the command's exit status is 128 + the signal's number (glm5_fp4.cli)
    finally:
        handle.stop()
