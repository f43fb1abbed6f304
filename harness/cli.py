"""harness/cli.py — the command line: --preset NAME, --scale SIZE, then --<field> VALUE for every Config
field.

    python train.py --preset demo --steps 10 --fork tok-entropy --out_dir runs/x
    python train.py --preset demo --help              # every flag, explained, with the demo's defaults
    python train.py --resume runs/x                   # continue a run with its own config.json
    python train.py --config runs/x/config.json --out_dir runs/y   # a new run with a saved run's settings

Values are parsed by the field's type (booleans: true/false, yes/no, 1/0, or the flag alone for true),
negative numbers in any notation are values, and a bad flag or value is one line (`prog: error: ...; see
--help`). `--help` explains every flag in one line from one source: the field's comment in config.py
(field_docs reads them from its source), grouped by config.py's sections, with its valid choices
(checks.py) and its default. TRL's and verl's names for the same settings are accepted, and names
whose meaning differs are refused with what to use (harness/aliases.py, docs/trl.md).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path

import checks
import config as C
import methods as M
from checks import CHOICES, LIST_CHOICES
from config import PRESETS, SCALES, Config, make_config
from harness import aliases


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


class Refuse(argparse.Action):
    """A foreign name whose meaning differs from ours (aliases.Alias with no field): one line saying what to
    use, as soon as it is read."""

    def __call__(self, parser, namespace, values, option_string=None):
        alias = aliases.BY_NAME[option_string[2:]]
        parser.error(f"{option_string} ({alias.source}): {alias.note}")


# --------------------------------------------------------------------------------------------------------
# One line of help per field, from config.py's comments
# --------------------------------------------------------------------------------------------------------
# config.py's sections of the algorithm's knobs (Sec. 4, App. C-F), which --help lists first
PAPER_SECTIONS = ("rollout and tree", "advantage", "update")
SECTION = re.compile(r"#\s*-{3,}\s*(.+?)\s*-{3,}\s*$")


@functools.lru_cache(maxsize=1)
def field_docs() -> dict[str, tuple[str, str]]:
    """{field: (section, explanation)} read from config.py's source: a field's explanation is the comment on
    its line (and on the lines of its statement) followed by the comment-only lines right below it; its
    section is the last `# ---- name ----` header above it. The comments stay the one source."""
    source = Path(C.__file__).read_text(encoding="utf-8")
    cls = next(node for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and node.name == Config.__name__)
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    fields = [(node.target.id, node.lineno, node.end_lineno) for node in cls.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    sections = sorted((n, SECTION.match(text).group(1)) for n, text in comments.items()
                      if SECTION.match(text) and cls.lineno <= n <= cls.end_lineno)
    docs = {}
    for k, (name, first, last) in enumerate(fields):
        stop = fields[k + 1][1] if k + 1 < len(fields) else cls.end_lineno
        parts = [comments[n] for n in range(first, last + 1) if n in comments]
        n = last + 1
        while n < stop and n in comments and lines[n - 1].lstrip().startswith("#") and \
                not SECTION.match(comments[n]):
            parts.append(comments[n])
            n += 1
        text = " ".join(part.lstrip("#").strip() for part in parts)
        section = next((title for line, title in reversed(sections) if line < first), "other")
        docs[name] = (section, text)
    return docs


def shown_default(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def field_help(name: str, default) -> str:
    """A field's help line: its explanation, its valid choices (when the explanation does not list them
    all), and its default (none shown when empty: the explanation says what empty means)."""
    text = field_docs().get(name, ("", ""))[1]
    choices = {**CHOICES, **LIST_CHOICES}.get(name)
    if choices and not all(re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", text) for c in choices):
        text += f" [{' | '.join(choices)}]"
    if default not in ("", [], None):
        text += f" (default {shown_default(default)})"
    return text.replace("%", "%%")


# --------------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------------
def new_parser(description: str) -> OneLineParser:
    """An empty parser with our formatting (wide help column, defaults written by field_help)."""
    return OneLineParser(description=description, allow_abbrev=False,
                         usage="%(prog)s [--preset NAME] [--scale SIZE] [--FLAG VALUE ...]",
                         formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=40,
                                                                             width=110),
                         epilog="Defaults are the --preset's (the paper's unless given: `--preset demo "
                                "--help` shows the demo's). A flag alone sets a boolean true. TRL's and "
                                "verl's names for these settings are accepted: docs/trl.md.")


def build_parser(description: str = "DATPO training", defaults: dict | None = None, own=None,
                 saved_config: bool = False) -> argparse.ArgumentParser:
    """The command line: --preset/--scale, every Config field grouped by config.py's sections (the
    paper's first, PAPER_SECTIONS), and TRL's/verl's names (harness/aliases.py; TRL's listed after the
    paper's sections). `defaults`: the values --help shows (a preset's; default: the
    dataclass's). `own(parser)`: a script's own flags, added first so that its --help shows them first.
    `saved_config`: --config FILE too (train.py: parse_args)."""
    parser = new_parser(description)
    if own is not None:
        own(parser)
    values = defaults or {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                          for f in dataclasses.fields(Config)}
    run = parser.add_argument_group("preset")
    run.add_argument("--preset", default="paper", choices=list(PRESETS), metavar="NAME",
                     help=f"a row of the paper's tables (method and its settings); demo/teach/tiny = DATPO "
                          f"at that scale: {', '.join(PRESETS)} (default paper)")
    run.add_argument("--scale", default=None, choices=list(SCALES),
                     help="run size (model, data, lengths, batches, steps); default: the preset's own")
    if saved_config:
        run.add_argument("--config", default=None, metavar="FILE",
                         help="a config.json a run saved: a new run with its settings (flags given change "
                              "them; not with --preset/--scale). To continue a run: --resume RUN alone")
    run.add_argument("--debug", action="store_true", default=None,
                     help="show the Python traceback of an error (faults.main_guard removes this flag first)")
    hints = typing.get_type_hints(Config)
    docs = field_docs()
    section_of = {f.name: docs.get(f.name, ("other", ""))[0] for f in dataclasses.fields(Config)}
    sections = list(dict.fromkeys(section_of.values()))          # config.py's order
    # --help lists the paper's knobs first (PAPER_SECTIONS), then TRL's names, each with what it becomes
    # here or why it is refused (filled by add_foreign_names), then the other sections
    groups = {s: parser.add_argument_group(s) for s in sections if s.startswith(PAPER_SECTIONS)}
    trl = parser.add_argument_group("TRL's names: accepted as ours, or refused saying what to use (verl's: "
                                    "docs/trl.md)")
    groups.update({s: parser.add_argument_group(s) for s in sections if s not in groups})
    for f in dataclasses.fields(Config):
        group = groups[section_of[f.name]]
        group.add_argument(f"--{f.name}", **field_kwargs(f.name, hints[f.name]),
                           help=field_help(f.name, values.get(f.name)))
    add_foreign_names(parser, hints, trl)
    return parser


def field_kwargs(name: str, kind) -> dict:
    """argparse settings of a field: its type, list fields one or more values (repeatable for --reward),
    booleans true when the flag comes alone, choices checked."""
    kwargs: dict = dict(default=None)
    if typing.get_origin(kind) is list:   # --report_to tensorboard wandb: one or more values
        item = typing.get_args(kind)[0]
        kwargs.update(type=item, nargs="+", metavar=item.__name__.upper())
        if name == "reward":            # --reward a.py:f --reward b.py:g, as TRL's list
            kwargs.update(action="extend")
    elif kind is bool:                  # --gradient_checkpointing alone = true
        kwargs.update(type=parse_bool, nargs="?", const=True, metavar="BOOL")
    else:
        kwargs.update(type=kind, metavar=kind.__name__.upper())
    if name in CHOICES or name in LIST_CHOICES:
        kwargs.update(choices={**CHOICES, **LIST_CHOICES}[name], metavar=None)
        if kind is not bool and typing.get_origin(kind) is not list:
            kwargs["metavar"] = "{" + ",".join({**CHOICES, **LIST_CHOICES}[name]) + "}"
    return kwargs


def add_foreign_names(parser: argparse.ArgumentParser, hints: dict, group) -> None:
    """TRL's names in `group` (--help lists each: what it becomes here, or "refused" and what to use); verl's
    dotted names accepted but listed only in docs/trl.md; a refused name is one line when used."""
    for alias in aliases.ALIASES:
        flag = f"--{alias.name}"
        if alias.field is None:
            shown = f"refused: {alias.hint or alias.note}" if alias.source == "TRL" else argparse.SUPPRESS
            (group if alias.source == "TRL" else parser).add_argument(flag, nargs="?", action=Refuse,
                                                                     metavar="VALUE", help=shown)
            continue
        kwargs = field_kwargs(alias.field, hints[alias.field]) if alias.kind is None \
            else field_kwargs("", alias.kind)
        if alias.convert and "choices" in kwargs:   # the foreign value is mapped first, then checked
            kwargs.update(choices=None, metavar="VALUE")
        shown = alias.note if alias.source == "TRL" else argparse.SUPPRESS
        (group if alias.source == "TRL" else parser).add_argument(flag, dest=aliases.dest(alias), help=shown,
                                                                 **kwargs)


# --------------------------------------------------------------------------------------------------------
# From the command line to a Config
# --------------------------------------------------------------------------------------------------------
def scanned(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in argv before parsing (--preset demo or --preset=demo), for --help's defaults."""
    for k, word in enumerate(argv):
        if word == flag and k + 1 < len(argv):
            return argv[k + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def help_defaults(argv: list[str]) -> dict | None:
    """The defaults --help shows: the values of the --preset/--scale given (None: the dataclass's)."""
    preset, scale = scanned(argv, "--preset"), scanned(argv, "--scale")
    if not preset and not scale:
        return None
    try:
        return dataclasses.asdict(make_config(preset or "paper", scale))
    except ValueError:   # a misspelt preset: the parse says so
        return None


def saved_config(path: str | Path, flag: str) -> dict:
    """The settings in a JSON file — --config FILE, or a run's config.json under --resume — checked as the
    command line checks its flags, before anything loads: every value of its field's kind
    (checks.kind_problem: the string "false" is not a boolean, 2.0 is not a number of steps), TRL's and
    verl's names read as ours (aliases.resolve, as on the command line), a key that is neither one line
    naming it. A run's own keys are read as today's: its history is left out, renamed fields by their new
    name, fields this version removed dropped (runs.upgrade). Any problem is a ValueError naming the flag,
    the file and the key."""
    from harness import runs

    path = Path(path)
    where = f"{flag} {path}"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {path} ({err.strerror or err}); expected a run's config.json")
    except ValueError as err:
        raise ValueError(f"{flag}: {path} is not JSON ({err}); expected a run's config.json")
    if not isinstance(saved, dict):
        raise ValueError(f"{flag}: {path} holds {type(saved).__name__}, expected a run's config.json object")
    kinds = {f.name: str(f.type) for f in dataclasses.fields(Config)}
    ours, foreign = {}, {}
    for key, value in runs.upgrade(saved).items():
        if key == "history" or key in runs.REMOVED_FIELDS:
            continue
        if key in kinds:
            ours[key] = value
        elif key in aliases.BY_NAME:
            foreign[key] = value
        else:
            near = difflib.get_close_matches(key, [*kinds, *aliases.BY_NAME], n=1)
            raise ValueError(f"{where}: unknown setting {json.dumps(key)}"
                             + (f" (did you mean {json.dumps(near[0])}?)" if near else "")
                             + "; expected the fields of config.py (train.py --help lists them) or TRL's or "
                               "verl's names for them")
    for key, value in [*ours.items(), *foreign.items()]:
        alias = aliases.BY_NAME.get(key) if key not in kinds else None
        if alias is not None and alias.field is None:   # refused with what to use (aliases.resolve)
            continue
        kind = kinds[key] if alias is None else (alias.kind.__name__ if alias.kind else kinds[alias.field])
        why = checks.kind_problem(kind, value)
        if why:
            raise ValueError(f"{where}: {json.dumps(key)}: got {checks.shown(value)}, expected {why}"
                             + (" (a JSON boolean: no quotes)" if kind == "bool" else ""))
    method = ours.get("method", Config.method)
    try:
        resolved = aliases.resolve(foreign, ours, method in M.METHODS
                                   and M.METHODS[method].rollout == "parallel") if foreign else {}
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    settings = {**ours, **resolved}
    for key, value in settings.items():   # a float field given an integer (1) holds the float (1.0)
        if kinds[key] == "float" and not isinstance(value, bool) and isinstance(value, int):
            settings[key] = float(value)
        elif kinds[key] == "list[float]" and isinstance(value, list):
            settings[key] = [float(v) for v in value]
    return settings


def resume_base(resume: str) -> dict:
    """--resume RUN alone: the run's own settings (RUN/config.json, or the run folder's of a checkpoint),
    writing into that run folder."""
    from harness import runs

    folder = runs.run_folder_of(resume)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"--resume {resume}: no config.json in {folder} to continue from; expected a run "
                         f"folder train.py wrote, or the run's flags (its --preset ...) with --resume")
    base = saved_config(config, "--resume")
    if Path(base.get("out_dir", "")).expanduser().resolve() != folder:
        base["out_dir"] = str(folder)     # the run moved, or runs from another folder: it stays where it is
    return base


