"""Run a study (cells × seeds × a learning-rate grid, each run on a budget of tokens), then report it.

    python -m xlm_pkm.experiments.study run STUDY.yaml [--streams N] [--only CELL...]   runs what is missing
    python -m xlm_pkm.experiments.study plan STUDY.yaml [--only CELL...]   every run, its state and command
    python -m xlm_pkm.experiments.study report STUDY.yaml [--bench FILE] writes the report (study_report.py)

The study file and its runs: study_plan.py. `run` trains, in N streams (processes side by side, one run
each), the first seed of every cell at every factor of its grid; once a cell's grid is trained it
chooses the cell's factor on valid perplexity, then trains the other seeds at that factor (and, under the
study's divergence rule, a diverged seed again at the next lower factor) before any other cell's grid run.
The test split is read only once every cell's settings are final (study_plan.Study.open_cells): then the
chosen runs (and with `robustness`, every seed at each cell's next lower factor) are evaluated on it;
before, a test evaluation is refused in one line naming the cells still open. A run already trained
(run.json in the results) is skipped, a test already evaluated (test.json) too; a run that was cut
resumes from its checkpoint.pt (train.py, same exp_id). So the same command, run again, finishes a study
cut anywhere, and gives the files an uninterrupted one gives. A trained run whose best.pt is gone from the dump
(another machine, a cleaned disk), or whose re-train there was cut, is trained again there by its own command
(resuming the cut one) before its test (retrain). Each run's small files are copied to the results folder as it
finishes (config.yaml and metrics.jsonl, then run.json with its commands, then test.json), ready to be
committed; checkpoints stay in the dump directory.
Each job's console goes to DUMP/<cell>/<run>.log. A run that fails is reported and the others go on; a run
stopped by a signal (exit 75 or 130) stops the study (no new run starts; rerun to resume). A run trained
before the study file changed is stale (study_plan.py): `plan` shows it, `run` and `report` refuse until it is
moved away. A test read with another test_max_batches than the study's now is stale too: `run` reads it again,
`report` refuses until then. Exit status: 0 when nothing is left to run, 1 when a run failed, 75 when stopped,
2 on a bad study file or a stale run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xlm_pkm.errors import EXIT_INTERRUPTED, EXIT_STOPPED, USER_ERRORS, fail
from xlm_pkm.experiments.reproduce import REPO, git_commit
from xlm_pkm.experiments.study_plan import LR_KEYS, Study, StudyError, StudyRun, load_study
from xlm_pkm.experiments.study_report import change_text, write_report
from xlm_pkm.utils.atomic import write_bytes, write_text

TRAIN, TEST = "train", "test"


@dataclass(frozen=True)
class Job:
    kind: str  # TRAIN or TEST
    run: StudyRun

    @property
    def name(self) -> str:
        return f"{self.run.cell}/{self.run.id} {self.kind}"


def pending(study: Study, whole: Study | None = None) -> list[Job]:
    """What may be done now: first the other seeds of the cells already chosen (a cell's choice exists once its
    grid is trained; a diverged seed's re-run too), then the grids' runs, then the robustness runs; the tests
    only once `whole` (the study `study` is a part of; itself by default) has no open cell. A test whose best.pt is
    in the dump from a finished run comes before any training (it takes seconds, and a checkpoint lost with the dump
    costs a whole re-train), a test whose best.pt is gone or from a cut re-train after it (retrain)."""
    chosen = [r for cell in study.cells for r in study.chosen_runs(cell)]
    neighbours = [r for cell in study.cells for r in study.robustness_runs(cell)]
    jobs = [Job(TRAIN, r) for r in chosen if not r.trained]
    jobs += [Job(TRAIN, r) for cell in study.cells for r in study.grid_runs(cell) if not r.trained]
    jobs += [Job(TRAIN, r) for r in neighbours if not r.trained]
    if (whole or study).open_cells():
        return jobs
    tests = [r for r in chosen + neighbours if r.trained and not r.tested]
    at_hand = [r.evaluable for r in tests]
    return [Job(TEST, r) for r, ok in zip(tests, at_hand) if ok] + jobs + [
        Job(TEST, r) for r, ok in zip(tests, at_hand) if not ok]


def withheld(study: Study) -> int:
    """The test evaluations waiting for the study's settings to be final (trained runs not yet tested)."""
    runs = [r for cell in study.cells for r in (*study.chosen_runs(cell), *study.robustness_runs(cell))]
    return sum(r.trained and not r.tested for r in runs)


def launch_process(job: Job) -> int:
    """Runs the job's command as a process from the repository root, its console to DUMP/<cell>/<run>.log."""
    run = job.run
    argv = run.train_command() if job.kind == TRAIN else run.evaluate_command()
    argv = [sys.executable, *(["-m", "torch.distributed.run"] if argv[0] == "torchrun" else []), *argv[1:]]
    log = run.run.run_dir.parent / f"{run.id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        return subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode


def collect(job: Job) -> None:
    """Copies a finished job's small files to the results folder, each written whole (utils/atomic.py);
    run.json last: the run is trained."""
    run, source = job.run, job.run.run.run_dir
    run.results.mkdir(parents=True, exist_ok=True)
    if job.kind == TEST:  # with the test_max_batches it was read with: a test read with another one is stale
        try:
            test = json.loads((source / "test.json").read_text())
        except (OSError, ValueError) as e:
            raise StudyError(f"{source / 'test.json'}: not a readable test result ({e})") from None
        test["max_batches"] = run.run.test_max_batches
        write_text(run.results / "test.json", json.dumps(test, indent=2) + "\n")
        return
    for name in ("config.yaml", "metrics.jsonl"):
        write_bytes(run.results / name, (source / name).read_bytes())
    lrs = {k: float(o.split("=", 1)[1]) for o in run.run.overrides for k in LR_KEYS if o.startswith(f"optim.{k}=")}
    info = {"cell": run.cell, "config": run.run.config, "lr_factor": run.factor, "seed": run.seed, "steps": run.steps,
            "tokens_per_step": run.tokens_per_step, "tokens": run.steps * run.tokens_per_step, "lr": lrs,
            "commit": git_commit(),
            "commands": {"train": shlex.join(run.train_command()), "test": shlex.join(run.evaluate_command())}}
    write_text(run.results / "run.json", json.dumps(info, indent=2) + "\n")


def retrain(run: StudyRun, launch: Callable[[Job], int]) -> int:
    """Trains again, into the dump, a trained run whose checkpoint is gone or from a cut re-train, by its own
    command (same seed; it resumes the cut one), so that its test can be read. The results keep the first run's
    files, which the lr choice read; the second's config.yaml and metrics.jsonl go to run.retrained, and the report
    sets the two runs' best valid perplexity side by side. Returns the train job's exit status."""
    why = "is from a re-train cut before its last step" if run.checkpoint.is_file() else "is gone"
    print(f"{run.cell}/{run.id}: {run.checkpoint} {why}; training the run again into the dump (its results keep "
          f"the first run's files)", flush=True)
    status = launch(Job(TRAIN, run))
    if status == 0 and not run.evaluable:
        print(f"{run.cell}/{run.id}: trained again but no {run.checkpoint} (a finished checkpoint.pt left in its run "
              f"directory resumes to nothing: move that directory away)", file=sys.stderr)
        return 1
    if status == 0:
        run.retrained.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "metrics.jsonl"):
            write_bytes(run.retrained / name, (run.run.run_dir / name).read_bytes())
        first, second = run.valid_ppl(), run.valid_ppl(run.retrained)
        print(f"{run.cell}/{run.id}: trained again, best valid perplexity {second:.2f} against the first run's "
              f"{first:.2f} ({change_text(first, second)})", flush=True)
    return status


