"""Files named on the command line or found beside one (configs, profiles, meta files): read whole, or one clear
error naming the file (missing, a directory, unreadable, not UTF-8, not JSON), never a traceback. The reading
counterpart of :mod:`glm5_fp4.outputs`."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from glm5_fp4.errors import Glm5Fp4Error


def read_text(path: str | Path, what: str) -> str:
    """Text of a file the command needs (``what`` names its kind in messages), or one error naming it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise Glm5Fp4Error(f"{path}: is a directory; expected a {what} file") from None
    except UnicodeDecodeError as exc:
        raise Glm5Fp4Error(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                           "save it as UTF-8") from None
    except OSError as exc:
        raise Glm5Fp4Error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None


def read_json(path: str | Path, what: str) -> object:
    """A JSON file's value (any JSON type: callers check the shape they need), or one error naming the file."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as exc:
        raise Glm5Fp4Error(f"{path}: not valid JSON ({exc})") from None


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: YAML keeps the last silently, so a launch profile
    with two `max_concurrency:` lines would run with the one the reader did not look at, and a hardware file giving
    a GPU twice would take its second block. Raises yaml.constructor.ConstructorError (a YAMLError)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merge keys (<<: *base) and complex keys: the base loader's own rules apply
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
