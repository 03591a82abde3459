"""Warp-stall samples per SASS instruction from ``ncu --page source --csv --print-source sass`` exports.

The MoE write-ups (improvements/22, 25, 27) cite shares of a kernel's stall samples on particular instructions
(the wait for x, a wgmma wait, the weight ring's cp.async wait). Those numbers come from ncu's source page, which
``benchmarks/h200/small_t_two_launch_job.sh source`` saves as ``ncu_source_*.csv.gz``: one section per kernel, each a
``"Kernel Name","<name>",`` line, a header row and one row per SASS instruction. This module reads such a file and
summarizes it per kernel, so that every cited share can be recomputed from the committed file
(``benchmarks/ncu_stalls.py``).

An instruction's samples count the warps that stood on it when sampled: a stall shows on the instruction that
waits, which is often the one *after* the wait (a ``DEPBAR`` or barrier's cost lands on the next instruction).
"""

from __future__ import annotations

import csv
import gzip
import io
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOURCE = "Source"
SECTION = '"Kernel Name"'


@dataclass
class Instruction:
    index: int  # position in the kernel's SASS listing (as the source page prints it)
    source: str
    samples: int
    executed: int

    @property
    def opcode(self) -> str:
        """The mnemonic without predicate and modifiers: ``@!P0 LDS.U8 R1, [..]`` -> ``LDS``."""
        words = [w for w in self.source.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else "?"


@dataclass
class KernelStalls:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    @property
    def executed(self) -> int:
        return sum(i.executed for i in self.instructions)

    def share(self, ins: Instruction) -> float:
        return ins.samples / self.samples if self.samples else 0.0

    def top(self, n: int) -> list[Instruction]:
        """The ``n`` instructions with the most samples, in listing order."""
        hot = sorted(self.instructions, key=lambda i: (-i.samples, i.index))[:n]
        return sorted(hot, key=lambda i: i.index)

    def by_opcode(self) -> list[tuple[str, int]]:
        """(opcode, samples), most samples first."""
        out: dict[str, int] = {}
        for i in self.instructions:
            out[i.opcode] = out.get(i.opcode, 0) + i.samples
        return sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))


def _int(value: str, path: Path, kernel: str, column: str, row: int) -> int:
    v = value.strip().replace(",", "")
    if v in ("", "-"):
        return 0
    try:
        return int(float(v))
    except ValueError:
        raise Glm5Fp4Error(f"{path}: kernel {kernel}, instruction {row}: column {column!r} is {value!r}, not a number"
                           ) from None


def _section(path: Path, name: str, lines: list[str]) -> KernelStalls:
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows:
        raise Glm5Fp4Error(f"{path}: kernel {name} has no header row")
    header = rows[0]
    missing = [c for c in (SOURCE, SAMPLES, EXECUTED) if c not in header]
    if missing:
        raise Glm5Fp4Error(f"{path}: kernel {name}'s header lacks {missing} (export the source page with "
                           "`ncu --import R.ncu-rep --page source --csv --print-source sass` of a --set full report)")
    i_src, i_s, i_e = (header.index(c) for c in (SOURCE, SAMPLES, EXECUTED))
    k = KernelStalls(name)
    for n, r in enumerate(rows[1:]):
        if not r:
            continue
        if len(r) <= max(i_src, i_s, i_e):
            raise Glm5Fp4Error(f"{path}: kernel {name}, instruction {n}: {len(r)} fields, the header has {len(header)}")
        k.instructions.append(Instruction(n, r[i_src].strip(), _int(r[i_s], path, name, SAMPLES, n),
                                          _int(r[i_e], path, name, EXECUTED, n)))
    return k


def read(path: str | Path) -> list[KernelStalls]:
    """Every kernel section of an ncu source-page CSV (``.csv`` or ``.csv.gz``), in file order."""
    path = Path(path)
    if not path.is_file():
        raise Glm5Fp4Error(f"{path}: no such file (an ncu source-page CSV, e.g. benchmarks/results/"
                           "moe_kernel_h100_ncu_source_tp8_t1024_7635a60.csv.gz)")
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:  # (zlib.error: corrupt deflate data)
        raise Glm5Fp4Error(f"{path}: cannot read it as text or gzip ({exc})") from None
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(SECTION)]
    if not starts:
        raise Glm5Fp4Error(f"{path}: no '\"Kernel Name\"' section: not an ncu source-page CSV")
    kernels = []
    for j, s in enumerate(starts):
        fields = next(csv.reader([lines[s]]))
        name = fields[1] if len(fields) > 1 and fields[1] else f"kernel {j}"
        end = starts[j + 1] if j + 1 < len(starts) else len(lines)
        kernels.append(_section(path, name, lines[s + 1:end]))
    return kernels


def pick(kernels: list[KernelStalls], name: str) -> list[KernelStalls]:
    """The sections whose kernel name contains ``name`` (one error naming the choices if none does)."""
    got = [k for k in kernels if name in k.name]
    if not got:
        raise Glm5Fp4Error(f"no kernel matching {name!r}; the file has {sorted({k.name for k in kernels})}")
    return got


def summary(k: KernelStalls, top: int = 20, opcodes: int = 12) -> dict:
    """What ``benchmarks/ncu_stalls.py`` prints and writes: totals, samples per opcode, the hottest instructions."""
    total = k.samples
    return {
        "kernel": k.name,
        "samples": total,
        "instructions": len(k.instructions),
        "executed": k.executed,
        "by_opcode": [{"opcode": op, "samples": s, "share": s / total if total else 0.0}
                      for op, s in k.by_opcode()[:opcodes]],
        "top": [{"index": i.index, "samples": i.samples, "share": k.share(i), "executed": i.executed,
                 "source": i.source} for i in k.top(top)],
    }


def markdown(s: dict) -> str:
    lines = [f"### {s['kernel']}: {s['samples']:,} stall samples over {s['instructions']} SASS instructions "
             f"({s['executed']:,} warp instructions executed)", "",
             "samples by opcode: " + ", ".join(f"{o['opcode']} {100 * o['share']:.1f} %" for o in s["by_opcode"]), "",
             "| # | samples | share | executed | instruction |", "|---|---|---|---|---|"]
    lines += [f"| {t['index']} | {t['samples']:,} | {100 * t['share']:.1f} % | {t['executed']:,} | `{t['source']}` |"
              for t in s["top"]]
    return "\n".join(lines) + "\n"
