"""Sparse memory finetuning: the TF-IDF ranking by hand, each step's updated rows against a brute-force
selection from the slots the step read, everything else bit-identical, the background counts against a
brute-force count, sharded values on 2 processes, the controls (ranking by count, at random) and the error lines."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_VALUES, brute_force_top_slots, read_events, train_recording_steps, whole_checkpoint

from xlm_pkm.finetune.memory_finetune import Background, random_slots, tf_idf, top_by_count, top_slots
from xlm_pkm.launch.cli import train_main

ROOT = Path(__file__).resolve().parents[1]


def test_tf_idf_ranking_equals_a_hand_computation():
    reads = torch.tensor([0, 4, 2, 2, 0, 1])  # 9 reads in the batch
    doc_freq = torch.tensor([5, 9, 0, 4, 1, 0])  # of 9 background documents
    # tf = [0, 4/9, 2/9, 2/9, 0, 1/9], idf = log(10 / (df + 1)) = [log 10/6, 0, log 10, log 2, log 5, log 10]
    expected = [0.0, 0.0, 2 / 9 * math.log(10), 2 / 9 * math.log(2), 0.0, 1 / 9 * math.log(10)]
    assert tf_idf(reads, doc_freq, 9).tolist() == pytest.approx(expected, abs=1e-12)
    # 0.512 (slot 2) > 0.256 (slot 5) > 0.154 (slot 3); slot 1 scores 0 (read by every document): never chosen
    assert top_slots(reads, doc_freq, 9, 3).tolist() == [2, 5, 3]
    assert top_slots(reads, doc_freq, 9, 10).tolist() == [2, 5, 3]
    assert top_slots(torch.tensor([1, 0, 1, 1]), torch.zeros(4), 5, 2).tolist() == [0, 2]  # ties: lower slot
    assert top_slots(torch.tensor([3, 1]), torch.tensor([9, 9]), 9, 2).tolist() == []  # all at 0: none


def test_count_ranking_equals_a_brute_force_top_t_of_the_counts():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        reads = torch.randint(0, 4, (50,), generator=generator) * torch.randint(0, 2, (50,), generator=generator)
        for t in (1, 5, 50):
            brute = sorted((slot for slot, c in enumerate(reads.tolist()) if c), key=lambda s: (-reads[s], s))[:t]
            assert top_by_count(reads, t).tolist() == brute
    assert top_by_count(torch.tensor([0, 2, 5, 2, 0]), 2).tolist() == [2, 1]  # equal counts: the lower slot


def test_random_ranking_draws_t_of_the_slots_read_the_same_for_the_same_seed_and_step():
    reads = torch.zeros(1000, dtype=torch.long)
    reads[torch.arange(3, 1000, 7)] = torch.arange(1, 144)  # 143 slots read
    draws = {(seed, step): random_slots(reads, 20, seed, step, "v").tolist() for seed in (0, 1) for step in (1, 2)}
    for slots in draws.values():
        assert len(slots) == len(set(slots)) == 20 and all(reads[s] > 0 for s in slots)
    assert draws[0, 1] == random_slots(reads, 20, 0, 1, "v").tolist()  # reproducible: (seed, step, table) alone
    assert len({tuple(d) for d in draws.values()}) == 4 and random_slots(reads, 20, 0, 1, "w").tolist() != draws[0, 1]
    assert sorted(random_slots(reads, 500, 0, 1, "v").tolist()) == torch.arange(3, 1000, 7).tolist()  # all read


def _finetune(source, *extra) -> tuple:
    best, background = source
    return (f"train.init_from={best}", "optim.trainable=memory_values", "optim.values_optimizer=sgd",
            "optim.values_lr=50", "optim.memory_finetune.top_t=3", f"optim.memory_finetune.background={background}",
            *extra)


def test_only_the_top_t_rows_of_each_step_move(finetune_source, tiny_trainer, tmp_path, monkeypatch):
    """Each step's moved value rows are exactly the 3 best by TF-IDF of the slots the step read (recorded
    from the memory's lookups, ranked by a plain Python loop); every other row and parameter stays."""
    background = Background.from_file(finetune_source[1])
    trainer = tiny_trainer(tmp_path, "train.exp_id=smf", *_finetune(finetune_source), test=False)
    rows = dict(trainer.model.named_parameters())[TINY_VALUES].shape[0]
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def record(lookups, moved, out):  # (rows that moved, brute-force selection, distinct slots read)
        reads = torch.bincount(torch.cat([i.flatten() for _, i in lookups]), minlength=rows).tolist()
        best = brute_force_top_slots(reads, background.doc_freq[TINY_VALUES], background.documents, 3)
        return moved, best, sum(c > 0 for c in reads)

    steps = train_recording_steps(trainer, monkeypatch, record)
    assert len(steps) == 8
    for moved, best, _ in steps:
        assert moved == best
    end = trainer.model.state_dict()
    touched = {row for moved, _, _ in steps for row in moved}
    for name, tensor in end.items():
        if name != TINY_VALUES:
            assert torch.equal(tensor, start[name]), name
    untouched = [row for row in range(rows) if row not in touched]
    assert torch.equal(end[TINY_VALUES][untouched], start[TINY_VALUES][untouched])
    logged = [(e["slots_read"], e["slots_updated"]) for e in read_events(trainer.run_dir)]
    assert logged == [(read, 3) for _, _, read in steps]


