"""One-line errors: what the user must fix, reported by every command as `PROGRAM: error: MESSAGE`.

Every error written for the user derives from `UserError` (a bad config key, an unwritable output, a
busy run directory, non-finite weights, a rank that stopped answering...); the checks of inputs also
raise the built-in FileNotFoundError, FileExistsError and ValueError with one-line messages. A command
catches `USER_ERRORS` and returns `fail(program, error)`; anything else is a bug and keeps its traceback.

Exit status of the commands: 0 done; 2 an error with a one-line message; 75 (EX_TEMPFAIL) train.py
stopped by a signal or its time limit before max_steps, with a checkpoint: run the same command again
to resume (a second stop signal while it stops, other than Ctrl-C, changes nothing); 130 interrupted by a
second Ctrl-C (or one outside the training loop); 1 a crash (a traceback: a bug). XLM_PKM_DEBUG=1 shows
the traceback of one-line errors too.
"""

from __future__ import annotations

import os
import sys

EXIT_ERROR, EXIT_STOPPED, EXIT_INTERRUPTED = 2, 75, 130


class UserError(Exception):
    """An error whose message alone tells the user what is wrong (no traceback needed)."""


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message names the key at fault."""


USER_ERRORS = (UserError, FileNotFoundError, FileExistsError, ValueError)


def fail(program: str, error: BaseException, status: int = EXIT_ERROR) -> int:
    """Prints `program: error: message` on stderr (re-raises with XLM_PKM_DEBUG=1); returns `status`."""
    if os.environ.get("XLM_PKM_DEBUG"):
        raise error
    print(f"{program}: error: {error}", file=sys.stderr)
    return status
