"""results/lib/finetune_study.sh's `run`: what a re-run of a study does with each run it finds."""
import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "results" / "lib" / "finetune_study.sh"


def run_once(tmp_path: Path, name: str) -> str:
    """`run NAME` with a command that records its call and the run directory it found; returns the record."""
    script = f"""set -euo pipefail
DUMP={tmp_path}/dump OUT={tmp_path} JOBS=1
mkdir -p "$DUMP/done" "$DUMP/logs"
source {LIB}
record() {{ echo "ran; found: $(ls "$DUMP/{name}/run" 2>/dev/null | tr '\\n' ' ')" >> {tmp_path}/record; }}
run {name} record
"""
    subprocess.run(["bash", "-c", script], check=True)
    return (tmp_path / "record").read_text() if (tmp_path / "record").exists() else ""


def test_a_run_stopped_before_its_first_checkpoint_starts_over(tmp_path):
    run_dir = tmp_path / "dump" / "ft" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text("stopped at step 300\n")
    assert run_once(tmp_path, "ft") == "ran; found: \n"
    assert not run_dir.exists()


def test_a_run_with_a_checkpoint_is_left_to_resume(tmp_path):
    run_dir = tmp_path / "dump" / "ft" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").write_bytes(b"step 300")
    (run_dir / "train.log").write_text("stopped at step 300\n")
    assert run_once(tmp_path, "ft") == "ran; found: checkpoint.pt train.log \n"
    assert (tmp_path / "dump" / "done" / "ft").exists()


def test_a_finished_run_is_not_run_again(tmp_path):
    (tmp_path / "dump" / "done").mkdir(parents=True)
    (tmp_path / "dump" / "done" / "ft").touch()
    assert run_once(tmp_path, "ft") == ""


def test_a_run_that_ran_is_timed_and_one_done_before_is_not(tmp_path):
    (tmp_path / "dump" / "done").mkdir(parents=True)
    (tmp_path / "dump" / "done" / "old").touch()
    run_once(tmp_path, "old")
    assert not (tmp_path / "times.tsv").exists()
    run_once(tmp_path, "ft")
    run_once(tmp_path, "ft")  # done now: not timed again
    header, row = (tmp_path / "times.tsv").read_text().splitlines()
    assert header.split("\t") == ["name", "seconds", "threads", "ended"]
    name, seconds, threads, ended = row.split("\t")
    assert (name, threads) == ("ft", "2") and 0 <= int(seconds) < 60 and ended.endswith("Z")
