"""`glm5-fp4` command line: one entry, one thin subcommand module each.

Subcommand modules are imported only when chosen, so `glm5-fp4 --help` stays fast and a
missing optional dependency of one subcommand never breaks the others. Each module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from glm5_fp4.errors import Glm5Fp4Error

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("glm5_fp4.demo", "CPU end-to-end demo on a tiny GLM-5 checkpoint"),
    "make-checkpoint": ("glm5_fp4.checkpoint.make_cli", "write a random tiny checkpoint in the ModelOpt NVFP4 layout"),
    "inspect": ("glm5_fp4.checkpoint.inspect_cli", "validate an NVFP4 checkpoint and summarise it"),
    "serve": ("glm5_fp4.serve_cli", "launch vLLM's OpenAI server with the glm5-fp4 backend"),
    "loadtest": ("glm5_fp4.loadtest.cli", "decode load test against an OpenAI-compatible server"),
    "compare": ("glm5_fp4.loadtest.compare_cli", "compare load-test results side by side"),
    "improvements": ("glm5_fp4.improvements.cli", "create numbered improvement write-ups and regenerate their index"),
    "plan": ("glm5_fp4.launch.plan_cli", "memory per GPU and predicted decode step time for a launch profile"),
    "telemetry": ("glm5_fp4.telemetry.cli", "record or report GPU power, clocks and utilisation"),
    "profile": ("glm5_fp4.profiling.cli", "analyze or capture torch-profiler traces: decode-time breakdown vs hardware ceilings"),
    "compile-matrix": ("glm5_fp4.sm120.cli", "compile every MoE kernel config for sm_120/sm_100/sm_90 without a GPU; check fit, spills, instructions"),
    "selftest": ("glm5_fp4.selftest.cli", "check the MoE backend on this GPU against the reference and benchmark it; writes a report"),
}


# import name -> what to pip install, where they differ or need a word (the engines' versions: pyproject's extras)
PIP_NAMES = {"pynvml": "nvidia-ml-py", "yaml": "pyyaml",
             "triton": "triton (torch's CUDA wheels bring it; its CPU wheel does not)",
             "vllm": "'glm5-fp4[vllm]' (on a CPU machine: 'glm5-fp4[cpu]')", "sglang": "'glm5-fp4[sglang]'"}


def _missing_dependency(exc: ModuleNotFoundError) -> str | None:
    """One line for a third-party package a command needs and this environment lacks. None (keep the traceback)
    for a module of ours, or a submodule of a package that is installed (another version's layout, a broken
    install): 'not installed' would be wrong and hide the module's name."""
    import importlib.util

    top = (exc.name or "").split(".")[0]
    if not top or top == "glm5_fp4":
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):  # a package whose own import machinery fails: keep its traceback
        return None
    return f"needs the Python package {top!r}, which is not installed here: pip install {PIP_NAMES.get(top, top)}"


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: glm5-fp4 COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `glm5-fp4 COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from glm5_fp4 import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"glm5-fp4: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (missing := _missing_dependency(exc)) is None:
            raise
        print(f"glm5-fp4 {name}: error: {missing}", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog=f"glm5-fp4 {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        if (missing := _missing_dependency(exc)) is None:
            raise
        print(f"glm5-fp4 {name}: error: {missing}", file=sys.stderr)
        return 1
    except Glm5Fp4Error as exc:
        print(f"glm5-fp4 {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)  # server_process.StopSignal names SIGTERM / SIGHUP
        print(f"glm5-fp4 {name}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # The reader of stdout went away (`... | head`): nothing to report, but the output was cut, so a shell's
        # SIGPIPE status. A broken pipe elsewhere (a socket, a child's stdin) is an error of its own.
        if not _stdout_reader_gone():
            raise
        # stdout now points at /dev/null, or the interpreter's own flush at exit would raise again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file (captured in-process)
            pass
        return 128 + signal.SIGPIPE
    except OSError as exc:
        # A file the command could not open or read (permissions, a folder for a file): the file and the reason,
        # never a traceback. An OSError naming no file is a fault of ours or the system's, and keeps its traceback.
        if exc.filename is None:
            raise
        print(f"glm5-fp4 {name}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR on such a write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or stdout is no file (captured in-process)
        return False


if __name__ == "__main__":
    sys.exit(main())
