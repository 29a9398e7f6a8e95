"""Where a model's gain lies: per-token test loss of trained checkpoints on the tokens whose N-gram is frequent
in the training split against the rest (e.g. Engram's, whose tables are addressed by the last N tokens).

    python -m xlm_pkm.experiments.ngram_gain --json OUT.json [--n 3] [--frequent 100] [--max-batches 0] \\
        [--data DIR] [--bptt 0] [--batch-size 0] [--device cpu] \\
        --run pkm=dumped/variants/ablation_base/tiny-seed0,dumped/variants/ablation_base/tiny-seed1/best.pt \\
        --run engram=dumped/variants/engram/tiny-seed0 --run engram=dumped/variants/engram/tiny-seed1

`--run LABEL=CKPT[,CKPT...]` (repeatable; a repeated LABEL adds its checkpoints; a run directory stands for
its best.pt) names a model and its checkpoints, one per seed; the first LABEL is the reference. Each
checkpoint is evaluated in fp32 on the test split of its own data (its data.path, or --data; its data.bptt
and evaluation batch size, or --bptt and --batch-size): the NLL of every predicted token, as evaluate.py
sums it. Every checkpoint must read the same test tokens (else a one-line error).

Buckets of a predicted token: its N-gram is the N-1 tokens before it in its bptt window, then itself (the
window is what the model sees; an N-gram may cross a document's `<s>`, as the training stream's do).
  frequent  the N-gram occurs at least --frequent times in the training split (its shards concatenated in
            order, as TokenStream reads them; every window of N consecutive tokens counted)
  rare      less often (unseen included)
  short     the window holds fewer than N-1 tokens before it (its first N-2 positions): not bucketed
  all       every predicted token (its mean is the checkpoint's test loss)

Writes JSON {n, frequent, reference, train_tokens, buckets: {bucket: tokens}, labels: {label: {checkpoints,
buckets: {bucket: {tokens, nll, sd, runs, diff, spread}}}}}: nll the mean over the label's checkpoints of
their mean NLL (nats) in the bucket, sd its standard deviation over them (0 for one), runs each checkpoint's,
diff nll minus the reference's, spread sd plus the reference's sd (the report's noise rule: a gap beyond the
spread is beyond the seeds' noise); an empty bucket has only tokens (0) and nll (null). Prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.meta import check_split
from xlm_pkm.data.shard import read_shard
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.experiments.report import Measure
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.train.build import build_stream
from xlm_pkm.utils.atomic import holds_json_with, refuse_foreign_file, write_text

PROGRAM = "python -m xlm_pkm.experiments.ngram_gain"
BUCKETS = ("frequent", "rare", "short")  # the bucket indices of bucket_of; "all" is added to every table
FREQUENT, RARE, SHORT = range(3)


def split_tokens(data_dir: str | Path, split: str = "train") -> np.ndarray:
    """The split's token stream (its shards concatenated in order), int64 (N,)."""
    fingerprint = Dictionary.load(Path(data_dir) / "vocab").fingerprint()
    shards = [read_shard(path, fingerprint, verify=True).tokens for path, _ in check_split(data_dir, split)]
    return np.concatenate(shards).astype(np.int64)


def ngram_codes(rows: np.ndarray) -> np.ndarray:
    """rows (M, n) of token ids -> (M,) int64 in [0, M), equal where the rows are: each prefix ranked among the
    rows' prefixes, one column at a time (exact: a rank times (max id + 1) stays below M · 2^32)."""
    codes = np.zeros(len(rows), dtype=np.int64)
    base = int(rows.max()) + 1
    for j in range(rows.shape[1]):
        codes = np.unique(codes * base + rows[:, j], return_inverse=True)[1].reshape(-1)
    return codes


def train_counts(train: np.ndarray, grams: np.ndarray) -> np.ndarray:
    """(Q,) how often each N-gram of grams (Q, n) occurs in the stream `train` (N,), every window counted."""
    windows = np.lib.stride_tricks.sliding_window_view(train, grams.shape[1])  # (N - n + 1, n)
    codes = ngram_codes(np.concatenate([windows, grams]))
    counts = np.bincount(codes[:len(windows)], minlength=int(codes.max()) + 1)
    return counts[codes[len(windows):]]


