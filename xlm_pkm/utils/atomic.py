"""Output files written whole or not at all: shards, plans, checkpoints, metrics, JSON results.

Every output is first written to `NAME.PID.TOKEN.tmp` (pid and random token: two processes never
share a temporary file), then renamed to NAME; on any error the temporary file is removed and the
previous NAME, if any, is left as it was. A write that fails (disk full, read-only directory) raises
`OutputError`, one line naming NAME (and saying that its previous version is kept).

That OutputError is the one the caller sees, whatever the code writing the file makes of it: a writer
that turns it into its own error (torch.save's zip writer: `RuntimeError ... unexpected pos`), or
swallows it, still ends in our OutputError, and closing the failed file does not write its buffer
again (which would raise a second OSError in place of ours).
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from xlm_pkm.errors import UserError


class OutputError(UserError, RuntimeError):
    """An output file could not be written."""


def temporary_name(path: Path) -> Path:
    """A temporary file name next to `path`, unique to this process and call."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def is_temporary(path: Path) -> bool:
    return Path(path).name.endswith(".tmp")


def write_error(path: Path, error: OSError) -> OutputError:
    kept = f"; the previous {Path(path).name} is kept" if Path(path).exists() else ""
    return OutputError(f"cannot write {path}: {error.strerror or error}{kept}")


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
    try:
        file = open(tmp, mode, **open_kwargs)
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
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a directory; give a file name")
    if path.exists() and not is_ours(path):
        raise OutputError(f"{option} {path}: exists and is not {ours}, which is all this command replaces; "
                          f"give another file name, or move that file away")


def check_writable(path: Path) -> None:
    """Raises OutputError now if a file cannot be written in `path`'s folder (missing or read-only folder,
    or a disk so full that not one byte fits), before hours of work. A disk with a little room left may
    still fill before the output is written: that write then fails with its own OutputError."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        try:
            with open(tmp, "wb", buffering=0) as f:  # unbuffered: closing writes nothing more
                f.write(b"\n")
                os.fsync(f.fileno())
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise write_error(path, e) from None
