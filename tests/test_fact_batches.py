"""Fact batches (data.fact_batches) and sparse memory finetuning on them, the paper's way: one fact's
paraphrases per step, padding out of the loss and the slot counts (against per-sequence forwards and a
brute-force count), no slot scoring 0 ever updated, background documents of a recorded length."""

import random
import shutil

import pytest
import torch
from conftest import TINY_VALUES, brute_force_top_slots, read_events, train_recording_steps

from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.fact_batches import PAD_TARGET, FactBatches, write_fact_batches
from xlm_pkm.errors import ConfigError
from xlm_pkm.finetune.memory_finetune import Background
from xlm_pkm.finetune.slot_counts import main as slot_counts_main
from xlm_pkm.model.memory.pkm import ProductKeyMemory

FACTS, PARAPHRASES = 5, 8


@pytest.fixture(scope="module")
def facts_dir(tiny_data_dir, tmp_path_factory):
    """The tiny corpus plus fact_batches.json: 5 facts of 8 paraphrases, <s> + 3..14 random tokens each."""
    out = tmp_path_factory.mktemp("facts") / "data"
    shutil.copytree(tiny_data_dir, out)
    dictionary = Dictionary.load(out / "vocab")
    rng = random.Random(0)
    facts = [[[dictionary.bos] + [rng.randrange(4, len(dictionary)) for _ in range(rng.randint(3, 14))]
              for _ in range(PARAPHRASES)] for _ in range(FACTS)]
    write_fact_batches(out, facts, dictionary)
    return out, facts


def test_a_fact_batch_is_its_paraphrases_padded_and_the_stream_resumes(facts_dir):
    data, facts = facts_dir
    batches = FactBatches(data, 4)
    pad = batches.dictionary.pad
    for i, (x, y) in zip(range(2 * FACTS), batches):
        sequences = facts[i % FACTS][:4]
        width = max(map(len, sequences)) - 1
        assert x.shape == y.shape == (4, width)
        for row, ids in enumerate(sequences):
            n = len(ids) - 1
            assert x[row, :n].tolist() == ids[:-1] and y[row, :n].tolist() == ids[1:]
            assert (x[row, n:] == pad).all() and (y[row, n:] == PAD_TARGET).all()
    assert (batches.epoch, batches.step) == (1, FACTS)  # the state counts a batch once it is yielded
    halves = [FactBatches(data, 4, rank, 2) for rank in (0, 1)]  # each rank takes every other paraphrase
    x0, x1 = (next(iter(h))[0] for h in halves)
    assert [r for r in x0[:, 0].tolist()] == [facts[0][0][0], facts[0][2][0]] and len(x1) == 2
    resumed = FactBatches(data, 4)
    first = FactBatches(data, 4)
    it = iter(first)
    for _ in range(7):
        next(it)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(next(it), next(iter(resumed))))


def test_fact_batch_errors_are_one_line(facts_dir, tiny_data_dir, tmp_path):
    data, _ = facts_dir
    with pytest.raises(FileNotFoundError, match="has no fact_batches.json"):
        FactBatches(tiny_data_dir, 4)
    with pytest.raises(ValueError, match="holds 8 paraphrases per fact"):
        FactBatches(data, 9)
    with pytest.raises(ValueError, match="not divisible by the 3 processes"):
        FactBatches(data, 4, 0, 3)
    with pytest.raises(ValueError, match="its fact_batches is 2"):
        FactBatches(data, 4).load_state_dict({**FactBatches(data, 2).state_dict()})
    other = tmp_path / "other"
    shutil.copytree(data, other)
    write_fact_batches(other, [[[0, 5, 6]]], Dictionary(["a", "b"]))
    with pytest.raises(ValueError, match="another vocabulary"):
        FactBatches(other, 1)
    for extra, message in ((["optim.accumulate=2"], "would mix facts in a step"),
                           (["model.family=all_attention"], "carries a stream cache")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["data.fact_batches=4", *extra])


