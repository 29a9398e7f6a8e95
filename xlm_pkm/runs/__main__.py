"""List and compare training runs: python -m xlm_pkm.runs (or xlm-pkm-runs) list DIR... | compare RUN...

    python -m xlm_pkm.runs list dumped                    # every run under dumped/: id, status, step, best valid
                                                          # ppl, test ppl, what it was launched with
    python -m xlm_pkm.runs compare dumped/mine            # one table of every run under dumped/mine
    python -m xlm_pkm.runs compare dumped/a/1 dumped/b/1 --by model.memory.values --format csv

A RUN is a run directory (dump_path/exp_name/exp_id) or a folder holding runs. Status: running (a live process
holds the run), finished (it reached train.max_steps), stopped (a checkpoint to resume from), failed (ended
before its first checkpoint), or unreadable (a file of it cannot be read: the listing names it and goes on; compare
leaves that run out, saying so on stderr). The compare table: xlm_pkm/runs/table.py.
"""

from __future__ import annotations

import argparse
import sys

from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.runs.run_record import find_runs
from xlm_pkm.runs.table import Table, compare, launched_with, markdown, to_csv

PROG = "python -m xlm_pkm.runs"


def listing(runs) -> Table:
    """A row per run; a run whose files cannot be read is `unreadable`, the error naming the file in the last column."""
    rows = [[run.name, "unreadable", None, None, None, run.unreadable()] if run.unreadable() else
            [run.name, run.status, run.step, run.best_valid_ppl, (run.test or {}).get("ppl"),
             " ".join(launched_with(run))] for run in runs]
    header = ["id", "status", "step", "best valid ppl", "test ppl", "launched with (keys that differ from default)"]
    return Table(header, rows, {h: 1 for h in header})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    commands = parser.add_subparsers(dest="command", required=True)
    ls = commands.add_parser("list", help="the runs under a dump folder")
    ls.add_argument("dirs", nargs="+", metavar="DIR", help="dump folders (train.dump_path), experiments', or runs'")
    ls.add_argument("--format", choices=["markdown", "csv"], default="markdown")
    cmp = commands.add_parser("compare", help="one table of the runs given, or of every run under a folder")
    cmp.add_argument("runs", nargs="+", metavar="RUN", help="run directories, or folders holding runs")
    cmp.add_argument("--by", nargs="+", default=[], metavar="KEY",
                     help="a row per value of these config keys (default: a row per config, its seeds together)")
    cmp.add_argument("--format", choices=["markdown", "csv"], default="markdown")
    args = parser.parse_args(argv)
    paths = args.dirs if args.command == "list" else args.runs
    try:
        runs = find_runs(paths)
        if not runs:
            raise ValueError(f"no run (a config.yaml beside a metrics.jsonl or train.log) under {' '.join(paths)}")
        if args.command == "compare":
            for run in runs:
                if run.unreadable():
                    print(f"{PROG}: {run.name} left out: {run.unreadable()}", file=sys.stderr)
            runs = [run for run in runs if not run.unreadable()]
            if not runs:
                raise ValueError(f"no readable run under {' '.join(paths)}")
        table = listing(runs) if args.command == "list" else compare(runs, args.by)
    except (*USER_ERRORS, OSError) as e:
        return fail(PROG, e)
    print(markdown(table) if args.format == "markdown" else to_csv(table).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
