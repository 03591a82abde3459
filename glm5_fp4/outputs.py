"""Output directories named on the command line (``--out``, ``--result-dir``, ...): one clear error, no debris.

A path that cannot be a directory (it is a file, or a file sits where a parent should be) is reported as one
:class:`Glm5Fp4Error` naming it, before anything is written; ``create=False`` only checks, so a command can
refuse bad output paths before a long run without leaving an empty directory behind if the run then fails.
"""

from __future__ import annotations

from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error


def output_dir(path: str | Path, flag: str = "--out", *, create: bool = True) -> Path:
    p = Path(path)
    for q in (p, *p.parents):
        if q.is_dir():
            break
        if q.exists() or q.is_symlink():
            culprit = f"{p}" if q == p else f"{p}: {q}"
            raise Glm5Fp4Error(f"{flag} {culprit} exists and is not a directory")
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Glm5Fp4Error(f"{flag} {p}: cannot create the directory ({exc.strerror or exc})") from None
    return p
