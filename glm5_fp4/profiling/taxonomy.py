"""Kernel name -> category, from the one ordered regex taxonomy in ``glm5_fp4/data/taxonomy.yaml``.

First match wins. A name no rule matches is category ``other`` with label ``unknown``: reports list those by
name so a new kernel family is noticed instead of silently landing in a bucket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import read_text

ALLREDUCE_WAIT = "allreduce_wait"
"""Derived category: the part of an all-reduce kernel spent waiting for the last rank to arrive."""

UNKNOWN_LABEL = "unknown"
FALLBACK_CATEGORY = "other"


@dataclass(frozen=True)
class Rule:
    category: str
    label: str
    pattern: re.Pattern
    # A family of small kernels caught by a broad pattern ('moe|expert'): more of the kernel time than this share
    # means a big kernel (a new MoE GEMM) landed in it, and the reports say so.
    max_share: float | None = None


@dataclass
class Taxonomy:
    categories: dict[str, str]
    exposed_priority: list[str]
    rules: list[Rule]
    source: str
    _cache: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)

    def classify(self, name: str) -> tuple[str, str]:
        """(category, label) of a kernel name."""
        hit = self._cache.get(name)
        if hit is None:
            hit = (FALLBACK_CATEGORY, UNKNOWN_LABEL)
            for rule in self.rules:
                if rule.pattern.search(name):
                    hit = (rule.category, rule.label)
                    break
            self._cache[name] = hit
        return hit

    def category(self, name: str) -> str:
        return self.classify(name)[0]

    @property
    def small_families(self) -> dict[str, float]:
        """label -> the largest share of kernel time its family should take (rules with ``max_share``)."""
        return {r.label: r.max_share for r in self.rules if r.max_share is not None}

    @property
    def report_categories(self) -> list[str]:
        """Categories as reports show them: the taxonomy's own, then the derived all-reduce wait."""
        return list(self.categories) + [ALLREDUCE_WAIT]

    @property
    def priority(self) -> list[str]:
        """Exposed-time priority including the derived wait category (always last)."""
        return list(self.exposed_priority) + [ALLREDUCE_WAIT]


def _parse(data: object, origin: str) -> Taxonomy:
    if not isinstance(data, dict):
        raise Glm5Fp4Error(f"{origin}: expected a mapping with 'categories', 'exposed_priority' and 'rules'")
    categories = data.get("categories")
    if not isinstance(categories, dict) or not categories:
        raise Glm5Fp4Error(f"{origin}: 'categories' must be a non-empty mapping of name -> description")
    for required in (FALLBACK_CATEGORY, "allreduce"):
        if required not in categories:
            raise Glm5Fp4Error(f"{origin}: 'categories' must include {required!r}")
    if ALLREDUCE_WAIT in categories:
        raise Glm5Fp4Error(f"{origin}: {ALLREDUCE_WAIT!r} is derived by the analysis; do not list it as a category")
    priority = data.get("exposed_priority")
    if not isinstance(priority, list) or sorted(priority) != sorted(categories):
        raise Glm5Fp4Error(
            f"{origin}: 'exposed_priority' must list every category exactly once; got {priority!r}, "
            f"categories {sorted(categories)}"
        )
    rules_raw = data.get("rules")
    if not isinstance(rules_raw, list) or not rules_raw:
        raise Glm5Fp4Error(f"{origin}: 'rules' must be a non-empty list")
    rules = []
    for i, raw in enumerate(rules_raw):
        where = f"{origin}: rule {i + 1}"
        if not isinstance(raw, dict) or not {"category", "pattern"} <= raw.keys():
            raise Glm5Fp4Error(f"{where}: needs 'category' and 'pattern', got {raw!r}")
        unknown_keys = set(raw) - {"category", "label", "pattern", "ignore_case", "max_share"}
        if unknown_keys:
            raise Glm5Fp4Error(f"{where}: unknown field(s) {sorted(unknown_keys)}")
        if raw["category"] not in categories:
            raise Glm5Fp4Error(f"{where}: category {raw['category']!r} is not one of {sorted(categories)}")
        flags = re.IGNORECASE if raw.get("ignore_case", True) else 0
        try:
            pattern = re.compile(str(raw["pattern"]), flags)
        except re.error as exc:
            raise Glm5Fp4Error(f"{where}: bad regex {raw['pattern']!r} ({exc})") from None
        share = raw.get("max_share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise Glm5Fp4Error(f"{where}: max_share must be a number in (0, 1], got {share!r}")
        rules.append(Rule(raw["category"], str(raw.get("label") or raw["category"]), pattern,
                          None if share is None else float(share)))
    return Taxonomy(dict(categories), list(priority), rules, origin)


@lru_cache(maxsize=4)
def _load_cached(path: str | None) -> Taxonomy:
    if path is None:
        text = (resources.files("glm5_fp4") / "data" / "taxonomy.yaml").read_text()
        origin = "glm5_fp4/data/taxonomy.yaml"
    else:
        origin = path
        text = read_text(path, "taxonomy")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise Glm5Fp4Error(f"{origin}: not valid YAML ({exc})") from None
    return _parse(data, origin)


def load_taxonomy(path: str | Path | None = None) -> Taxonomy:
    """The packaged taxonomy, or a user file of the same shape."""
    return _load_cached(None if path is None else str(path))


def packaged_taxonomy_path() -> Path:
    return Path(str(resources.files("glm5_fp4") / "data" / "taxonomy.yaml"))
