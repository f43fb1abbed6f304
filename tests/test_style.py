"""The code's style is checked, not hoped for: ruff with pyproject.toml's settings (lines of at most 110
characters, pycodestyle, pyflakes, import order) over the whole repository."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: ./install.sh installs it (requirements.txt)")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check . found:\n{out.stdout}{out.stderr}"


def test_the_reading_order_has_lines_of_at_most_100_characters():
    """README's "Read in this order" files, the ones a student reads top to bottom, keep lines of at
    most 100 characters (ruff's limit is 110 for the rest; a line length cannot be set per file)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Read in this order", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"^\| \d+ \| `([^`]+)` \|", section, flags=re.M)
    assert len(files) >= 5, f"README's reading-order table not found (got {files})"
    long = [f"{f}:{i}: {len(line)} characters" for f in files
            for i, line in enumerate((ROOT / f).read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not long, "lines over 100 characters in the reading order:\n" + "\n".join(long)