def _finetune(source, facts_dir, *extra) -> tuple:
    best, background = source
    return (f"train.init_from={best}", f"data.path={facts_dir[0]}", f"data.fact_batches={PARAPHRASES}",
            "optim.trainable=memory_values", "optim.values_optimizer=sgd", "optim.values_lr=50",
            "optim.memory_finetune.top_t=3", f"optim.memory_finetune.background={background}", *extra)


def _recorded_finetune(trainer, monkeypatch) -> list[dict]:
    """Trains; per step: the batch, the slots each real (not padding) position read, and the rows that moved."""
    rows, batches_seen = dict(trainer.model.named_parameters())[TINY_VALUES].shape[0], []
    batch = FactBatches.batch
    monkeypatch.setattr(FactBatches, "batch", lambda self, i: batches_seen.append(batch(self, i)) or batches_seen[-1])

    def record(lookups, moved, out):
        x, y = batches_seen[-1]
        _, indices = lookups[0]  # (B * T, heads, knn)
        real = (y != PAD_TARGET).reshape(-1)
        reads = torch.bincount(indices[real].flatten(), minlength=rows).tolist()
        return {"x": x, "y": y, "reads": reads, "moved": moved, "loss": float(out["loss"])}

    return train_recording_steps(trainer, monkeypatch, record)


def test_sparse_finetuning_on_fact_batches_leaves_the_padding_out(finetune_source, facts_dir, tiny_trainer,
                                                                                tmp_path, monkeypatch):
    """Each step: the loss is the mean NLL of the paraphrases' tokens, each paraphrase run alone (padding
    changes nothing); the moved rows are the 3 best by TF-IDF of the reads of real positions only (a
    brute-force count, ranked by a plain loop); the logged counts are those."""
    background = Background.from_file(finetune_source[1])
    trainer = tiny_trainer(tmp_path, "train.exp_id=facts", *_finetune(finetune_source, facts_dir), test=False)
    reference = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    steps = _recorded_finetune(trainer, monkeypatch)
    assert len(steps) == 8 and torch.equal(steps[FACTS]["x"], steps[0]["x"])  # 5 facts, then again in order
    for s in steps:
        best = brute_force_top_slots(s["reads"], background.doc_freq[TINY_VALUES], background.documents, 3)
        assert s["moved"] == best
    assert [(e["slots_read"], e["slots_updated"]) for e in read_events(trainer.run_dir)] == \
        [(sum(c > 0 for c in s["reads"]), 3) for s in steps]
    model = trainer.model  # the first step's loss, from the weights before it, one paraphrase at a time
    model.load_state_dict(reference)
    model.eval()
    x, y = steps[0]["x"], steps[0]["y"]
    with torch.no_grad():
        nlls = [model(x[r:r + 1, :n], targets=y[r:r + 1, :n]) for r in range(len(x)) for n in [int((y[r] >= 0).sum())]]
    assert steps[0]["loss"] == pytest.approx(float(torch.cat(nlls, 1).mean()), rel=1e-5)
    assert read_events(trainer.run_dir)[0]["tokens_per_sec"] > 0


def test_a_slot_every_background_document_reads_is_never_updated(finetune_source, facts_dir, tiny_trainer, tmp_path,
                                                                      monkeypatch):
    """A background whose documents all read every slot but slots 0-5: those six are the only candidates
    (score 0 elsewhere), so a step updates only those of them it read, fewer than top_t when it read fewer."""
    counted = Background.from_file(finetune_source[1])
    doc_freq = torch.full_like(counted.doc_freq[TINY_VALUES], counted.documents)
    doc_freq[:6] = 0
    Background({TINY_VALUES: doc_freq}, counted.reads, counted.documents, counted.tokens, counted.fingerprint,
               counted.doc_tokens).to_file(tmp_path / "every.pt", source="test")
    extra = ("optim.memory_finetune.top_t=100", f"optim.memory_finetune.background={tmp_path / 'every.pt'}")
    trainer = tiny_trainer(tmp_path, "train.exp_id=ties", *_finetune(finetune_source, facts_dir, *extra), test=False)
    steps = _recorded_finetune(trainer, monkeypatch)
    for s in steps:
        assert s["moved"] == [slot for slot in range(6) if s["reads"][slot]]
    assert any(s["moved"] for s in steps) and any(sum(s["reads"][6:]) for s in steps)
    assert [e["slots_updated"] for e in read_events(trainer.run_dir)] == [len(s["moved"]) for s in steps]


