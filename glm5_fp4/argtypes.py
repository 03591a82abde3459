"""argparse ``type=`` callables for numeric options, and the comma lists, shared by the subcommands.

``float()`` accepts ``nan``, ``inf`` and negatives, and ``int()`` accepts 0 and negatives; each of those slips
through a model as a plausible-looking number (a negative step time, ``nan %`` of bandwidth) or surfaces later as a
traceback far from the option that caused it. Rejecting them while parsing gives argparse's one-line usage error,
which names the option.
"""

from __future__ import annotations

import argparse
import math

from glm5_fp4.errors import Glm5Fp4Error


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def ranged(name: str, kind: type, ok, rule: str):
    """A parser of ``kind`` numbers for which ``ok(value)`` holds (``rule`` says which, in the error)."""

    def parse(text: str):
        value = _number(text, kind)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


positive_float = ranged("positive_float", float, lambda v: v > 0, "> 0")
nonneg_float = ranged("nonneg_float", float, lambda v: v >= 0, ">= 0")
fraction = ranged("fraction", float, lambda v: 0 < v <= 1, "in (0, 1]")  # a share of a whole
positive_int = ranged("positive_int", int, lambda v: v >= 1, ">= 1")
nonneg_int = ranged("nonneg_int", int, lambda v: v >= 0, ">= 0")


def int_in(name: str, lo: int, hi: int):
    """A parser of integers in [lo, hi]."""
    return ranged(name, int, lambda v: lo <= v <= hi, f"between {lo} and {hi}")


def comma_list(text: str, flag: str) -> list[str]:
    """The entries of a comma-separated list, none empty (``1,,4`` is a typo, not ``1,4``) and none twice (a row
    timed twice, a sweep level's files written twice); an empty text is an empty list, for the caller to refuse in
    its own words. Raises Glm5Fp4Error naming ``flag``."""
    items = [v.strip() for v in text.split(",")] if text.strip() else []
    if any(not v for v in items):
        raise Glm5Fp4Error(f"{flag} {text!r}: an empty entry (a comma too many?)")
    twice = sorted({v for v in items if items.count(v) > 1})
    if twice:
        raise Glm5Fp4Error(f"{flag} {text!r}: {', '.join(twice)} given twice")
    return items
