"""The fastBPE tools: the command-line binary (learnbpe, getvocab, applybpe) and the Python binding.

The binary is found by `find_fastbpe()`: the FASTBPE environment variable, then
`<repo>/tools/fastbpe/fast` (built by `make install`), then `fast` or `fastbpe` on PATH.
fastBPE aborts on a malformed codes file, so `check_codes` validates one first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class FastBPEError(RuntimeError):
    """fastBPE is missing, failed, or was given a malformed codes file."""


def find_fastbpe() -> str:
    """Path of the fastBPE command-line tool."""
    candidates = [os.environ.get("FASTBPE"), str(REPO_ROOT / "tools" / "fastbpe" / "fast")]
    candidates += [shutil.which(name) for name in ("fast", "fastbpe")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FastBPEError("fastBPE command-line tool not found: run `make install` or set FASTBPE=/path/to/fast")


def _run_on_stream(args: list[str], inputs: list[Path], output: Path) -> None:
    """Run `fast ARGS -` with the concatenation of `inputs` on stdin and stdout written to `output`."""
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "wb") as out:
        proc = subprocess.Popen([find_fastbpe(), *args, "-"], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.PIPE)
        try:
            for path in inputs:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, proc.stdin, 1 << 20)
        except BrokenPipeError:
            pass
        proc.stdin.close()
        stderr = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            last = stderr.strip().splitlines()[-1:] or ["no message"]
            raise FastBPEError(f"fastBPE {args[0]} failed writing {output}: {last[0]}")
    os.replace(tmp, output)


def learn_codes(n_codes: int, inputs: list[Path], output: Path) -> None:
    """`fast learnbpe n_codes` on the concatenated tokenized text; codes file written atomically."""
    _run_on_stream(["learnbpe", str(n_codes)], inputs, output)


def get_vocab(inputs: list[Path], output: Path) -> None:
    """`fast getvocab` on the concatenated BPE text: `word count` lines, count-descending."""
    _run_on_stream(["getvocab"], inputs, output)


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
                    raise FastBPEError(f"malformed codes file {path}, line {n}: expected `left right count`, got {line.strip()!r}")
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
