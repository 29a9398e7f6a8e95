"""Whether a path the user gave is the kind of thing a command reads there, said in words.

    problem = path_problem("folder", Path(base_path))   # None, or "DIR is a named pipe (FIFO), not a folder"

A symbolic link is followed (a Hugging Face cache's snapshot is links to its blobs); a named pipe, a socket or a
device is refused: a pipe is read only once, and opening it waits for a writer (hashing one hung).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def path_problem(kind: str, path: Path) -> str | None:
    """Why `path` is not a `kind` ("file": a regular file, or "folder") to read, in words, or None if it is one."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
        return f"no {kind} {path}"
    except OSError as e:  # a link loop, a folder above that is a file, no permission
        return f"cannot read {path} ({e.strerror})"
    if kind == "folder" and stat.S_ISDIR(mode) or kind == "file" and stat.S_ISREG(mode):
        return None
    what = ("a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else
            "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return f"{path} is {what}, not a {'regular file' if kind == 'file' else kind}"
