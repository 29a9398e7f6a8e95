"""Output files written whole or not at all: shards, plans, checkpoints, metrics, JSON results.

Every output is first written to `NAME.PID.TOKEN.tmp` (pid and random token: two processes never
share a temporary file), then renamed to NAME; on any error the temporary file is removed and the
previous NAME, if any, is left as it was. A write that fails (disk full, read-only directory) raises
`OutputError`, one line naming NAME (and saying that its previous version is kept).
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
    """A file whose failed writes raise OutputError naming the final path."""

    def __init__(self, file, path: Path):
        self._file, self._path = file, path

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as e:
            raise write_error(self._path, e) from None

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextmanager
def atomic_file(path: Path, mode: str = "wb", **open_kwargs):
    """Open a temporary file for `path`; on success flush it to disk and rename it to `path`.
    Errors raised by the body (another file's OutputError, a read error) pass through unchanged.

        with atomic_file(out / "meta.json", "w") as f:
            f.write(text)
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        file = open(tmp, mode, **open_kwargs)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        with file:
            yield _Output(file, path)
            try:
                file.flush()
                os.fsync(file.fileno())
            except OSError as e:
                raise write_error(path, e) from None
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


def check_writable(path: Path) -> None:
    """Raises OutputError now if a file cannot be created in `path`'s folder (before hours of work)."""
    path = Path(path)
    try:
        tmp = temporary_name(path)
        tmp.touch()
        tmp.unlink()
    except OSError as e:
        raise write_error(path, e) from None
