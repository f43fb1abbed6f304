"""runtime/figures.py — text someone typed or a model wrote, drawn in a matplotlib figure exactly as written.

matplotlib reads a string with an even number of unescaped `$` as math text: a run name `runs/${M}_${S}`, a
benchmark file `cost$$.jsonl`, a problem `$x \\le 5$` or a generated token `$$` then stops the figure (and the
command that draws it) with a ParseException, or is drawn as something it does not say. Every title, label,
tick and text drawn from such a string goes through `literal` (harness/loop.py's training.png, harness/viz.py,
evaluate.py's figures, the studies' figures); the project's own labels ("95 % CI", "pass@k") are plain text.
"""
from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def literal(text) -> str:
    """`text` as matplotlib draws it literally: every `$` escaped (so no math text is parsed), and a lone
    surrogate shown as \\xNN (printable)."""
    return printable(text).replace("$", r"\$")


def printable(text) -> str:
    """`text` with each lone surrogate — a byte of a file name that is not UTF-8 (os.fsdecode), or a "\\udce9"
    escape in a JSON file — shown as \\xNN (\\uNNNN), so that it can be drawn (FreeType refuses it) and
    written to a UTF-8 file."""
    return _SURROGATE.sub(lambda m: _byte_escape(m.group()), str(text))


def _byte_escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"
