"""A name that becomes one file or folder name under a given directory (a run's exp_name and exp_id, a study
cell's name): one path component, which no file system refuses and which cannot leave that directory.

    problem = check_path_component(cfg.train.exp_id, "train.exp_id")   # None, or the one-line error message

Refused: empty; containing / or \\ (a path, not a name: it could also climb out with ..); `.` or `..`; a NUL
character; a name that is not valid UTF-8 (a command-line argument of undecodable bytes arrives as surrogates);
longer than NAME_MAX_BYTES in UTF-8, the limit of Linux's file systems (ext4, XFS, btrfs, tmpfs): past it every
call on the path fails with ENAMETOOLONG. A file system with a lower limit (eCryptfs: 143) still refuses
a longer name when it is created.

`check_path_length` checks only the lengths, of any path given to write (evaluate.py --json): each name in it and
the whole.
"""

from __future__ import annotations

import os

NAME_MAX_BYTES = 255


def _shown(value: str) -> str:
    """`value` as the message quotes it: repr, cut after 40 characters."""
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"


def check_path_component(value: str, what: str) -> str | None:
    """None if `value` is a valid file or folder name, else a one-line message naming `what` (the key or
    option that gave it) and why it is not."""
    if not value:
        why = "it is empty"
    elif "/" in value or "\\" in value:
        why = "no / or \\: a name, not a path"
    elif value in (".", ".."):
        why = "not . or .."
    elif "\0" in value:
        why = "it contains a NUL character"
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            why = "it is not valid UTF-8"
        else:
            if size <= NAME_MAX_BYTES:
                return None
            why = f"it is {size} bytes in UTF-8, more than the {NAME_MAX_BYTES} a file system allows in one name"
    return f"{what}: must be one file or folder name ({why}), got {_shown(value)}"


PATH_MAX_BYTES = 4096  # the longest path Linux takes, in bytes


def check_path_length(path: str, what: str) -> str | None:
    """None if every component of `path` (a file to write, any path) fits in NAME_MAX_BYTES and the whole in
    PATH_MAX_BYTES, else a one-line message naming `what` (the option that gave it): past either limit every
    call on the path fails with ENAMETOOLONG."""
    size = len(os.fsencode(path))
    if size >= PATH_MAX_BYTES:
        return f"{what}: the path is {size} bytes, more than the {PATH_MAX_BYTES - 1} a file system allows"
    for part in path.split("/"):
        size = len(os.fsencode(part))
        if size > NAME_MAX_BYTES:
            return (f"{what}: the name {_shown(part)} in that path is {size} bytes, more than the {NAME_MAX_BYTES} "
                    f"a file system allows in one file or folder name")
    return None
