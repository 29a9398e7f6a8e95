"""xlm_pkm.experiments.ngram_gain on tiny trained runs: its buckets hold the tokens a Counter of the training
split's N-grams puts there, its per-bucket losses are those of the models' logits, its seeds make a mean and
a spread, and checkpoints that read other test tokens are refused."""

import json
import statistics
from collections import Counter

import numpy as np
import pytest
import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.experiments import ngram_gain

ENGRAM = ("model.engram.layers=[1]", "model.engram.heads=2", "model.engram.ngram_dim=16", "model.engram.table_size=64")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_train_counts_equal_a_counter(n):
    rng = np.random.default_rng(n)
    train = rng.integers(0, 5, 3000) * (1 << 30)  # few distinct N-grams, ids far beyond any vocabulary
    queries = np.concatenate([np.lib.stride_tricks.sliding_window_view(train, n)[::7], np.full((3, n), 1 << 33)])
    counter = Counter(zip(*(train[i: len(train) - n + 1 + i].tolist() for i in range(n))))
    assert ngram_gain.train_counts(train, queries).tolist() == [counter[tuple(q)] for q in queries.tolist()]


def direct(path, counter, n, frequent):
    """{bucket: (tokens, summed NLL)} of a checkpoint on its test split, from its logits, the buckets by `counter`."""
    trained = load_trained(path)
    model, cfg = trained.model, trained.cfg
    stream = TokenStream(trained.data_dir, "test", cfg.data.eval_batch_size, cfg.data.bptt, train=False)
    sums = {b: [0, 0.0] for b in ("frequent", "rare", "short", "all")}
    with torch.no_grad():
        for x, y in stream:
            nll = -torch.log_softmax(model(x).float(), -1).gather(-1, y[..., None])[..., 0]  # (B, T)
            for row_x, row_y, row_nll in zip(x.tolist(), y.tolist(), nll.tolist()):
                window = row_x[:1] + row_y
                for t, loss in enumerate(row_nll):
                    gram = tuple(window[t + 2 - n: t + 2]) if t >= n - 2 else None
                    bucket = "short" if gram is None else "frequent" if counter[gram] >= frequent else "rare"
                    for b in (bucket, "all"):
                        sums[b][0] += 1
                        sums[b][1] += loss
    return sums


@pytest.mark.slow
def test_buckets_and_losses_match_a_direct_count(reference_run, tiny_data_dir, tmp_path, capsys):
    pkm = reference_run().run_dir / "best.pt"
    engram = [reference_run(*ENGRAM).run_dir / "best.pt", reference_run(*ENGRAM, "train.seed=1").run_dir]
    out = tmp_path / "gain.json"
    argv = ["--run", f"pkm={pkm}", "--run", f"engram={engram[0]}", "--run", f"engram={engram[1]}", "--frequent", "5",
            "--json", str(out)]
    assert ngram_gain.main(argv) == 0
    result = json.loads(out.read_text())
    # the training split whole, in order: one stream of one window
    (x, y), = TokenStream(tiny_data_dir, "train", 1, 1 << 24, train=False)
    train = [x[0, 0].item(), *y[0].tolist()]
    counter = Counter(zip(train, train[1:], train[2:]))
    assert result["train_tokens"] == len(train)
    engram[1] /= "best.pt"
    sums = {"pkm": [direct(pkm, counter, 3, 5)], "engram": [direct(p, counter, 3, 5) for p in engram]}
    assert result["buckets"] == {b: n for b, (n, _) in sums["pkm"][0].items()}
    assert result["buckets"]["frequent"] > 100 and result["buckets"]["rare"] > 100
    streams = result["buckets"]["all"] // 32  # tokens in each of the 32 streams, in windows of up to 16
    assert result["buckets"]["short"] == 32 * -(-streams // 16)  # the first token of every window
    assert result["reference"] == "pkm" and result["labels"]["engram"]["checkpoints"][1] == str(engram[1])
    for b in ("frequent", "rare", "short", "all"):
        ref = result["labels"]["pkm"]["buckets"][b]
        assert ref["nll"] == pytest.approx(sums["pkm"][0][b][1] / sums["pkm"][0][b][0], rel=1e-5)
        assert ref["sd"] == ref["diff"] == 0 and ref["tokens"] == result["buckets"][b]
        got, runs = result["labels"]["engram"]["buckets"][b], [s[b][1] / s[b][0] for s in sums["engram"]]
        assert got["runs"] == pytest.approx(runs, rel=1e-5) and got["nll"] == pytest.approx(statistics.mean(runs))
        assert got["sd"] == pytest.approx(statistics.stdev(runs), rel=1e-3) and got["sd"] > 0
        assert got["diff"] == pytest.approx(got["nll"] - ref["nll"]) and got["spread"] == pytest.approx(got["sd"])
    printed = capsys.readouterr().out
    assert "pkm (1)" in printed and "engram (2)" in printed and f"{result['buckets']['rare']:,}" in printed


def test_checkpoints_must_read_the_same_test_tokens(reference_run, tmp_path, capsys):
    pkm, shorter = reference_run().run_dir / "best.pt", reference_run("data.bptt=8").run_dir / "best.pt"
    out = tmp_path / "gain.json"
    argv = ["--run", f"a={pkm}", "--run", f"b={shorter}", "--max-batches", "2", "--json", str(out)]
    assert ngram_gain.main(argv) == 2 and not out.exists()
    assert "reads other test tokens than" in capsys.readouterr().err
    assert ngram_gain.main([*argv, "--bptt", "8"]) == 0  # both read windows of 8
    assert json.loads(out.read_text())["buckets"]["all"] == 2 * 32 * 8
    assert ngram_gain.main(["--run", "a", "--json", str(out)]) == 2
    assert "expected LABEL=CHECKPOINT" in capsys.readouterr().err
