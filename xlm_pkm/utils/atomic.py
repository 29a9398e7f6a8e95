"""Output files written whole or not at all: shards, plans, checkpoints, metrics, JSON results.

Every output is first written to `NAME.PID.TOKEN.tmp` (pid and random token: two processes never
share a temporary file), then renamed to NAME; on any error the temporary file is removed and the
previous NAME, if any, is left as it was. A write that fails (disk full, read-only directory) raises
`OutputError`, one line naming NAME (and saying that its previous version is kept).

That OutputError is the one the caller sees, whatever the code writing the file makes of it: a writer
that turns it into its own error (torch.save's zip writer: `RuntimeError ... unexpected pos`), or
swallows it, still ends in our OutputError, and closing the failed file does not write its buffer
again (which would raise a second OSError in place of ours).

No output is written through a symbolic link: the temporary file is created with O_CREAT | O_EXCL | O_NOFOLLOW
(nothing planted at its name is opened), a file appended to (a run's train.log, metrics.jsonl, its lock) is opened
with O_NOFOLLOW (`open_output_file`, `open_output`), and a link found there (planted to point at another file: a
user's ~/.bashrc, another run's checkpoint) is one OutputError naming it, its target untouched. A name longer than
the file system allows is `cannot write NAME: File name too long` (write_error raised itself, looking it up again).
"""

from __future__ import annotations

import errno
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from xlm_pkm.errors import UserError
from xlm_pkm.utils.path_component import NAME_MAX_BYTES


class OutputError(UserError, RuntimeError):
    """An output file could not be written."""


def temporary_name(path: Path) -> Path:
    """A temporary file name next to `path`, unique to this process and call; `path`'s name cut short where
    needed, so that a final name that fits in NAME_MAX_BYTES gets a temporary one that fits too."""
    path = Path(path)
    name, suffix = path.name, f".{os.getpid()}.{secrets.token_hex(4)}.tmp"
    if len(os.fsencode(name)) + len(suffix) > NAME_MAX_BYTES:
        name = os.fsencode(name)[:NAME_MAX_BYTES - len(suffix)].decode("utf-8", "ignore")
    return path.with_name(name + suffix)


def is_temporary(path: Path) -> bool:
    return Path(path).name.endswith(".tmp")


def write_error(path: Path, error: OSError) -> OutputError:
    """The one line of a failed write of `path` (never raises itself: a name too long for the file system fails
    every call on it)."""
    if error.errno == errno.ELOOP and os.path.islink(path):
        return link_error(path)
    kept = f"; the previous {Path(path).name} is kept" if os.path.lexists(path) else ""  # False where it cannot look
    return OutputError(f"cannot write {path}: {error.strerror or error}{kept}")


def link_error(path: Path) -> OutputError:
    return OutputError(f"{path} is a symbolic link: no output is written through a link (it may point anywhere, "
                       f"its target is left untouched); remove it")


def _no_follow(path, flags: int) -> int:
    """open's opener: the file at `path` itself, never where a symbolic link there points (ELOOP)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def _new_file(path, flags: int) -> int:
    """open's opener: a file this call creates (EEXIST if anything, a link included, is at `path`)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def open_output(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags | O_NOFOLLOW): a file descriptor on `path` itself, never on where a symbolic link
    there points (link_error); any other failure is write_error's one line."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        raise write_error(path, e) from None


def open_output_file(path: Path, mode: str, **open_kwargs):
    """open(path, mode, ...) of a file a run writes or appends to, without following a symbolic link at `path`
    (link_error); any other failure is write_error's one line."""
    try:
        return open(path, mode, opener=_no_follow, **open_kwargs)
    except OSError as e:
        raise write_error(path, e) from None


class _Output:
    """A file whose failed writes raise OutputError naming the final path; the first such error is kept
    in `error` (atomic_file raises it in place of whatever the writing code turned it into)."""

    def __init__(self, file, path: Path):
        self._file, self._path = file, path
        self.error: OutputError | None = None

    def _failed(self, error: OSError) -> OutputError:
        if self.error is None:
            self.error = write_error(self._path, error)
        return self.error

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as e:
            raise self._failed(e) from None

    def writelines(self, lines):
        try:
            return self._file.writelines(lines)
        except OSError as e:
            raise self._failed(e) from None

    def flush(self):
        try:
            return self._file.flush()
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name):
        return getattr(self._file, name)


def _close_failed(file) -> None:
    """Close a file whose writing failed, without the error of writing its buffer once more (the buffer
    is lost with the temporary file; Python's close releases the descriptor even when its flush fails)."""
    try:
        file.close()
    except OSError:
        pass


@contextmanager
def atomic_file(path: Path, mode: str = "wb", **open_kwargs):
    """Open a temporary file for `path`; on success flush it to disk and rename it to `path`.
    Errors raised by the body (another file's OutputError, a read error) pass through unchanged, except
    when a write to this file failed: then its OutputError is raised, whatever the body raised (or if it
    raised nothing), and nothing is renamed.

        with atomic_file(out / "meta.json", "w") as f:
            f.write(text)
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:  # a new file, this process's own: nothing planted at its name (a link) is opened
        file = open(tmp, mode, opener=_new_file, **open_kwargs)
    except OSError as e:
        raise write_error(path, e) from None
    output = _Output(file, path)
    try:
        try:
            yield output
            if output.error is not None:  # the body caught our error and went on: the file is incomplete
                raise output.error
            try:
                file.flush()
                os.fsync(file.fileno())
                file.close()
            except OSError as e:
                raise write_error(path, e) from None
        except BaseException as e:
            _close_failed(file)
            if output.error is not None and e is not output.error and isinstance(e, Exception):
                raise output.error from None  # ours, not what the writer made of it
            raise
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise write_error(path, e) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def holds_json_with(path: Path, keys: set[str]) -> bool:
    """Whether `path` holds a JSON object with at least `keys` (a result file a command wrote)."""
    import json

    try:
        with open(path, "rb") as f:
            value = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and keys <= value.keys()


def refuse_foreign_file(path: Path, is_ours, option: str, ours: str) -> None:
    """Raises OutputError if `path` is a folder, or a file that `is_ours(path)` does not recognise as an
    output of this command (`ours` says what that is): a command replaces only the files it wrote."""
    path = Path(path)
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as e:  # a name too long, a loop of links: nothing can be written there either
        raise write_error(path, e) from None
    if is_dir:
        raise OutputError(f"{option} {path}: is a directory; give a file name")
    if exists and not is_ours(path):
        raise OutputError(f"{option} {path}: exists and is not {ours}, which is all this command replaces; "
                          f"give another file name, or move that file away")


def check_writable(path: Path) -> None:
    """Raises OutputError now if a file cannot be written in `path`'s folder (missing or read-only folder,
    or a disk so full that not one byte fits), before hours of work. A disk with a little room left may
    still fill before the output is written: that write then fails with its own OutputError."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        f = open(tmp, "wb", buffering=0, opener=_new_file)  # unbuffered: closing writes nothing more
        try:  # ours (else nothing is removed)
            with f:
                f.write(b"\n")
                os.fsync(f.fileno())
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise write_error(path, e) from None
