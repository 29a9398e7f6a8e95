"""results/facts_default/heldout_sets.py: the held-out facts files are what results/facts_default/README.md says
(blocks of 5 subjects of one relation with 5 distinct answers, the subject-blind guess at 20% for 5 facts, every
file readable as one's own facts), and its report's intervals are paired.py's over files."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.text_codec import text_codec
from xlm_pkm.experiments.fact_scores import prior_em
from xlm_pkm.experiments.facts import read_own_facts

SCRIPT = Path(__file__).resolve().parents[1] / "results" / "facts_default" / "heldout_sets.py"


@pytest.fixture(scope="module")
def heldout_sets():
    spec = importlib.util.spec_from_file_location("heldout_sets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_files_are_blocks_of_distinct_answers_and_read_as_ones_own_facts(heldout_sets, tmp_path):
    heldout_sets.write(tmp_path)
    for n, seeds in heldout_sets.SETS.items():
        for i, seed in enumerate(seeds):
            facts = read_own_facts(tmp_path / f"n{n}_set{i}.jsonl")
            assert len(facts) == n
            assert heldout_sets.facts_file(n, seed) == heldout_sets.facts_file(n, seed)  # seeded
            for start in range(0, n, 5):
                block = facts[start:start + 5]
                assert len({f.relation for f in block}) == 1 and len({f.object for f in block}) == 5
                assert len({f.subject for f in block}) == 5
            assert all(len(f.paraphrases) == 8 and all(f.object in s for s in f.paraphrases) for f in facts)
            assert all(f.question.startswith("Q: ") and f.question.endswith(" A:") for f in facts)
            if n == 5:
                assert prior_em(facts) == pytest.approx(0.2)
    names = [json.loads(line)["subject"] for line in (tmp_path / "n20_set0.jsonl").read_text().splitlines()]
    assert len(set(names)) == 20


def test_the_report_pairs_each_files_em_with_its_prior(heldout_sets, tmp_path, capsys):
    rows = [{"method": "pretrained", "setting": "file=a facts=5", "em": 0.0, "valid_ppl": 90.0, "test_ppl": 80.0}]
    for name, em, fc in (("a", 0.6, 0.6), ("b", 0.2, 0.4), ("c", 0.4, 0.2)):
        rows.append({"method": "sparse_memory", "setting": f"file={name} facts=5", "step": 320, "em": em,
                     "em_prior": 0.2, "fc": fc, "fc_shuffled": 0.2, "fc_chance": 0.2, "em_question": 0.0,
                     "valid_ppl": 100.0, "test_ppl": 85.0})
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout_sets.report(scores)
    out = capsys.readouterr().out
    assert "| a | 5 | 320 | 60% | 20% | 60% | 20% | 20% | 0% | 100.00 (+10.00) | 85.00 (+5.00) |" in out
    # EM − prior per file: +40, 0, +20 points: mean 20, sd 20, se 11.547, t(0.975, 2) = 4.3027: ± 49.68
    assert "mean +20.0 points over 3 files, 95% interval [-29.7, +69.7]" in out


@pytest.mark.slow
def test_overlap_counts_the_slots_the_last_prompt_position_reads_in_the_models_own_forward(
        heldout_sets, tiny_run, tmp_path, capsys):
    """The reference: lookup's indices recorded inside the model's ordinary forward (a wrapper on lookup), at
    each prompt's last position, and every pair's shared count taken from those sets."""
    run_dir = Path(tiny_run(tmp_path, "train.exp_id=r").run_dir)
    heldout_sets.write(tmp_path / "files")
    facts = read_own_facts(tmp_path / "files" / "n5_set0.jsonl")
    capsys.readouterr()  # the training's log
    heldout_sets.overlap(run_dir / "best.pt", [tmp_path / "files" / "n5_set0.jsonl"])
    printed = capsys.readouterr().out.strip()

    trained = load_trained(run_dir / "best.pt")
    codec, (_, memory) = text_codec(trained.data_dir), next(iter(trained.model.memories()))
    lookup, recorded = memory.lookup, []

    def recording(x):
        weights, indices = lookup(x)
        recorded.append(indices)
        return weights, indices

    memory.lookup = recording
    read = []
    with torch.no_grad():
        for fact in facts:
            trained.model(torch.tensor([codec.encode(fact.prompt)]))
            last = recorded[-1].reshape(-1, memory.heads * memory.knn)[-1]  # one row: the prompt's last position
            read.append(set(last.tolist()))
    shared = [len(a & b) for a, b in itertools.combinations(read, 2)]
    sizes = [len(r) for r in read]
    assert printed == (f"n5_set0: slots read {min(sizes)}-{max(sizes)}, shared with another subject's prompt "
                       f"{min(shared)}-{max(shared)}")
