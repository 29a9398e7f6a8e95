"""The made-up facts (seeded, invented, in the pretraining vocabulary) and their scoring (EM, report)."""

import json
from pathlib import Path

import pytest
import torch

from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.text_codec import TextCodec
from xlm_pkm.experiments.continual import (exact_match, greedy_matches, prior_em, prompt_and_object, with_ppl_change,
                                           write_report)
from xlm_pkm.experiments.facts import RELATIONS, Fact, generate_facts, load_facts, write_facts_data
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling
from xlm_pkm.model.transformer import TransformerLM

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "processed" / "sample"
needs_sample = pytest.mark.skipif(not (SAMPLE / "vocab").exists(), reason="data/processed/sample not built (make data)")


def test_facts_are_seeded_and_cover_every_relation():
    facts = generate_facts(300, seed=0)
    assert facts == generate_facts(300, seed=0) and len(facts) == 300
    other = generate_facts(300, seed=1)
    assert {f.subject for f in facts}.isdisjoint({f.subject for f in other})
    assert {f.relation for f in facts} == {r.name for r in RELATIONS}
    assert len({(f.subject, f.relation) for f in facts}) == 300  # one object per subject and relation
    assert all(f.sentence.startswith(f.prompt + " " + f.object) for f in facts)
    assert any(f.paraphrase for f in facts) and any(f.paraphrase is None for f in facts)


@needs_sample
def test_subjects_are_not_words_of_the_pretraining_corpus_and_objects_are_one_token():
    vocab = Dictionary.load(SAMPLE / "vocab")
    whole_words = {w.lower() for w in vocab.words if not w.endswith("@@")}
    facts = generate_facts(300, seed=0)  # without an exclusion list: invented by construction
    assert not {f.subject.lower() for f in facts} & whole_words
    codec = TextCodec(SAMPLE)
    for f in facts[:len(RELATIONS) * 4]:
        prompt, obj = prompt_and_object(codec, f.prompt, f.object)
        assert len(obj) == 1 and vocab[obj[0]] == f.object, f


def random_lm(vocab_size: int) -> TransformerLM:
    cfg = load_config(None, ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_len=32",
                             "model.n_memories=1", "model.memory.n_keys=8", "model.memory.k_dim=16",
                             "model.memory.heads=2", "model.memory.knn=4", f"model.vocab_size={vocab_size}"])
    torch.manual_seed(0)
    return TransformerLM(cfg.model).eval()


@pytest.fixture(scope="module")
def tiny_lm():
    return random_lm(50)


def test_greedy_matches_agree_with_greedy_generation(tiny_lm):
    """Against generate() (token by token, KV cache): its greedy outputs match, any other object does not;
    prompts of different lengths share a batch."""
    greedy = Sampling(greedy=True)
    prompts = [[0, 5, 9, 11], [0, 7], [0, 30, 31, 32, 33, 34, 35], [0, 12, 40]]
    pairs, expected = [], []
    for i, prompt in enumerate(prompts):
        out = generate(tiny_lm, prompt, 1 + i % 2, greedy)[0]
        wrong_last = out[:-1] + [(out[-1] + 1) % 50]
        pairs += [(prompt, out), (prompt, wrong_last)]
        expected += [True, False]
    assert greedy_matches(tiny_lm, pairs, pad=2, batch_size=3) == expected


def test_facts_data_uses_the_pretraining_vocabulary_and_scores(tiny_data_dir, tiny_lm, tmp_path):
    out = write_facts_data(tmp_path / "facts", 20, seed=0, codes=str(tiny_data_dir / "codes"),
                           vocab=str(tiny_data_dir / "vocab"))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["fingerprint"] == Dictionary.load(tiny_data_dir / "vocab").fingerprint()
    facts = load_facts(out / "facts.jsonl")
    assert facts == generate_facts(20, 0, exclude=set(Dictionary.load(tiny_data_dir / "vocab").words))
    train_text = (out / "documents.jsonl").read_text()
    assert all(train_text.count(f.sentence) == 5 for f in facts)  # five copies, at most four held out
    codec = TextCodec(out)
    model = random_lm(len(codec.dictionary))
    for paraphrase in (False, True):  # against generate(), one fact at a time
        prompts = [(f.paraphrase if paraphrase else f.prompt, f.object) for f in facts]
        pairs = [prompt_and_object(codec, p, o) for p, o in prompts if p]
        hits = [generate(model, p, len(o), Sampling(greedy=True))[0] == o for p, o in pairs]
        assert exact_match(model, codec, facts, paraphrase) == sum(hits) / len(hits)


def test_report_table_and_figure(tmp_path):
    rows = [{"model": "memory", "method": "pretrained", "setting": "-", "em": 0.0, "em_paraphrase": 0.0,
             "valid_ppl": 20.0},
            {"model": "memory", "method": "lora", "setting": "rank=8", "em": 0.5, "em_paraphrase": 0.25,
             "valid_ppl": 21.5},
            {"model": "dense", "method": "pretrained", "setting": "-", "em": 0.1, "em_paraphrase": 0.0,
             "valid_ppl": 22.0},
            {"model": "dense", "method": "full", "setting": "lr=1e-4", "em": 0.9, "em_paraphrase": 0.3,
             "valid_ppl": 30.0}]
    assert [r["ppl_change"] for r in with_ppl_change(rows)] == [0.0, 1.5, 0.0, 8.0]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(results, tmp_path / "out").read_text()
    assert "| memory | lora | rank=8 | 50.0% | 25.0% | 21.50 | +1.50 |" in report
    assert "| dense | full | lr=1e-4 | 90.0% | 30.0% | 30.00 | +8.00 |" in report
    assert (tmp_path / "out" / "learning_forgetting.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no pretrained row for model"):
        with_ppl_change(rows[1:2])


def test_the_subject_blind_guess_scores_each_relations_most_frequent_object(tmp_path):
    facts = [Fact(f"S{i}", relation, "p", None, obj, "s") for i, (relation, obj) in enumerate(
        [("colour", "red"), ("colour", "red"), ("colour", "blue"), ("type", "int"), ("type", "str")])]
    assert prior_em(facts) == pytest.approx(3 / 5)  # red for both red subjects, one of int/str
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "facts.jsonl").write_text("".join(json.dumps(f.__dict__) + "\n" for f in facts))
    rows = [{"model": "m", "method": "pretrained", "setting": "-", "em": 0.0, "em_paraphrase": 0.0, "valid_ppl": 9.0}]
    (tmp_path / "r.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert "scores EM 60.0% (dashed line)" in write_report(tmp_path / "r.jsonl", tmp_path / "out", tmp_path / "facts").read_text()
