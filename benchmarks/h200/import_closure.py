"""Which third-party packages an SGLang server needs at import time, read from its sources (no import, no GPU).

SGLang cannot start on a CPU, and the lent H200 has no registry: a package missing there is found only after
the pieces are shipped and a server is started, minutes into the session's device time. This reads the
sources instead. From entry modules (the server's process entry points, the model files and the backends the
H200 runs choose) it follows every import that runs when a module is imported -- module level, class bodies,
``if`` blocks; not function bodies (lazy), not ``if TYPE_CHECKING:``, not branches for another platform
(``if _is_hip:``, ``else`` of ``if _is_cuda:``; judged by the flags' names) -- through the package's own modules,
and collects the top-level names of everything else:

* ``hard``: imported unguarded on the path (a missing package stops the server);
* ``guarded``: imported inside ``try:`` with a handler that catches ImportError (or broader), or under an ``if``
  that asks whether the package is there or opted into (``is_x_available()``, ``get_bool_env_var(...)``,
  ``os.environ``/``envs``): optional.

Packages found under the given roots (the package under test and whatever else is shipped beside it) are
followed too; the names collected are what none of the roots holds. A name counts as ``hard`` if any module on
the path imports it unguarded. Parent packages run too
(``a.b.c`` executes ``a/__init__`` and ``a/b/__init__``). What it cannot see: imports by string
(``importlib.import_module(name)``; SGLang's model registry imports every model module so, but ignores their
failures), imports inside functions that the server calls at start-up, and C extensions' own needs; those
are what the device smoke test and the first server start check.

    python import_closure.py ROOT[:ROOT...] MODULE [MODULE ...] [--why NAME]

Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_BROAD = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError", "RuntimeError"}
# Names in an ``if`` test that say which platform the branch is for (SGLang: ``_is_hip``, ``is_npu()``, ...).
_OTHER_PLATFORM = re.compile(r"hip|npu|xpu|musa|cpu|mlx|aiter|mps|hpu|amx|rocm|gfx|darwin")
_CUDA = re.compile(r"cuda")
# An ``if`` that asks whether something is installed or switched on by the environment (transformers'
# ``is_torchao_available()``, SGLang's ``get_bool_env_var("SGLANG_USE_MODELSCOPE")``): its imports are optional.
_OPTIONAL_TEST = re.compile(r"available|enabled|^has_|env|environ|version")


@dataclass
class Found:
    """Third-party names on the import path: name -> (importing module, line) of the first sighting."""

    hard: dict[str, tuple[str, int]] = field(default_factory=dict)
    guarded: dict[str, tuple[str, int]] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)  # modules visited (found under the roots)
    via: dict[str, str] = field(default_factory=dict)  # own module -> the module that first imported it

    def chain(self, name: str) -> list[str]:
        """Entry module -> ... -> the module that imports third-party ``name`` (why it is on the path)."""
        sighting = self.hard.get(name) or self.guarded.get(name)
        if sighting is None:
            return []
        out = [sighting[0]]
        while out[-1] in self.via and len(out) < 64:
            out.append(self.via[out[-1]])
        return out[::-1]

    def to_dict(self) -> dict:
        guarded = {k: v for k, v in self.guarded.items() if k not in self.hard}
        return {"hard": {k: f"{m}:{ln}" for k, (m, ln) in sorted(self.hard.items())},
                "guarded_only": {k: f"{m}:{ln}" for k, (m, ln) in sorted(guarded.items())},
                "modules": len(self.modules)}


def module_file(roots: list[Path], name: str) -> Path | None:
    """The source of module ``name`` under the first root that has it (None: not there, or a C extension)."""
    for root in roots:
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


# Top-level namespace packages that several distributions share (cuda-bindings: cuda.bindings, cuda-core:
# cuda.core, cuda-tile: cuda.tile): what is shipped or missing is the subpackage, so names are kept to two parts.
NAMESPACES = frozenset({"cuda"})


def package_name(target: str) -> str:
    """The name a distribution provides for import ``target``: its top level, or ``ns.sub`` in a namespace."""
    parts = target.split(".")
    return ".".join(parts[:2]) if parts[0] in NAMESPACES and len(parts) > 1 else parts[0]


def _present(roots: list[Path], top: str) -> bool:
    """Whether a top-level module ``top`` (or ``ns.sub`` in a namespace) is under a root at all (a package, a
    module or an extension)."""
    *ns, leaf = top.split(".")
    for root in roots:
        base = root.joinpath(*ns)
        if (base / leaf).is_dir() or (base / f"{leaf}.py").is_file() or any(base.glob(f"{leaf}.*.so")) \
                or any(base.glob(f"{leaf}.abi3.so")):
            return True
    return False


def _catches_import_errors(handlers: list[ast.ExceptHandler]) -> bool:
    for h in handlers:
        if h.type is None:
            return True
        names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(isinstance(n, ast.Name) and n.id in _BROAD for n in names):
            return True
    return False


def on_cuda(test: ast.expr) -> bool | None:
    """Whether an ``if`` test holds in a CUDA server process: True, False, or None (cannot tell).

    False for ``TYPE_CHECKING`` and ``__name__ == "__main__"``; by name for platform flags (``_is_cuda`` True,
    ``_is_hip``/``is_npu()``/``_use_aiter``... False), through ``not``/``and``/``or``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = on_cuda(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        parts = [on_cuda(v) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in parts else (True if all(p is True for p in parts) else None)
        return True if True in parts else (False if all(p is False for p in parts) else None)
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
        return False
    if isinstance(test, ast.Call):
        return on_cuda(test.func)
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
    if name is None:
        return None
    if name == "TYPE_CHECKING":
        return False
    low = name.lower()
    if _OTHER_PLATFORM.search(low):
        return False
    if _CUDA.search(low):
        return True
    return None


def _optional(test: ast.expr) -> bool:
    for node in ast.walk(test):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name and _OPTIONAL_TEST.search(name.lower()):
            return True
    return False


def _suppresses_import_errors(node: ast.With) -> bool:
    """``with contextlib.suppress(ImportError):`` (jsonschema's optional format checkers)."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call) and (getattr(call.func, "id", None) == "suppress"
                                           or getattr(call.func, "attr", None) == "suppress"):
            if any(isinstance(a, ast.Name) and a.id in _BROAD for a in call.args):
                return True
    return False


def import_statements(tree: ast.Module):
    """(node, guarded) for every import that runs when the module is imported."""
    def walk(body, guarded):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, guarded
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                catches = _catches_import_errors(node.handlers)
                inner = guarded or catches
                yield from walk(node.body, inner)
                for h in node.handlers:  # a fallback after a failed import is optional too
                    yield from walk(h.body, inner)
                yield from walk(node.orelse, inner)
                yield from walk(node.finalbody, guarded)
            elif isinstance(node, ast.If):
                taken = on_cuda(node.test)
                optional = guarded or (taken is None and _optional(node.test))
                if taken is not False:
                    yield from walk(node.body, optional)
                if taken is not True:
                    yield from walk(node.orelse, optional)
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, guarded)
            elif isinstance(node, ast.With):
                yield from walk(node.body, guarded or _suppresses_import_errors(node))
            elif isinstance(node, (ast.For, ast.While)):
                yield from walk(node.body, guarded)
                yield from walk(node.orelse, guarded)
    yield from walk(tree.body, False)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute module names the statement imports (``from pkg import sub`` may name a submodule: both listed)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names if a.name != "*"]


def closure(roots: list[Path], entries: list[str]) -> Found:
    """Follow the imports of ``entries`` through every module found under ``roots``.

    A module reached only through guarded imports is walked as guarded (all it imports is optional); reached
    unguarded later, it is walked again as hard."""
    found = Found()
    walked: dict[str, bool] = {}  # module -> walked as hard
    queue: list[tuple[str, str | None, bool]] = [(e, None, False) for e in entries]
    while queue:
        name, importer, guarded = queue.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # parents run first
            mod = ".".join(parts[:i])
            if mod in walked and (walked[mod] or guarded):
                continue
            path = module_file(roots, mod)
            if path is None:
                continue
            if importer is not None and mod != importer:
                found.via.setdefault(mod, importer)
            walked[mod] = not guarded
            found.modules.add(mod)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
            except SyntaxError as exc:
                raise SystemExit(f"{path}: cannot parse ({exc})") from None
            for node, stmt_guarded in import_statements(tree):
                optional = guarded or stmt_guarded
                for target in _targets(node, mod, path.name == "__init__.py"):
                    if not target:
                        continue
                    if target.split(".")[0] in sys.stdlib_module_names or target in ("__future__", "__main__"):
                        continue
                    top = package_name(target)
                    if _present(roots, top):
                        if module_file(roots, target) is not None:
                            queue.append((target, mod, optional))
                        continue
                    bucket = found.guarded if optional else found.hard
                    bucket.setdefault(top, (mod, node.lineno))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", help="folders holding the packages (unpacked wheels, a pip --target site), ':'-separated")
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--why", action="append", default=[], help="print the import chain that reaches this name")
    args = ap.parse_args(argv)
    roots = [Path(r) for r in args.roots.split(":") if r]
    missing = [m for m in args.modules if module_file(roots, m) is None]
    if missing:
        print(f"import_closure: not under {args.roots}: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = closure(roots, args.modules)
    out = found.to_dict()
    if args.why:
        out["why"] = {name: found.chain(name) for name in args.why}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
