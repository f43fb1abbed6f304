"""The code's style is checked, not hoped for: ruff with pyproject.toml's settings (lines of at most 110
characters, pycodestyle, pyflakes, import order) over the whole repository."""
import importlib.util
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
