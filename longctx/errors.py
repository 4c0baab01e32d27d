"""User-facing errors.

A `UserError` is a mistake in what the user asked for (a setting, a path, a checkpoint). Its
message is one sentence that names the setting and the fix; the CLI prints it and exits with
code 2, never a traceback. Anything else escaping is a bug in longctx.
"""

from __future__ import annotations

import difflib
import sys


class UserError(Exception):
    """Bad input from the user: one sentence naming the setting and the fix."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration value that is unknown, of the wrong type, or out of range."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, or does not match the model."""


class DataError(UserError):
    """A data path that is missing, empty, or not text."""


def run_script(main) -> None:
    """Run a script's `main()` (bench/*.py that take `--set`) as the CLI runs a command: a UserError
    prints `error: <sentence>` on stderr and exits 2, no traceback; otherwise exit with main's code."""
    try:
        code = main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    sys.exit(code)


def did_you_mean(name: str, choices) -> str:
    """' did you mean X?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


_FALLBACKS_SAID: set[str] = set()


def warn_fallback(msg: str, stacklevel: int = 3) -> None:
    """A fast path declined on the GPU and a plain-torch twin runs instead: never silent. Said once
    per process per message (RuntimeWarning); the step log's implementation report shows it too."""
    if msg not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(msg)
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