def parse_args(argv: list[str] | None = None, description: str = "DATPO training") -> Config:
    """Parse the command line into a validated Config; argparse exits with a message on bad input.

    The settings start from --preset/--scale (the paper's by default), or from a saved config.json:
    --config FILE (a new run) or --resume RUN given without --preset/--scale (the run's own config.json,
    so the run continues as it was; any flag given with it is a change, which runs.check_resume_config
    allows or refuses as for any resume). Then the flags given, ours and TRL's/verl's (aliases.resolve)."""
    argv = aliases.hydra_pairs(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(description, help_defaults(argv), saved_config=True)
    args = parser.parse_args(argv)
    preset = args.preset if scanned(argv, "--preset") is not None else None   # None: not given
    try:
        cfg = config_of(args, preset)
    except ValueError as err:
        parser.error(str(err))
    from harness import runs

    return runs.resolve_paths(cfg)   # relative paths made absolute: the run resumes from any folder


def given_flags(args, exclude=(), base: dict | None = None, preset: str = "paper",
                scale: str | None = None) -> dict:
    """The Config fields set on the command line: ours as given, TRL's and verl's as ours (aliases.resolve;
    a refused value raises ValueError). The method (for --num_generations) is the flags', else the base
    settings', else the preset's."""
    names = {f.name for f in dataclasses.fields(Config)}
    given = {k: v for k, v in vars(args).items() if k in names and k not in exclude and v is not None}
    foreign = {k.split(":", 1)[1]: v for k, v in vars(args).items()
               if k.startswith("alias:") and v is not None}
    if not foreign:
        return given
    method = given.get("method") or (base or {}).get("method") or make_config(preset, scale).method
    parallel = method in M.METHODS and M.METHODS[method].rollout == "parallel"
    return {**given, **aliases.resolve(foreign, given, parallel)}


def config_of(args, preset: str | None) -> Config:
    """The Config of parsed flags (parse_args says where the settings start); `preset`: as given, or None."""
    base, resume = None, getattr(args, "resume", None)
    if args.config:
        if preset or args.scale:
            raise ValueError("--config FILE holds every setting of a run; --preset/--scale with it would be "
                             "ignored: expected one or the other (single flags may follow --config)")
        # a new run: never a resume, never a licence to delete a folder
        base = {**saved_config(args.config, "--config"), "resume": "", "overwrite": False,
                "allow_config_change": False}
        if not base.get("out_dir"):   # never the current folder (its config.json would be replaced)
            base["out_dir"] = f"runs/{Path(args.config).stem}"
    elif resume and not preset and not args.scale:
        base = {**resume_base(resume), "overwrite": False, "allow_config_change": False}
    overrides = given_flags(args, base=base, preset=preset or "paper", scale=args.scale)
    if base is None:
        cfg = make_config(preset or "paper", args.scale, **overrides)
        cfg.set_by.update(dict.fromkeys(overrides, "the command line"))   # harness/edits.py names them
        return cfg
    # a method changed on top of saved settings brings its own settings, as --method does (methods.py)
    defining = M.METHODS[overrides["method"]].settings if overrides.get("method") in M.METHODS else {}
    try:
        cfg = Config(**{**base, **defining, **overrides}).validate()
    except TypeError as err:   # a hand-edited config.json with a value of the wrong kind
        raise ValueError(f"{args.config or resume}: {err}; expected the settings as train.py wrote them") \
            from None
    saved = f"--config {args.config}" if args.config else f"--resume {resume} (the run's config.json)"
    cfg.set_by = {**dict.fromkeys(base, saved), **dict.fromkeys(defining, f"method {overrides.get('method')} "
                                                                          f"(methods.py)"),
                  **dict.fromkeys(overrides, "the command line")}
    return cfg