@pytest.mark.parametrize("ranking", ["count", "random"])
def test_the_controls_move_the_rows_their_ranking_picks(finetune_source, tiny_trainer, tmp_path, monkeypatch, ranking):
    """ranking=count: each step's moved rows are a brute-force top 3 of its counts; ranking=random: 3 of the
    slots the step read, those random_slots draws for (seed, step), so a re-run or a resumed run draws the same."""
    best, _ = finetune_source
    trainer = tiny_trainer(tmp_path, f"train.exp_id={ranking}", *_finetune(
        (best, ""), f"optim.memory_finetune.ranking={ranking}", "optim.memory_finetune.seed=7"), test=False)
    rows = dict(trainer.model.named_parameters())[TINY_VALUES].shape[0]
    counted = []

    def record(lookups, moved, out):
        reads = torch.bincount(torch.cat([i.flatten() for _, i in lookups]), minlength=rows)
        counted.append(reads)
        if ranking == "count":
            return moved, sorted(sorted(range(rows), key=lambda s: (-int(reads[s]), s))[:3])
        return moved, sorted(random_slots(reads, 3, 7, len(counted), TINY_VALUES).tolist())

    steps = train_recording_steps(trainer, monkeypatch, record)
    assert len(steps) == 8 and all(moved == picked for moved, picked in steps)
    assert all(all(reads[s] > 0 for s in moved) for (moved, _), reads in zip(steps, counted))
    assert [e["slots_updated"] for e in read_events(trainer.run_dir)] == [3] * 8


@pytest.mark.slow
def test_two_processes_with_sharded_values_update_the_rows_of_one_process(finetune_source, tiny_overrides, tiny_run,
                                                                          tmp_path):
    """torchrun, 2 ranks holding half the value columns each, 2 x 2 streams: the same rows move, to the
    same values (within float rounding), as on one process with 4 streams."""
    best, _ = finetune_source
    extra = _finetune(finetune_source, "train.max_steps=4")
    single = tiny_run(tmp_path, "train.exp_id=one", *extra, "data.batch_size=8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "--no-test", *tiny_overrides(tmp_path, *extra), "train.exp_id=two", "data.batch_size=4",
           "model.memory.shard_values=true", "train.num_threads=1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from xlm_pkm.checkpoint import files as checkpoint

    path = tmp_path / "tiny" / "two" / "checkpoint.pt"
    two = whole_checkpoint(path)["model"][TINY_VALUES]
    start, one = checkpoint.load(best)["model"][TINY_VALUES], single.model.state_dict()[TINY_VALUES]
    moved = (one != start).any(dim=1)
    assert moved.sum() >= 3 and torch.equal((two != start).any(dim=1), moved)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)
    logged = [e["slots_updated"] for e in read_events(tmp_path / "tiny" / "two")]
    assert logged == [e["slots_updated"] for e in read_events(single.run_dir)] == [3, 3, 3, 3]


@pytest.mark.slow
def test_bad_settings_are_one_line(finetune_source, tiny_overrides, tmp_path, capsys):
    best, background = finetune_source
    other = Background.from_file(background)
    other.fingerprint = "0" * 16
    other.to_file(tmp_path / "other.pt", source="elsewhere")
    (tmp_path / "notes.txt").write_text("not counts")
    cases = {
        "no background": (("optim.memory_finetune.background=",), "top_t needs optim.memory_finetune.background"),
        "dense values": (("optim.values_optimizer=adam",), "needs a values optimizer on sparse rows"),
        "no memory": (("model.mem_layers=[]", "model.n_memories=0", "train.init_from=", "optim.trainable=all"),
                      "the model has no memory"),
        "frozen values": (("optim.trainable=[blocks.0.*]",), "the memory values do not train"),
        "other model": ((f"optim.memory_finetune.background={tmp_path / 'other.pt'}",), "counted on another model"),
        "missing": ((f"optim.memory_finetune.background={tmp_path / 'none.pt'}",), "none.pt does not exist"),
        "background unread": (("optim.memory_finetune.ranking=count",), "background is read by "
                                                                         "optim.memory_finetune.ranking=tfidf only"),
        "not counts": ((f"optim.memory_finetune.background={tmp_path / 'notes.txt'}",), "is not readable"),
    }
    for i, (name, (extra, message)) in enumerate(cases.items()):
        overrides = tiny_overrides(tmp_path, f"train.exp_id=e{i}", *_finetune(finetune_source, *extra))
        code = train_main(["--no-test", *overrides])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (name, err)
