"""harness/cli.py — the command line: --preset NAME, --scale SIZE, then --<field> VALUE for every Config
field.

    python train.py --preset demo --steps 10 --fork tok-entropy --out_dir runs/x

Values are parsed by the field's type (booleans: true/false, yes/no, 1/0), negative numbers in any notation
are values, and a bad flag or value is one line (`prog: error: ...; see --help`).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing

from config import PRESETS, SCALES, Config, make_config
from harness.checks import CHOICES, LIST_CHOICES


def parse_bool(text: str) -> bool:
    """A command-line boolean: 1/true/yes/on or 0/false/no/off (any case)."""
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


# A value that starts with a minus is a number, not a flag: `--alpha_end -1e-3`, `--lr -inf` (argparse's own
# pattern takes only -1 and -1.5, and reads -1e-3 as an unknown flag). No flag of ours looks like a number.
NEGATIVE_NUMBER = re.compile(r"-(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|-(?:inf|infinity|nan)", re.IGNORECASE)


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line (`prog: error: ...; see --help`), not the usage of ~70 flags and then the line.
    Negative numbers in any notation are values (NEGATIVE_NUMBER)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(f"^(?:{NEGATIVE_NUMBER.pattern})$", re.IGNORECASE)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(description: str = "DATPO training") -> argparse.ArgumentParser:
    parser = OneLineParser(description=description, allow_abbrev=False,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--debug", action="store_true", default=None,
                        help="show the Python traceback of an error "
                             "(faults.main_guard removes this flag first)")
    parser.add_argument("--preset", default="paper", choices=list(PRESETS),
                        help="a row of the paper's tables (method and its settings); "
                             "demo/tiny = DATPO at that scale")
    parser.add_argument("--scale", default=None, choices=list(SCALES),
                        help="run size (model, data, lengths, batches, steps); default: the preset's own")
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        kind = hints[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kwargs = dict(default=None, help=f"default {default!r} (before the preset)")
        if typing.get_origin(kind) is list:   # --report_to tensorboard wandb: one or more values
            item = typing.get_args(kind)[0]
            kwargs.update(type=item, nargs="+", metavar=item.__name__.upper())
        else:
            kwargs.update(type=parse_bool if kind is bool else kind, metavar=kind.__name__.upper())
        if f.name in CHOICES or f.name in LIST_CHOICES:
            kwargs.update(choices={**CHOICES, **LIST_CHOICES}[f.name], metavar=None)
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_args(argv: list[str] | None = None, description: str = "DATPO training") -> Config:
    """Parse the command line into a validated Config; argparse exits with a message on bad input."""
    parser = build_parser(description)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("preset", "scale", "debug") and v is not None}
    try:
        return make_config(args.preset, args.scale, **overrides)
    except ValueError as err:
        parser.error(str(err))
