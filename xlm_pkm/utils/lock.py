"""One process at a time in a directory: a run directory (train.py) or a preprocessing output.

    with DirectoryLock(run_dir, ".lock", "use another train.exp_id"):   # or .release()
        ...

The lock is an advisory flock on DIR/NAME, which records its holder ("pid P on HOST since T") for
the error message. The kernel releases it when the holder exits, however it dies (even SIGKILL), so
a lock file left by a dead process never blocks the next one. Some network file systems do not
honour flock. With `remove=True` the holder deletes the file when it releases it (a data folder keeps
no trace of its preprocessing): a process that locked the file just as it was deleted sees that it
holds a file no longer at DIR/NAME, and locks the new one. A symbolic link at DIR/NAME is refused in one line
(utils/atomic.py's open_output), never opened: its target is not truncated.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from xlm_pkm.errors import UserError
from xlm_pkm.utils.atomic import open_output, write_error


class DirectoryBusy(UserError, RuntimeError):
    """Another live process holds the directory."""


class DirectoryLock:
    def __init__(self, directory: Path, name: str, advice: str, remove: bool = False):
        self.path, self.remove = Path(directory) / name, remove
        self.fd = None  # set once held: release (and __del__, also after a failed __init__) closes only ours
        while self.fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise DirectoryBusy(f"{self.path.parent} is in use by {holder} (lock {self.path}); {advice}") from None
            if self._still_there(fd):
                self.fd = fd
            else:  # its holder removed it as we locked it: lock the file at the path now
                os.close(fd)
        os.ftruncate(self.fd, 0)
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.pwrite(self.fd, holder.encode(), 0)

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(self.path, e) from None
        return open_output(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # a link there is refused, its target untouched

    def _still_there(self, fd: int) -> bool:
        """Whether the open file `fd` is still the one at the lock's path."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.fd is not None:
            if self.remove:  # removed while held: no one else can hold it now
                self.path.unlink(missing_ok=True)
            os.close(self.fd)  # drops the flock
            self.fd = None

    __del__ = release  # a holder dropped without release (its constructor failed later) frees the directory

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *_) -> None:
        self.release()
