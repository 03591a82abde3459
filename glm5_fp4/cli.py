"""`glm5-fp4` command line: one entry, one thin subcommand module each.

Subcommand modules are imported only when chosen, so `glm5-fp4 --help` stays fast and a
missing optional dependency of one subcommand never breaks the others. Each module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from glm5_fp4.errors import Glm5Fp4Error

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("glm5_fp4.demo", "CPU end-to-end demo on a tiny GLM-5 checkpoint"),
    "make-checkpoint": ("glm5_fp4.checkpoint.make_cli", "write a random tiny checkpoint in the ModelOpt NVFP4 layout"),
    "inspect": ("glm5_fp4.checkpoint.inspect_cli", "validate an NVFP4 checkpoint and summarise it"),
    "telemetry": ("glm5_fp4.telemetry.cli", "record or report GPU power, clocks and utilisation"),
}


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
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"glm5-fp4 {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except Glm5Fp4Error as exc:
        print(f"glm5-fp4 {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"glm5-fp4 {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