def test_background_documents_have_the_recorded_length_and_do_not_mix(finetune_source, tiny_data_dir, tmp_path, capsys):
    """--doc-tokens 24: 40 documents of 2 rows x 12 tokens, against a brute-force count over the same
    stream; --append doubles the counts of the same length and refuses another length in one line; --out names
    a file that is not slot counts (the checkpoint itself): refused before counting, the file kept."""
    best, file = finetune_source
    counted = Background.from_file(file)
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.data.stream import TokenStream

    model = load_trained(best).model
    memory = next(m for m in model.modules() if isinstance(m, ProductKeyMemory))
    inputs = []
    memory.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    doc_freq = torch.zeros(memory.n_slots, dtype=torch.int64)
    reads = torch.zeros(memory.n_slots, dtype=torch.int64)
    with torch.no_grad():
        for _, (x, _) in zip(range(40), TokenStream(tiny_data_dir, "train", 2, 12, train=False, shuffle=False)):
            inputs.clear()
            model(x)
            counts = torch.bincount(memory.lookup(inputs[0])[1].flatten(), minlength=memory.n_slots)
            doc_freq += counts > 0
            reads += counts
    assert (counted.documents, counted.doc_tokens, counted.tokens) == (40, 24, 960)
    assert torch.equal(counted.doc_freq[TINY_VALUES], doc_freq) and torch.equal(counted.reads[TINY_VALUES], reads)
    share = counted.read_share()[TINY_VALUES]
    assert share["per_document"] == pytest.approx(float(doc_freq.sum()) / (40 * memory.n_slots))
    assert share["by_every_document"] == pytest.approx(float((doc_freq == 40).double().mean()))
    twice = tmp_path / "twice.pt"
    shutil.copy(file, twice)
    args = [str(best), "--data", str(tiny_data_dir), "--documents", "40", "--out", str(twice), "--append"]
    assert slot_counts_main([*args, "--doc-tokens", "24"]) == 0
    both = Background.from_file(twice)
    assert both.documents == 80 and torch.equal(both.doc_freq[TINY_VALUES], 2 * doc_freq)
    capsys.readouterr()
    assert slot_counts_main([*args, "--doc-tokens", "32"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another document length" in err[0]
    assert slot_counts_main([*args[:5], "--out", str(tmp_path / "x.pt"), "--doc-tokens", "25"]) != 0
    assert "must split into 2 equal rows" in capsys.readouterr().err
    kept = best.read_bytes()  # --out on the run's checkpoint (a typo): refused before counting, the file kept
    assert slot_counts_main([*args[:5], "--out", str(best), "--doc-tokens", "24"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a file of slot counts" in err[0] and best.read_bytes() == kept


@pytest.mark.slow
def test_a_sparse_fact_batch_run_cut_and_resumed_equals_the_uninterrupted_one(finetune_source, facts_dir, tiny_run,
                                                                              train_losses, tmp_path):
    """Stopped after 3 of 8 steps (mid-epoch) and resumed: the same losses and weights, bit for bit."""
    extra = _finetune(finetune_source, facts_dir)
    full = tiny_run(tmp_path, "train.exp_id=full", *extra)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *extra)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *extra)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)
    for key, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[key]), key
