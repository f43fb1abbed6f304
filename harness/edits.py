"""harness/edits.py — an edit of a default in config.py says at start whether it took effect.

A teacher runs an ablation by editing a default of `Config` (config.py's header). A row laid over the
defaults (the scale's, the method's settings, the preset's; config.layers), a saved config.json or a flag
may set that field again, and then the edit changes nothing. So at start the run writes one line per edited
field (a default that differs from what config.py ships, shipped_defaults.json):

    b_max = 3 in config.py → 2 from scale demo
    fork = 'random' in config.py: in effect (shipped 'sent-entropy')

    python -m harness.edits --write     # after changing a shipped default on purpose: record it
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import config as C

SHIPPED = Path(__file__).with_name("shipped_defaults.json")


def defaults(config_class=C.Config) -> dict:
    """{field: default} of a Config class, as JSON values (list defaults built by their factory)."""
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(config_class)}


def shipped() -> dict:
    """The defaults config.py ships with ({} when the record is missing: nothing is called an edit)."""
    try:
        return json.loads(SHIPPED.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def notes(cfg, record: dict | None = None) -> list[str]:
    """One line per default of cfg's Config class that differs from the shipped one: in effect, or which
    row, file or flag set the field instead (cfg.set_by, written by config.make_config and the command
    line; "a setting" when unknown)."""
    record = shipped() if record is None else record
    lines = []
    for name, default in defaults(type(cfg)).items():
        if name not in record or default == record[name]:
            continue
        value = getattr(cfg, name)
        if value == default:
            lines.append(f"{name} = {default!r} in config.py: in effect (shipped {record[name]!r})")
        else:
            source = getattr(cfg, "set_by", {}).get(name, "a setting")
            lines.append(f"{name} = {default!r} in config.py → {value!r} from {source}")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--write"]:
        raise SystemExit("usage: python -m harness.edits --write   (records config.py's defaults as shipped)")
    SHIPPED.write_text(json.dumps(defaults(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {SHIPPED}")


if __name__ == "__main__":
    main()
