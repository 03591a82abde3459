"""Same as `glm5-fp4 profile analyze ...` (for a checkout without the console script on PATH)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glm5_fp4.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["profile", "analyze", *sys.argv[1:]]))
