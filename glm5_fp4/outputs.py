"""Output directories named on the command line (``--out``, ``--result-dir``, ...): one clear error, no debris.

A path that cannot be a directory (it is a file, or a file sits where a parent should be) is reported as one
:class:`Glm5Fp4Error` naming it, before anything is written; ``create=False`` only checks, so a command can
refuse bad output paths before a long run without leaving an empty directory behind if the run then fails.
"""

from __future__ import annotations

import os
import tempfile
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
    else:
        _check_writable(p, q, flag)
    return p


def _check_writable(p: Path, existing: Path, flag: str) -> None:
    """Try what the command will do later, in the nearest existing directory ``existing`` of ``p``: make (and remove)
    a scratch directory there. Permission bits say nothing for root, nor for /proc or a read-only mount."""
    try:
        Path(tempfile.mkdtemp(prefix=".glm5-fp4-probe-", dir=existing)).rmdir()
    except OSError as exc:
        where = f"{p}" if existing == p else f"{p} (in {existing})"
        raise Glm5Fp4Error(f"{flag} {where}: cannot write there ({exc.strerror or exc})") from None


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """A file a command writes at the end of a long run (a benchmark's results), checked before the run: not a
    folder, and its folder one that can be made and written (nothing is created now)."""
    p = Path(path)
    if p.is_dir():
        raise Glm5Fp4Error(f"{flag} {p}: is a directory; name the file to write")
    output_dir(p.parent, flag, create=False)
    return p


def write_file(path: str | Path, text: str) -> Path:
    """``text`` as ``path`` (its folder made), atomically: what :func:`output_file` checked up front."""
    path = Path(path)
    output_dir(path.parent, str(path))
    write_text_atomic(path, text)
    return path


def plain_file_mode(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0666 less the umask): files written through a
    private temporary file (mkstemp, safetensors) are 0600, which another account (a server's) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``: a reader (a report run while
    recording) or a failed write never sees a half-written file. Errors: one Glm5Fp4Error naming ``path``."""
    write_bytes_atomic(path, text.encode("utf-8"))


def _stage(path: Path, data: bytes) -> str:
    """``data`` in a temporary file beside ``path`` (removed again if it cannot be written whole); its name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        plain_file_mode(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """:func:`write_text_atomic` for bytes (a figure, a trace)."""
    path = Path(path)
    try:
        os.replace(_stage(path, data), path)
    except OSError as exc:
        raise Glm5Fp4Error(f"{path}: cannot write ({exc.strerror or exc})") from None


def write_texts_together(texts: dict[Path, str]) -> None:
    """Files that describe one thing (a run's summary, its requests, its table): every one staged first, then all
    renamed into place, so a write that fails (a full disk) leaves all of the former files and none of the new
    (file by file, an earlier run's summary stayed beside the new run's requests)."""
    staged: list[tuple[str, Path]] = []
    current = None
    try:
        for path, text in texts.items():
            current = Path(path)
            staged.append((_stage(current, text.encode("utf-8")), current))
        for tmp, path in staged:
            current = path
            os.replace(tmp, path)
    except OSError as exc:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise Glm5Fp4Error(f"{current}: cannot write ({exc.strerror or exc})") from None


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure as ``path`` (its format from the suffix), written atomically like the reports beside it."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
    write_bytes_atomic(path, buf.getvalue())
    return Path(path)