def bucket_of(grams: np.ndarray, train: np.ndarray, frequent: int) -> np.ndarray:
    """(M,) FREQUENT, RARE or SHORT of each token's N-gram in grams (M, n) (-1s: SHORT)."""
    buckets = np.full(len(grams), SHORT)
    whole = grams[:, 0] >= 0
    buckets[whole] = np.where(train_counts(train, grams[whole]) >= frequent, FREQUENT, RARE)
    return buckets


@torch.no_grad()
def token_losses(model, stream, n: int, max_batches: int = 0,
                 device: torch.device = torch.device("cpu")) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass over the first `max_batches` batches of `stream` (0: all): (nll (M,) float64 of each predicted
    token, its id (M,), its N-gram (M, n): the n-1 tokens before it in its window then it, -1s where the
    window holds fewer), tokens in batch order."""
    model.eval().reset_stream_state(training=False)
    stream.rewind()
    nll, targets, grams = [], [], []
    for i, (x, y) in enumerate(stream):
        if max_batches and i >= max_batches:
            break
        nll.append(model(x.to(device), targets=y.to(device)).double().cpu().numpy().reshape(-1))  # (B·T,)
        window = torch.cat([x[:, :1], y], 1).numpy()  # (B, T+1): target t is window[:, t + 1]
        T, short = y.shape[1], min(max(n - 2, 0), y.shape[1])
        g = np.full((*y.shape, n), -1, dtype=np.int64)  # (B, T, n)
        if T > short:  # the N-gram ending at target t is window[:, t + 2 - n: t + 2]
            g[:, short:] = np.lib.stride_tricks.sliding_window_view(window, n, axis=1)[:, -(T - short):]
        grams.append(g.reshape(-1, n))
        targets.append(y.numpy().reshape(-1))
    return np.concatenate(nll), np.concatenate(targets), np.concatenate(grams)


def bucket_means(nll: np.ndarray, buckets: np.ndarray) -> dict[str, float | None]:
    """{bucket: mean NLL of its tokens (None: none)}, "all" last."""
    means = {name: float(nll[buckets == k].mean()) if (buckets == k).any() else None for k, name in enumerate(BUCKETS)}
    return {**means, "all": float(nll.mean())}


def compare(runs: dict[str, list[Path]], n: int = 3, frequent: int = 100, max_batches: int = 0,
            data: str | None = None, bptt: int = 0, batch_size: int = 0,
            device: torch.device = torch.device("cpu")) -> dict:
    """The JSON of the module's docstring for {label: checkpoints}, the first label the reference."""
    if n < 1 or frequent < 1:
        raise ValueError(f"--n and --frequent must be at least 1, got {n} and {frequent}")
    env, first, means = DistEnv(), None, {label: [] for label in runs}
    for label, paths in runs.items():
        for path in paths:
            trained = load_trained(path, data, env)
            data_dir = trained.data_dir
            stream = build_stream(trained.cfg, "test", env, str(data_dir), batch_size, bptt)
            nll, targets, grams = token_losses(trained.model.to(device), stream, n, max_batches, device)
            if first is None:
                train = split_tokens(data_dir)
                first = {"path": path, "data": data_dir.resolve(), "targets": targets, "grams": grams,
                         "train": len(train), "buckets": bucket_of(grams, train, frequent)}
            elif not (data_dir.resolve() == first["data"] and np.array_equal(targets, first["targets"])
                      and np.array_equal(grams, first["grams"])):
                raise ValueError(f"{path} reads other test tokens than {first['path']} (another data.path, data.bptt "
                                 f"or evaluation batch size: set --data, --bptt and --batch-size)")
            means[label].append(bucket_means(nll, first["buckets"]))
    tokens = {**{name: int((first["buckets"] == k).sum()) for k, name in enumerate(BUCKETS)},
              "all": len(first["buckets"])}
    measures = {label: {b: Measure(tuple(m[b] for m in ms)) for b in tokens if tokens[b]}
                for label, ms in means.items()}
    reference = next(iter(runs))
    labels = {label: {"checkpoints": [str(p) for p in runs[label]],
                      "buckets": {b: _summary(tokens[b], measures[label].get(b), measures[reference].get(b))
                                  for b in tokens}}
              for label in runs}
    return {"n": n, "frequent": frequent, "max_batches": max_batches, "reference": reference,
            "data": str(first["data"]), "train_tokens": first["train"], "buckets": tokens, "labels": labels}


