"""runtime/atomic.py — files replaced whole, through temporary files no planted link can redirect.

    atomic.replace_file(path, lambda tmp: fig.savefig(tmp, format="png"))   # any writer that takes a path
    atomic.write_text(path, text)                                          # text, JSON, bytes
    open(path, "a", opener=atomic.no_follow)                               # append, never through a link
    atomic.remove_tree(path)                                               # a link is unlinked, not followed

A run or evaluation folder may be shared or downloaded, and so may carry a symbolic link under any name a
writer uses: a fixed temporary name (metrics.tmp, config.json.tmp) or the final name itself. Opening such a
name for writing writes into whatever the link points at. So every temporary file here is created new and
exclusively (O_CREAT | O_EXCL | O_NOFOLLOW, under a random name, in the final file's folder so the rename
stays on one disk), written, and renamed over the final name: a rename replaces a link at the final name
instead of following it, and a kill or a full disk leaves the old file or the new one, never half of one
(the temporary file is removed before the error goes on). New files get the usual permissions (0666 less the
umask), unlike tempfile.mkstemp's 0600, so a shared run folder stays readable.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def exclusive_temp(path: str | Path, suffix: str = ".tmp") -> Path:
    """A new, empty file beside `path` (".<name>.<random><suffix>"), created by this call alone: never an
    existing file or a link someone planted under that name."""
    path = Path(path)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temporary name beside {path.name}")


def replace_file(path: str | Path, write) -> None:
    """write(tmp) into an exclusive temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = exclusive_temp(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, encoding: str | None = None) -> None:
    """Replace `path` with `text` (replace_file)."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def write_bytes(path: str | Path, data: bytes) -> None:
    replace_file(path, lambda tmp: tmp.write_bytes(data))


def write_json(path: str | Path, value, **dumps) -> None:
    """Replace `path` with `value` as JSON (json.dumps's keyword arguments, e.g. indent=2)."""
    write_text(path, json.dumps(value, **dumps))


def no_follow(path, flags: int) -> int:
    """An `opener` for open(): the file is opened only if it is not a symbolic link (else OSError ELOOP), so
    a write or an append cannot land in a file outside the folder: open(path, "a", opener=no_follow)."""
    return os.open(path, flags | NOFOLLOW, 0o666)


def remove_tree(path: str | Path) -> None:
    """Remove a file, a folder and everything in it, or a link (the link only: what it points at is not
    ours). Missing: nothing to do."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()