def run_study(study: Study, streams: int = 1, launch: Callable[[Job], int] = launch_process,
              whole: Study | None = None) -> int:
    """Runs every pending job, `streams` at a time (one: here, in this thread); see the module docstring. `whole`:
    the study `study` is a part of (`--only`), whose open cells withhold the tests. A stale run (Study.stale_runs)
    is refused before any job starts."""
    if streams < 1:
        raise StudyError(f"--streams {streams}: the number of runs side by side, at least 1")
    study.refuse_stale()
    failed, stopped, running = set(), False, {}
    whole = whole or study

    def execute(job: Job) -> int:
        if job.kind == TEST:
            whole.test_guard()
            if job.run.test_stale:
                print(f"{job.name}: its test.json was read with test_max_batches {job.run.test_read_with()}, the "
                      f"study's is {job.run.run.test_max_batches} now: reading it again", flush=True)
        start = time.time()
        status = retrain(job.run, launch) if job.kind == TEST and not job.run.evaluable else 0
        if status == 0:
            status = launch(job)
        if status == 0:
            collect(job)
        print(f"{job.name}: {'done' if status == 0 else f'exit {status}'} ({(time.time() - start) / 60:.1f} min)",
              flush=True)
        return status

    with ThreadPoolExecutor(max(1, streams)) as pool:
        while True:
            if not stopped:
                for job in pending(study, whole):
                    if len(running) >= streams:
                        break
                    if job.name in failed or job.name in running:
                        continue
                    print(f"{job.name}: started", flush=True)
                    if streams == 1:
                        running[job.name] = Future()
                        running[job.name].set_result(execute(job))
                    else:
                        running[job.name] = pool.submit(execute, job)
            if not running:
                break
            done, _ = wait(running.values(), return_when=FIRST_COMPLETED)
            for name in [n for n, f in running.items() if f in done]:
                status = running.pop(name).result()
                stopped |= status in (EXIT_STOPPED, EXIT_INTERRUPTED)
                if status and status not in (EXIT_STOPPED, EXIT_INTERRUPTED):
                    failed.add(name)
    if stopped:
        print(f"study {study.name}: stopped; run the same command again to resume", flush=True)
        return EXIT_STOPPED
    if failed:
        print(f"study {study.name}: {len(failed)} job(s) failed: {', '.join(sorted(failed))}", file=sys.stderr)
        return 1
    if withheld(study):
        try:
            whole.test_guard()
        except StudyError as e:
            print(f"{e} ({withheld(study)} test evaluation(s) wait)", file=sys.stderr)
            return 0
    print(f"study {study.name}: every run is done", flush=True)
    return 0


