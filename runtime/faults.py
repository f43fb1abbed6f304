"""runtime/faults.py — the user's mistakes: one clear line each (the floor: any file may raise them).

What each script uses (train.py, evaluate.py, the studies):

    from runtime import faults
    if __name__ == "__main__":
        faults.main_guard(main)          # UserError -> "prog: error: <one line>", exit 2; --debug: traceback

  UserError        a mistake of the person running the script (flag, path, data file, model name, ...). Its
                   message is one line naming what was wrong and what is expected. Real bugs are not
                   UserErrors and keep their traceback. Exit codes: 2 a mistake, 3 NonFiniteStop (too many
                   bad steps, or sampling met non-finite probabilities), 4 WriteError (disk full or another
                   write error: the path and the cause, the previous checkpoint intact), 130 StopTimeout.
  say              a console line that does not break a progress bar
  check_prompt_fits  a prompt and what follows it must fit the model's context
  write_failure    the cause of a write error (disk full, quota, read-only, I/O) in a few words

The pre-flight checks of paths, model names and data files are the shell's (harness/preflight.py); the
rest of the floor is runtime/ (oom.py, distributed.py, atomic.py, threads.py, figures.py).
"""
from __future__ import annotations

import errno
import re
import sys
from pathlib import Path


class UserError(ValueError):
    """A mistake in what the user asked for (a bad value): main_guard prints its one-line message and exits
    with 2."""

    exit_code = 2


class NonFiniteStop(UserError):
    """Training stopped because too many steps in a row had non-finite losses or gradients (exit code 3)."""

    exit_code = 3


class WriteError(UserError):
    """A file of the run could not be written (disk full, quota, read-only, I/O error): one line naming the
    path and the cause; the previous checkpoint is intact (exit code 4)."""

    exit_code = 4


class StopTimeout(UserError):
    """A stop signal was not honoured at a safe point within --stop_timeout seconds: the run exits mid-step,
    losing that step (exit code 130, as for an interrupt)."""

    exit_code = 130


def say(text: str) -> None:
    """A console line that does not break a tqdm bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def main_guard(main, argv: list[str] | None = None):
    """Run main(argv) as a command: a UserError prints `prog: error: message` on one line and exits with its
    exit code (2); a second Ctrl-C exits with 130 and a short line. `--debug` anywhere on the command line
    is removed before main sees it and lets every exception show its traceback. Any other exception is a bug
    and keeps its traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    prog = Path(sys.argv[0]).name or "python"
    try:
        return main(args)
    except UserError as err:
        if debug:
            raise
        message = " ".join(str(err).split("\n")).strip()
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


def model_context(model) -> int | None:
    """The model's context length (max position embeddings), when its config says."""
    return getattr(model.config, "max_position_embeddings", None)


def check_prompt_fits(n_prompt: int, new_tokens: int, context: int | None, where: str, flags: str = "",
                      fix: str = "a shorter problem or a smaller --max_new_tokens") -> None:
    """A prompt plus the most tokens generated after it must fit in the model's context: one response when
    evaluating, a whole root-to-leaf path of a tree when training (prompts.check_fits). flags: the settings
    that set new_tokens, shown in parentheses; fix: what to do instead."""
    if context and n_prompt + new_tokens > context:
        raise UserError(f"{where}: the prompt is {n_prompt} tokens and up to {new_tokens} new tokens follow"
                        f"{flags}, which exceeds the model's context of {context} tokens; expected {fix}")


def write_failure(err: BaseException) -> str | None:
    """A short cause when `err` is a write error (disk full, quota, read-only, I/O), else None. safetensors
    reports OS errors as its own exception with the OS error inside the message; torch.save reports a write
    the disk cut short as a RuntimeError "... unexpected pos N vs M" (its zip writer's byte count)."""
    code = getattr(err, "errno", None)
    text = str(err)
    if code == errno.ENOSPC or "No space left" in text or "StorageFull" in text or "os error 28" in text:
        return "disk full (No space left on device)"
    if code == errno.EDQUOT or "Disk quota" in text:
        return "disk quota exceeded"
    if isinstance(err, OSError):
        return err.strerror or text
    cut = re.search(r"unexpected pos \d+ vs \d+", text)
    if isinstance(err, RuntimeError) and cut:
        return f"disk full or over quota (torch.save's write was cut short: {cut.group(0)})"
    if "IoError" in text or "os error" in text:
        return text.splitlines()[0]
    return None