def _summary(tokens: int, m: Measure | None, ref: Measure | None) -> dict:
    """One label's bucket against the reference's (m None: an empty bucket)."""
    if m is None:
        return {"tokens": tokens, "nll": None}
    return {"tokens": tokens, "nll": m.mean, "sd": m.sd, "runs": list(m.values), "diff": m.mean - ref.mean,
            "spread": m.sd + ref.sd}


def table(result: dict) -> str:
    """A bucket per row, a label per column: mean NLL ± sd, and the difference to the reference."""
    labels = result["labels"]
    header = ["bucket", "tokens", *(f"{label} ({len(v['checkpoints'])})" for label, v in labels.items())]
    rows = [header]
    for b, tokens in result["buckets"].items():
        cells = []
        for label, v in labels.items():
            s = v["buckets"][b]
            cells.append("-" if s["nll"] is None else f"{s['nll']:.4f} ± {s['sd']:.4f}"
                         + ("" if label == result["reference"] else f" ({s['diff']:+.4f})"))
        rows.append([b, f"{tokens:,}", *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return (f"mean test NLL (nats) ± sd over checkpoints, (difference to {result['reference']}); "
            f"{result['n']}-grams, frequent: >= {result['frequent']} in {result['train_tokens']:,} train tokens\n"
            + "\n".join(lines))


def parse_runs(values: list[str]) -> dict[str, list[Path]]:
    """{label: checkpoints} of --run LABEL=CKPT[,CKPT...] values, in order; a directory: its best.pt."""
    runs: dict[str, list[Path]] = {}
    for value in values:
        label, _, paths = value.partition("=")
        paths = [Path(p) for p in paths.split(",") if p]
        if not label or not paths:
            raise ValueError(f"--run {value!r}: expected LABEL=CHECKPOINT[,CHECKPOINT...]")
        runs.setdefault(label, []).extend(p / "best.pt" if p.is_dir() else p for p in paths)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=CKPT[,CKPT...]",
                        help="a model and its checkpoints (one per seed); repeat for each model, the first is the "
                             "reference; a run directory stands for its best.pt")
    parser.add_argument("--n", type=int, default=3, help="N of the N-grams (default 3: two tokens before)")
    parser.add_argument("--frequent", type=int, default=100,
                        help="train occurrences of a frequent N-gram (default 100)")
    parser.add_argument("--max-batches", type=int, default=0, help="test batches (0: the whole split)")
    parser.add_argument("--data", help="the data dir of every checkpoint (default: each one's data.path)")
    parser.add_argument("--bptt", type=int, default=0, help="window length (0: each checkpoint's data.bptt)")
    parser.add_argument("--batch-size", type=int, default=0, help="streams per batch (0: each checkpoint's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", required=True, metavar="OUT", help="where the JSON goes")
    args = parser.parse_args(argv)
    try:  # before the work: replaces only a result of its own
        refuse_foreign_file(Path(args.json), lambda path: holds_json_with(path, {"reference", "buckets", "labels"}),
                            "--json", f"a result of {PROGRAM}")
        result = compare(parse_runs(args.run), args.n, args.frequent, args.max_batches, args.data, args.bptt,
                         args.batch_size, torch.device(args.device))
        write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
    except (*USER_ERRORS, OSError) as e:
        return fail(PROGRAM, e)
    print(table(result))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