def describe(study: Study, whole: Study | None = None) -> list[str]:
    """One line per run known now (grids, the chosen factors' seeds and their divergence re-runs, the robustness
    runs): cell, run, state, steps, command, and for a stale run what differs; last, whether the test split may be
    read (for `whole`, the study `study` is a part of: itself by default)."""
    lines, stale = [], dict((r.results, changes) for r, changes in study.stale_runs())
    for cell in study.cells:
        choice = study.choice(cell)
        lines.append(f"{cell}: " + (f"lr ×{choice.factor:g} chosen" + (f" (at the {choice.edge} end of the grid)"
                                                                       if choice.edge else "")
                                    if choice else "lr not chosen yet (the first seed's grid is not trained)"))
        rerun = {r.id: f"; diverged ({study.diverged(r)}): re-run at ×{later.factor:g}"
                 for chain in study.seed_runs(cell).values() for r, later in zip(chain, chain[1:])}
        for r in study.known_runs(cell):
            state = "stale" if r.results in stale else "tested" if r.tested else \
                "trained, test stale" if r.trained and r.test_stale else "trained" if r.trained else \
                "partial" if (r.run.run_dir / "checkpoint.pt").exists() else "new"
            state += ", trained again" if r.retrained.is_dir() else ""
            lines.append(f"  {r.id} [{state}{rerun.get(r.id, '')}] {r.steps} steps × {r.tokens_per_step} tokens: "
                         f"{shlex.join(r.train_command())}")
            if r.results in stale:
                lines.append(f"    trained with another config than the study's now: {'; '.join(stale[r.results])}")
            elif r.trained and r.test_stale:
                lines.append(f"    its test was read with test_max_batches {r.test_read_with()}, the study's is "
                             f"{study.test_max_batches} now: `run` reads it again")
    if stale:
        lines.append(f"{len(stale)} stale run(s): move away their results and run directories (e.g. "
                     f"{next(iter(stale))}) to train them again, or restore the study file")
    still = (whole or study).open_cells()
    lines.append("test split: " + ("may be read (every cell's settings are final)" if not still else
                                   "not before every cell's settings are final; still open: "
                                   + "; ".join(f"{c} ({why})" for c, why in still.items())))
    return lines


def read_bench(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StudyError(f"--bench {path}: not a readable benchmark JSON ({e})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.study", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "plan", "report"])
    parser.add_argument("study", help="the study's YAML file")
    parser.add_argument("--streams", type=int, default=1, help="runs side by side (run)")
    parser.add_argument("--only", nargs="+", default=[], metavar="CELL", help="these cells only (run, plan)")
    parser.add_argument("--bench", nargs="*", default=[], help="speed benchmark JSON with rows per cell (report)")
    args = parser.parse_args(argv)
    try:
        study = whole = load_study(args.study)
        if args.only and args.command != "report":
            study = study.only(args.only)
        if args.command == "plan":
            print("\n".join(describe(study, whole)))
            return 0
        if args.command == "report":
            study.refuse_stale()
            benches = [read_bench(Path(b)) for b in args.bench]
            print(f"wrote {write_report(study, benches)}")
            return 0
        return run_study(study, args.streams, whole=whole)
    except USER_ERRORS as e:
        return fail("study", e)
    except KeyboardInterrupt:  # the runs got the Ctrl-C too: each saved a checkpoint and stopped
        print("study: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
