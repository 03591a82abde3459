"""Benchmark scripts (not part of the package) loaded as modules by path, for the tests of their pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str) -> ModuleType:
    """The script at ``relpath`` (from the repository root) imported as module ``name`` (also put in
    ``sys.modules``, so that its dataclasses and pickling resolve)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
