"""The fastBPE tools: the command-line binary (learnbpe, getvocab, applybpe) and the Python binding.

The binary is found by `find_fastbpe()`: the FASTBPE environment variable, then
`<repo>/tools/fastbpe/fast` (built by `make install`), then `fast` or `fastbpe` on PATH.
fastBPE aborts on a malformed codes file, so `check_codes` validates one first.

When asked for more merges than the corpus allows, `fast learnbpe` pads its output with `a b 0` lines
(the last pair repeated, count 0: a malformed file); `learn_codes` keeps the merges before the first
count-0 line and says how many the corpus allowed. Outputs are read from fastBPE's standard output
and written by Python (xlm_pkm/utils/atomic.py), so a full disk is an error, never a truncated file.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from xlm_pkm.errors import UserError
from xlm_pkm.utils.atomic import atomic_file

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


class FastBPEError(UserError, RuntimeError):
    """fastBPE is missing, failed, or was given a malformed codes file."""


def find_fastbpe() -> str:
    """Path of the fastBPE command-line tool."""
    candidates = [os.environ.get("FASTBPE"), str(REPO_ROOT / "tools" / "fastbpe" / "fast")]
    candidates += [shutil.which(name) for name in ("fast", "fastbpe")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FastBPEError("fastBPE command-line tool not found: run `make install` or set FASTBPE=/path/to/fast")


def _run_on_stream(args: list[str], inputs: list[Path], output: Path) -> bytes:
    """Standard output of `fast ARGS -` with the concatenation of `inputs` on stdin (`output` names the
    file being made, for the error message). learnbpe and getvocab read all their input before writing."""
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([find_fastbpe(), *args, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr)
        try:
            for path in inputs:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, proc.stdin, 1 << 20)
        except BrokenPipeError:
            pass
        proc.stdin.close()
        result = proc.stdout.read()
        status = proc.wait()
        if status != 0:
            stderr.seek(0)
            said = stderr.read().decode(errors="replace").strip()
            if status == -signal.SIGKILL or "bad_alloc" in said or "Cannot allocate memory" in said:
                raise FastBPEError(f"fastBPE {args[0]} ran out of memory making {output} (" + (
                    "killed: SIGKILL, the kernel's out-of-memory killer" if status == -signal.SIGKILL else
                    "std::bad_alloc") + "): raise the process's memory limit, or learn the codes on a part of "
                    "the corpus and give them with --codes")
            last = said.splitlines()[-1:] or [f"exit status {status}"]
            raise FastBPEError(f"fastBPE {args[0]} failed making {output}: {last[0]}")
    return result


def learn_codes(n_codes: int, inputs: list[Path], output: Path) -> int:
    """`fast learnbpe n_codes` on the concatenated tokenized text, stopped at the last merge the corpus
    allows; codes file written atomically. Returns the number of codes."""
    lines = _run_on_stream(["learnbpe", str(n_codes)], inputs, output).splitlines(keepends=True)
    n = next((i for i, line in enumerate(lines) if line.split()[2:3] == [b"0"]), len(lines))
    if n == 0:
        raise FastBPEError(f"the corpus allows no BPE merge: cannot write {output} (is the training text empty?)")
    if n < n_codes:
        log.warning("the corpus allows only %d BPE merges (%d requested): %s has %d codes", n, n_codes, output, n)
    with atomic_file(output) as f:
        f.write(b"".join(lines[:n]))
    try:
        check_codes(output)
    except FastBPEError:
        output.unlink()  # never keep a bad codes file: the next run would fail on it again
        raise
    return n


def get_vocab(inputs: list[Path], output: Path) -> None:
    """`fast getvocab` on the concatenated BPE text: `word count` lines, count-descending."""
    with atomic_file(output) as f:
        f.write(_run_on_stream(["getvocab"], inputs, output))


def check_codes(path: Path) -> int:
    """Validate a fastBPE codes file (`left right count` lines, no duplicate pair); return its size."""
    if not path.is_file():
        raise FastBPEError(f"codes file not found: {path}")
    pairs = set()
    with open(path, encoding="utf-8", errors="strict", newline="\n") as f:
        try:
            for n, line in enumerate(f, 1):
                fields = line.rstrip("\n").split(" ")
                if len(fields) != 3 or not all(fields) or not fields[2].isdigit():
                    raise FastBPEError(f"malformed codes file {path}, line {n}: expected `left right count`, "
                                       f"got {line.strip()!r}")
                if (fields[0], fields[1]) in pairs:
                    raise FastBPEError(f"malformed codes file {path}, line {n}: duplicate pair {fields[0]} {fields[1]}")
                pairs.add((fields[0], fields[1]))
        except UnicodeDecodeError as e:
            raise FastBPEError(f"malformed codes file {path}: not UTF-8 ({e.reason})") from None
    if not pairs:
        raise FastBPEError(f"malformed codes file {path}: empty")
    return len(pairs)


@contextmanager
def _quiet_stderr():
    """Silence the C++ binding's progress lines on file descriptor 2."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def bpe_applier(codes: Path, vocab: Path | None = None):
    """fastBPE's Python binding: `.apply(lines)` gives the same text as `fast applybpe`."""
    import fastBPE

    with _quiet_stderr():
        return fastBPE.fastBPE(str(codes), str(vocab) if vocab else "")
