"""The table of `runs compare`: one row per config (its seeds together) or per value of the --by keys.

Columns: the runs of the row, the config keys that differ between the rows (or the --by keys), the seeds, total
and active parameters (active: the dense ones plus the value and Engram rows a token reads; sizes.py), the best
valid perplexity, the test perplexity, each memory's usage (%) and KL on test (on the last validation without a
test result), and the training tokens/s of the run's own train lines (their median). A row of several runs shows
the mean ± sd (sample standard deviation) over those that have the number. Rendered as markdown (numbers as
text) or CSV (numbers, a `<column> sd` column beside each that can have one).
"""

from __future__ import annotations

import csv
import functools
import io
import math
from dataclasses import dataclass

from xlm_pkm.config import DEFAULT_CONFIG, flat, load_config, to_dict
from xlm_pkm.runs.run_record import RunRecord
from xlm_pkm.runs.sizes import count_text, model_size

# Where a run is and which seed it drew: never what makes two configs differ
IDENTITY = ("train.exp_id", "train.exp_name", "train.dump_path")
SEED = "train.seed"


@dataclass(frozen=True)
class Measure:
    """One number of a row over its runs: the mean, and the sample standard deviation (0 for one run)."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def sd(self) -> float:
        n = len(self.values)
        return math.sqrt(sum((v - self.mean) ** 2 for v in self.values) / (n - 1)) if n > 1 else 0.0

    def text(self, digits: int = 1) -> str:
        return f"{self.mean:,.{digits}f}" + (f" ± {self.sd:.{digits}f}" if len(self.values) > 1 else "")


def measure(values) -> Measure | None:
    """The Measure of the values that are not None; None when none is."""
    present = tuple(v for v in values if v is not None)
    return Measure(present) if present else None


def flat_config(run: RunRecord) -> dict:
    """The run's resolved config as {dotted.key: value}, in today's keys."""
    return flat(to_dict(run.config))


@functools.cache
def default_config() -> dict:
    """configs/default.yaml, resolved, as {dotted.key: value}."""
    return flat(to_dict(load_config(DEFAULT_CONFIG)))


def launched_with(run: RunRecord) -> list[str]:
    """`key=value` for each key where the run's config differs from configs/default.yaml (where it is and the
    vocabulary size it read from its data left out): what it was started with, --config file and overrides."""
    default, own = default_config(), flat_config(run)
    return [f"{key}={value}" for key, value in own.items()
            if key not in (*IDENTITY, "model.vocab_size") and default.get(key) != value]


def differing_keys(configs: list[dict]) -> list[str]:
    """The keys whose value is not the same in every config, but where a run is and its seed."""
    keys = dict.fromkeys(k for c in configs for k in c)
    return [k for k in keys if k not in (*IDENTITY, SEED) and len({repr(c.get(k)) for c in configs}) > 1]


def memory_results(run: RunRecord) -> dict[int, dict]:
    """{layer: {"usage", "kl"}} of the run's test result, else of its last validation."""
    valid = run.logged("valid")
    result = run.test or (valid[-1] if valid else {})
    return {m["layer"]: m for m in result.get("memories", [])}


@dataclass
class Table:
    header: list[str]
    rows: list[list]  # str, int, float, Measure or None
    digits: dict[str, int]  # a float or Measure column's decimals in markdown


def summary(members: list[RunRecord]) -> dict:
    """The numbers of one row, over `members` (runs of one config, or of one --by value): total and active
    parameters of the first one's model, then Measures: best valid ppl, test ppl, each memory's usage % and KL
    (columns "usage % L<layer>", "KL L<layer>"), tokens/s."""
    cfg = members[0].config
    size = model_size(cfg, cfg.data.bptt)
    memories = [memory_results(run) for run in members]
    layers = sorted({layer for m in memories for layer in m})
    per_memory = {f"{column} L{layer}": measure(m.get(layer, {}).get(what) for m in memories)
                  for layer in layers for column, what in (("usage %", "usage"), ("KL", "kl"))}
    return {"params": int(size["total"]), "active params": int(size["active"]),
            "valid ppl": measure(run.best_valid_ppl for run in members),
            "test ppl": measure((run.test or {}).get("ppl") for run in members),
            **per_memory, "tokens/s": measure(run.tokens_per_sec for run in members)}


def compare(runs: list[RunRecord], by: list[str] = ()) -> Table:
    """The table of `runs`: a row per distinct config (seeds together) or, with `by`, per value of those keys."""
    configs = {run.path: flat_config(run) for run in runs}
    unknown = sorted({k for k in by if all(k not in c for c in configs.values())})
    if unknown:
        raise ValueError(f"--by {' '.join(unknown)}: not a config key of these runs (keys are dotted, e.g. "
                         f"model.memory.n_keys)")
    keys = list(by) or differing_keys(list(configs.values()))
    groups: dict[str, list[RunRecord]] = {}
    for run in runs:
        config = configs[run.path]
        ident = [(k, config.get(k)) for k in keys] if by else sorted(
            (k, repr(v)) for k, v in config.items() if k not in (*IDENTITY, SEED))
        groups.setdefault(repr(ident), []).append(run)
    numbers = [summary(members) for members in groups.values()]
    layers = sorted({int(c.rsplit("L", 1)[1]) for row in numbers for c in row if c.startswith("KL L")})
    columns = ["params", "active params", "valid ppl", "test ppl",
               *[f"{what} L{layer}" for layer in layers for what in ("usage %", "KL")], "tokens/s"]
    rows = [[" ".join(run.name for run in members), *[configs[members[0].path].get(k) for k in keys],
             " ".join(str(configs[run.path].get(SEED)) for run in members), *[row.get(c) for c in columns]]
            for members, row in zip(groups.values(), numbers)]
    header = ["runs", *keys, "seeds", *columns]
    digits = {h: 2 if h.startswith("KL") else 0 if h == "tokens/s" else 1 for h in header}
    return Table(header, rows, digits)


def markdown(table: Table) -> str:
    def cell(header: str, value) -> str:
        if value is None:
            return "-"
        if isinstance(value, Measure):
            return value.text(table.digits[header])
        if isinstance(value, float):
            return f"{value:,.{table.digits[header]}f}"
        if header in ("params", "active params"):
            return count_text(value)
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    return "\n".join(lines + ["| " + " | ".join(cell(h, v) for h, v in zip(table.header, row)) + " |"
                              for row in table.rows])


def to_csv(table: Table) -> str:
    """Numbers as numbers: a Measure column gives its mean, and `<column> sd` beside it."""
    measured = [i for i, h in enumerate(table.header) if any(isinstance(row[i], Measure) for row in table.rows)]
    header = [name for i, h in enumerate(table.header) for name in ([h, f"{h} sd"] if i in measured else [h])]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in table.rows:
        cells = []
        for i, value in enumerate(row):
            if i in measured:
                cells += ["", ""] if value is None else [repr(value.mean), repr(value.sd)]
            else:
                cells.append("" if value is None else value)
        writer.writerow(cells)
    return out.getvalue()
