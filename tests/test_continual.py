"""The made-up facts (seeded, invented, in the pretraining vocabulary) and their scoring (EM, forced choice and
its controls, report)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY

from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.fact_batches import FactBatches
from xlm_pkm.data.text_codec import TextCodec
from xlm_pkm.experiments.continual import split_scores
from xlm_pkm.experiments.continual_report import (
    backgrounds_table,
    best_settings,
    beyond_control,
    common_em,
    equal_learning,
    over_seeds,
    same_setting,
    with_changes,
    write_report,
)
from xlm_pkm.experiments.fact_scores import (
    candidates,
    choice_credits,
    continuation_logliks,
    exact_match,
    fact_scores,
    forced_choice,
    greedy_matches,
    prior_em,
    prompt_and_object,
    shuffled_partners,
)
from xlm_pkm.experiments.facts import FRAMINGS, RELATIONS, Fact, generate_facts, load_facts, write_facts_data
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
    for f in facts:
        assert f.sentence.startswith(f.prompt + " " + f.object) and f.paraphrases[0] == f.sentence
        assert len(set(f.paraphrases)) == len(f.paraphrases) == len(FRAMINGS) * 8
        assert all(f.subject in p and f" {f.object}" in p for p in f.paraphrases)
        assert f.subject in f.question and f.question not in f.paraphrases and f.object not in f.question


@needs_sample
def test_subjects_are_not_words_of_the_pretraining_corpus_and_objects_are_one_token():
    vocab = Dictionary.load(SAMPLE / "vocab")
    whole_words = {w.lower() for w in vocab.words if not w.endswith("@@")}
    facts = generate_facts(300, seed=0)  # without an exclusion list: invented by construction
    assert not {f.subject.lower() for f in facts} & whole_words
    codec = TextCodec(SAMPLE)
    for f in facts[:len(RELATIONS) * 4]:
        for prompt in (f.prompt, f.question):
            _, obj = prompt_and_object(codec, prompt, f.object)
            assert len(obj) == 1 and vocab[obj[0]] == f.object, f


def random_lm(vocab_size: int, max_len: int = 32) -> TransformerLM:
    cfg = load_config(None, ["model.dim=32", "model.n_layers=2", "model.n_heads=2", f"model.max_len={max_len}",
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


@pytest.mark.slow
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
    x, y = FactBatches(out, 16).batch(0)  # the first fact's first 16 paraphrases, as the run reads them
    decoded = [codec.decode([codec.dictionary.bos] + row[row >= 0].tolist()) for row in y]
    assert decoded == list(facts[0].paraphrases[:16])
    model = random_lm(len(codec.dictionary))
    for question in (False, True):  # against generate(), one fact at a time
        pairs = [prompt_and_object(codec, f.question if question else f.prompt, f.object) for f in facts]
        hits = [generate(model, p, len(o), Sampling(greedy=True))[0] == o for p, o in pairs]
        assert exact_match(model, codec, facts, question) == sum(hits) / len(hits)


@pytest.fixture(scope="module")
def facts_data(tiny_data_dir, tmp_path_factory):
    """(codec, 30 facts) written with the tiny corpus's codes and vocabulary, and a random model of its vocab."""
    out = write_facts_data(tmp_path_factory.mktemp("facts") / "facts", 30, seed=0, codes=str(tiny_data_dir / "codes"),
                           vocab=str(tiny_data_dir / "vocab"))
    codec = TextCodec(out)
    return codec, load_facts(out / "facts.jsonl"), random_lm(len(codec.dictionary), max_len=96)


def _naive_loglik(model, prompt: list[int], obj: list[int]) -> float:
    """log p(obj | prompt) from one forward of this sequence alone, a token at a time."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + obj[:-1]])).double().log_softmax(-1)[0]
    return sum(float(logp[len(prompt) - 1 + j, token]) for j, token in enumerate(obj))


@pytest.mark.slow
def test_forced_choice_ranks_the_relations_objects_by_their_log_likelihood_one_by_one(facts_data):
    """The batched ranking against per-candidate log-likelihoods computed one by one (a naive loop), on the
    trained prompts and on the shuffled-subject prompts; multi-token objects summed over their tokens."""
    codec, facts, model = facts_data
    choices = candidates(facts)
    assert choices["arguments"] == sorted({f.object for f in facts if f.relation == "arguments"})
    pairs = [prompt_and_object(codec, "The favourite colour of Velmora is", o) for o in ("blue", "dark red")]
    assert len(pairs[1][1]) >= 2  # a multi-token continuation
    assert continuation_logliks(model, pairs, codec.dictionary.pad, batch_size=1) == pytest.approx(
        [_naive_loglik(model, p, o) for p, o in pairs], abs=1e-5)
    facts = facts[:12]  # the naive loop is slow: 12 facts, their relations' objects among them
    choices, partner = candidates(facts), shuffled_partners(facts)
    for prompts in ([f.prompt for f in facts], [facts[j].prompt for j in partner]):
        expected = []
        for f, prompt in zip(facts, prompts):
            scores = {o: _naive_loglik(model, *prompt_and_object(codec, prompt, o)) for o in choices[f.relation]}
            best = max(scores.values())
            top = [o for o, v in scores.items() if v > best - 1e-9]
            expected.append(1 / len(top) if f.object in top else 0.0)
        assert forced_choice(model, codec, facts, prompts) == pytest.approx(expected)
    assert choice_credits(-1.0, [-2.0, -1.0, -3.0]) == 0.5 and choice_credits(-1.0, [-0.5]) == 0.0


def test_shuffled_subjects_pair_each_fact_with_another_of_its_relation(facts_data):
    _, facts, _ = facts_data
    partner = shuffled_partners(facts)
    assert partner == shuffled_partners(facts) and partner != shuffled_partners(facts, seed=1)
    assert sorted(partner) == list(range(len(facts)))  # a permutation
    assert all(j != i and facts[j].relation == facts[i].relation for i, j in enumerate(partner))


@pytest.mark.slow
def test_fact_scores_split_em_by_uncommon_object_and_position(facts_data):
    codec, facts, model = facts_data
    scores = fact_scores(model, codec, facts)
    hits = greedy_matches(model, [prompt_and_object(codec, f.prompt, f.object) for f in facts], codec.dictionary.pad)
    assert scores["em"] == pytest.approx(sum(hits) / 30) and scores["em_prior"] == prior_em(facts)
    assert [scores[f"em_{third}"] for third in ("first", "middle", "last")] == pytest.approx(
        [sum(hits[:10]) / 10, sum(hits[10:20]) / 10, sum(hits[20:]) / 10])
    common = {r: max({f.object for f in facts if f.relation == r},
                     key=lambda o: sum(g.object == o and g.relation == r for g in facts)) for r in candidates(facts)}
    counts = {r: sum(f.object == common[r] and f.relation == r for f in facts) for r in common}
    uncommon = [i for i, f in enumerate(facts) if sum(g.object == f.object and g.relation == f.relation
                                                      for g in facts) < counts[f.relation]]
    assert scores["em_uncommon"] == pytest.approx(sum(hits[i] for i in uncommon) / len(uncommon))
    assert scores["fc_chance"] == pytest.approx(sum(1 / len(candidates(facts)[f.relation]) for f in facts) / 30)
    assert all(0 <= scores[k] <= 1 for k in ("fc", "fc_question", "fc_shuffled", "em_shuffled", "fc_uncommon"))
    per_fact = scores["per_fact"]  # fact by fact, in file order: what the own-against-shuffled comparison pairs
    assert per_fact["em"] == "".join(str(int(h)) for h in hits)
    assert per_fact["fc"] == pytest.approx(forced_choice(model, codec, facts, [f.prompt for f in facts]), abs=1e-4)
    for score in ("em_shuffled", "fc_shuffled"):
        assert len(per_fact[score]) == 30
        assert sum(map(float, per_fact[score])) / 30 == pytest.approx(scores[score], abs=1e-4)


def _row(model, method, setting, seed, em, valid_ppl=20.0, test_ppl=25.0, test_acc=0.3):
    return {"model": model, "method": method, "setting": setting, "seed": seed, "em": em, "em_question": em / 2,
            "fc": em + 0.1, "fc_shuffled": 0.3, "em_prior": 0.25, "valid_ppl": valid_ppl, "test_ppl": test_ppl,
            "test_acc": test_acc}


def test_settings_are_chosen_on_the_selection_seed_and_summarised_on_the_others(tmp_path):
    rows = [_row("memory", "pretrained", "-", seed, 0.0) for seed in (0, 3)] + [
        _row("memory", "sparse", "t=10", 3, 0.5, valid_ppl=21.0, test_ppl=26.0),
        _row("memory", "sparse", "t=99", 3, 0.5, valid_ppl=22.0, test_ppl=27.0),
        _row("memory", "sparse", "t=1", 3, 0.2, test_ppl=25.0), _row("memory", "sparse", "t=1", 0, 0.9),
        _row("memory", "sparse", "t=10", 0, 0.7, test_ppl=28.0), _row("memory", "sparse", "t=10", 1, 0.5,
                                                                     test_ppl=26.0)]
    assert best_settings(rows) == {("memory", "sparse"): "t=10"}  # seed 3; EM ties: less forgetting
    assert best_settings(rows, seed=0) == {("memory", "sparse"): "t=1"}
    assert [round(r["test_change"], 9) for r in with_changes(rows)[2:5]] == [1.0, 2.0, 0.0]
    other_base = with_changes([*rows, _row("memory", "pretrained", "-", 1, 0.0, test_ppl=24.0)])
    assert [r["test_change"] for r in other_base[-3:-1]] == [3.0, 2.0]  # seed 0: its own base; seed 1: 24
    assert best_settings(rows, at_em=0.3) == {("memory", "sparse"): "t=10"}  # the least forgetting at EM >= 30%
    assert best_settings(rows, at_em=0.1) == {("memory", "sparse"): "t=1"}
    summary = {(r["method"], r["setting"]): r for r in over_seeds(rows)}  # every setting on seeds other than 3
    assert set(summary) == {("pretrained", "-"), ("sparse", "t=10"), ("sparse", "t=1")}
    sparse = summary["sparse", "t=10"]
    assert sparse["seeds"] == 2 and sparse["em"] == pytest.approx(0.6) and sparse["test_change"] == 2.0
    assert sparse["em_sd"] == pytest.approx(0.1414213562) and sparse["fc"] == pytest.approx(0.7)
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(results, tmp_path / "out").read_text()
    assert "chosen on the facts of seed 3, held out" in report and "seeds 0, 1" in report
    assert "| memory | sparse | t=10 | 2 | 60.0 ± 14.1% | 70.0 ± 14.1% | 30.0 ± 0.0% | · | · / · / · |" in report
    assert "| memory | sparse | t=99 | 50.0% | 25.0% | 60.0% | 30.0% | · | +2.00 | +2.00 | +0.00 |" in report
    assert (tmp_path / "out" / "learning_forgetting.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no pretrained row for model"):
        with_changes(rows[2:3])
    results.write_text(json.dumps({"em": 0.5, "test_ppl": 20.0}) + "\n")
    with pytest.raises(ValueError, match="results.jsonl:1: a row without model, method, setting, seed"):
        write_report(results, tmp_path / "out")


def test_forgetting_at_equal_learning_is_a_paired_ratio_to_the_reference_over_the_verdict_seeds():
    """At each level: each method's least-forgetting (Δ valid ppl) setting reaching it on seed 3, on seeds 0-2; R
    and its interval from the per-seed log ratios (a paired t by hand: t_{0.975, 2} = 4.3027)."""
    rows = [_row("memory", "pretrained", "-", 0, 0.0, test_ppl=20.0)]
    for method, setting, em, changes in (("sparse_memory", "a", 0.15, (1.0, 2.0, 1.5)),
                                         ("sparse_memory", "b", 0.40, (30.0, 30.0, 30.0)),
                                         ("full", "x", 0.18, (10.0, 30.0, 15.0)),
                                         ("full", "y", 0.12, (5.0, 5.0, 5.0))):
        rows += [_row("memory", method, setting, seed, em, valid_ppl=20.0 + change, test_ppl=20.0 + change)
                 for seed, change in zip((3, 0, 1, 2), (changes[0], *changes))]
    table = equal_learning(rows, levels=(0.14, 0.3, 0.5))
    logs = [math.log(f / s) for f, s in zip((10.0, 30.0, 15.0), (1.0, 2.0, 1.5))]
    mean = sum(logs) / 3
    half = 4.302652729911275 * math.sqrt(sum((d - mean) ** 2 for d in logs) / 2 / 3)
    ratio = f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}] (holds, 3 seeds)"
    # each row's EM minus the reference's, per verdict seed (points): full's 18% against sparse_memory's 15%
    assert (f"| 14% (below the line) | memory | full | x | 18.0 ± 0.0% | +3.0 / +3.0 / +3.0 | +18.33 ± 10.41 | "
            f"{ratio} |") in table
    assert "| 14% (below the line) | memory | sparse_memory | a | 15.0 ± 0.0% | · | +1.50 ± 0.50 | reference |" in table
    assert "| 30% (above the line) | memory | sparse_memory | b |" in table  # full does not reach 30%: no row
    assert "| 30% (above the line) | memory | full" not in table and "50%" not in table
    assert equal_learning(rows, levels=(0.6,)) == "No method reaches EM 60% on the selection facts.\n"


def test_forgetting_at_a_common_em_is_interpolated_per_seed_between_each_sweeps_learning_rates():
    """Per verdict seed: e* = the larger of the two sweeps' lowest EMs (if both reach it), Δ linear in EM between
    the bracketing settings, R from the per-seed log ratios by hand (t_{0.975, 2} = 4.3027); a seed without a
    common EM leaves the method without R; one setting is no sweep; the selection seed stays out."""
    rows = [_row("memory", "pretrained", "-", 0, 0.0, test_ppl=20.0)]
    for method, setting, ems, changes in (
            ("sparse_memory", "t=1,lr=1", (0.10, 0.12, 0.14), (1.0, 2.0, 3.0)),
            ("sparse_memory", "t=1,lr=2", (0.20, 0.22, 0.24), (11.0, 12.0, 13.0)),
            ("full", "lr=1", (0.15, 0.10, 0.30), (10.0, 10.0, 10.0)),
            ("full", "lr=2", (0.25, 0.20, 0.40), (30.0, 30.0, 30.0)),
            ("lora", "lr=3", (0.10, 0.12, 0.14), (2.0, 4.0, 9.0)),
            ("lora", "lr=10", (0.30, 0.32, 0.34), (42.0, 44.0, 46.0)),
            ("sparse_count", "t=1,lr=1", (0.10, 0.12, 0.14), (5.0, 5.0, 5.0))):
        rows += [_row("memory", method, setting, seed, em, test_ppl=20.0 + change)
                 for seed, em, change in zip((3, 0, 1, 2), (0.9, *ems), (99.0, *changes))]
    table = common_em(rows)
    # full: seed 0 e* = 0.15 (sparse 1 + 0.5 · 10 = 6, full 10), seed 1 e* = 0.12 (sparse 2, full 10 + 0.2 · 20 = 14),
    # seed 2 e* = 0.30 > 0.24, the top of sparse's sweep: no common EM
    assert ("| the lowest both reach | memory | full | lr=1 / lr=2 | 0: 15.0% / 1: 12.0% |  "
            "| no common EM on seed(s) 2 |") in table
    # lora: e* = its own and sparse's lowest EMs, Δ 2, 4, 9 against 1, 2, 3; its settings in the order of their lrs
    logs = [math.log(2.0), math.log(2.0), math.log(3.0)]
    mean = sum(logs) / 3
    half = 4.302652729911275 * math.sqrt(sum((d - mean) ** 2 for d in logs) / 2 / 3)
    # one R in the table: Holm at 95%
    ratio = f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}] (holds, 3 seeds)"
    assert (f"| the lowest both reach | memory | lora | lr=3 / lr=10 | 0: 10.0% / 1: 12.0% / 2: 14.0% | +1.0 vs +2.0 / "
            f"+2.0 vs +4.0 / +3.0 vs +9.0 | {ratio} |") in table
    assert "sparse_count" not in table  # one setting: no sweep
    assert common_em(rows[:1]).startswith("No method ran two learning rates")


def test_forgetting_at_declared_levels_uses_each_sweeps_frontier_and_the_knowledge_lost_too():
    """At a declared level: Δ test ppl and knowledge lost (1 − the share of the pretrained row's answers kept),
    each interpolated on the sweep's frontier (a lr that learns less and forgets more than another is left out,
    below the frontier's lowest EM its value holds), R of each by hand, Holm over the table's 2 × 2 R; a level
    outside a sweep on a seed leaves it without R; --also-reference's table leaves the main reference out."""
    pretrained_hits = "1111111111" + "0" * 10  # 10 known answers: knowledge kept counts 10ths
    rows = [{**_row("memory", "pretrained", "-", 0, 0.0, test_ppl=20.0), "knowledge_hits": pretrained_hits}]
    sweeps = {  # setting: (EMs, Δ test ppl, answers kept) on seeds 0, 1, 2
        ("sparse_memory", "t=1,lr=1"): ((0.40, 0.40, 0.40), (1.0, 1.0, 2.0), (9, 9, 9)),
        ("sparse_memory", "t=1,lr=2"): ((0.80, 0.80, 0.80), (3.0, 3.0, 4.0), (7, 7, 7)),
        ("lora", "lr=1"): ((0.40, 0.40, 0.40), (20.0, 20.0, 20.0), (1, 1, 1)),  # dominated by lr=2 on both
        ("lora", "lr=2"): ((0.70, 0.80, 0.90), (10.0, 12.0, 14.0), (6, 5, 4)),
        ("full", "lr=1"): ((0.50, 0.50, 0.70), (5.0, 5.0, 5.0), (5, 5, 5)),  # 70% on seed 2: above the level
        ("full", "lr=2"): ((0.90, 0.90, 0.90), (9.0, 9.0, 9.0), (3, 3, 3)),
    }
    for (method, setting), (ems, changes, kept) in sweeps.items():
        rows += [{**_row("memory", method, setting, seed, em, test_ppl=20.0 + change),
                  "knowledge_hits": "1" * k + "0" * (20 - k)}
                 for seed, em, change, k in zip((3, 0, 1, 2), (0.9, *ems), (99.0, *changes), (0, *kept))]
    table = common_em(rows, levels=(0.6,))
    # sparse at 60%: halfway on every seed; lora: its frontier is lr=2 alone, so its values hold below 70-90%
    sparse_ppl, sparse_lost = (2.0, 2.0, 3.0), (0.2, 0.2, 0.2)
    lora_ppl, lora_lost = (10.0, 12.0, 14.0), (0.4, 0.5, 0.6)

    def ratio(ours, theirs):  # both comparisons' t (about 22 and 7.7) pass Holm's 1 − 0.05/2, then 1 − 0.05
        logs = [math.log(b / a) for a, b in zip(ours, theirs)]
        mean = sum(logs) / 3
        half = 4.302652729911275 * math.sqrt(sum((d - mean) ** 2 for d in logs) / 2 / 3)
        return f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}] (holds, 3 seeds)"

    assert (f"| 60% | memory | lora | lr=1 / lr=2 | 0: 60.0% / 1: 60.0% / 2: 60.0% | +2.0 vs +10.0 / +2.0 vs +12.0 / "
            f"+3.0 vs +14.0 | {ratio(sparse_ppl, lora_ppl)} | +20.0% vs +40.0% / +20.0% vs +50.0% / "
            f"+20.0% vs +60.0% | {ratio(sparse_lost, lora_lost)} |") in table
    assert "| 60% | memory | full | lr=1 / lr=2 | 0: 60.0% / 1: 60.0% |  | no common EM on seed(s) 2 |  |  |" in table
    assert "knowledge lost there per seed: sparse_memory vs method" in table
    versus = common_em(rows, reference=("memory", "full"), levels=(0.7, 0.8), skip=("sparse_memory",))
    assert "| sparse_memory |" not in versus  # the header names it, no row compares it
    # lora against full at 70%: full 5 + 2/4 · 4 on seeds 0 and 1, its lowest (5) on seed 2; lora's frontier lr=2
    assert ("| 70% | memory | lora | lr=1 / lr=2 | 0: 70.0% / 1: 70.0% / 2: 70.0% | +7.0 vs +10.0 / +7.0 vs +12.0 / "
            "+5.0 vs +14.0 |") in versus
    assert "| 80% | memory | lora | lr=1 / lr=2 | 1: 80.0% / 2: 80.0% |  | no common EM on seed(s) 0 |" in versus


def test_learning_beyond_the_priors_is_own_minus_shuffled_paired_fact_by_fact_over_the_verdict_seeds():
    """EM and fc after each fact's own prompt minus after a shuffled one, every verdict seed's facts pooled; a
    paired t by hand (t_{0.975, 5} = 2.5706); the selection seed, the pretrained rows and rows scored without
    per_fact stay out."""
    rows = [{**_row("memory", "pretrained", "-", 0, 0.0), "per_fact": {}}]
    outcomes = {0: ("110", "010", [1.0, 0.5, 0.0], [0.0, 0.5, 0.0]),
                1: ("101", "001", [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]),
                3: ("111", "000", [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])}  # seed 3: the selection facts
    for seed, (em, em_shuffled, fc, fc_shuffled) in outcomes.items():
        rows.append({**_row("memory", "sparse", "t=1", seed, 0.5), "per_fact": {
            "em": em, "em_shuffled": em_shuffled, "fc": fc, "fc_shuffled": fc_shuffled}})
    rows.append(_row("dense", "full", "lr=1", 1, 0.2))  # scored before per_fact
    table = beyond_control(rows)
    cells = []
    for diffs, verdict in (([1, 0, 0, 1, 0, 0], "inconclusive"), ([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], "inconclusive")):
        mean = sum(diffs) / 6
        half = 2.5705818366147395 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / 5 / 6)
        cells.append(f"{100 * mean:+.1f} [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}] ({verdict})")
    assert f"| memory | sparse | t=1 | 2 × 3 | {cells[0]} | {cells[1]} |" in table
    assert "dense" not in table and "pretrained" not in table
    rows[1]["per_fact"] = {"em": "111", "em_shuffled": "000", "fc": [1.0] * 3, "fc_shuffled": [0.0] * 3}
    rows[2]["per_fact"] = {"em": "111", "em_shuffled": "000", "fc": [1.0] * 3, "fc_shuffled": [0.0] * 3}
    assert "| memory | sparse | t=1 | 2 × 3 | +100.0 [+100.0, +100.0] (holds) |" in beyond_control(rows)
    assert beyond_control(rows[:1]) == "No trained setting has per-fact scores on the verdict seeds.\n"


def test_controls_are_paired_with_their_method_at_the_same_setting_on_the_verdict_seeds():
    """EM difference and forgetting ratio of each control against its method, the same model and setting only,
    the selection seed left out; a paired t by hand (t_{0.975, 2} = 4.3027)."""
    rows = [_row("memory", "pretrained", "-", 0, 0.0, test_ppl=20.0)]
    for method, setting, ems, changes in (("sparse_memory", "t=1", (0.2, 0.10, 0.12, 0.14), (9.0, 1.0, 2.0, 1.5)),
                                          ("sparse_count", "t=1", (0.9, 0.11, 0.12, 0.16), (1.0, 10.0, 30.0, 15.0)),
                                          ("sparse_random", "t=2", (0.1, 0.1, 0.1, 0.1), (5.0, 5.0, 5.0, 5.0))):
        rows += [_row("memory", method, setting, seed, em, test_ppl=20.0 + change)
                 for seed, em, change in zip((3, 0, 1, 2), ems, changes)]
    table = same_setting(rows)
    cells = []
    for diffs in ([0.01, 0.0, 0.02], [math.log(c / s) for c, s in zip((10.0, 30.0, 15.0), (1.0, 2.0, 1.5))]):
        mean = sum(diffs) / 3
        half = 4.302652729911275 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
        cells.append((mean, mean - half, mean + half))
    (em, em_lo, em_hi), (log_r, lo, hi) = cells
    ratio = f"{math.exp(log_r):.2f} [{math.exp(lo):.2f}, {math.exp(hi):.2f}] (holds, 3 seeds)"
    assert (f"| memory | sparse_count vs sparse_memory | t=1 | {100 * em:+.1f} [{100 * em_lo:+.1f}, "
            f"{100 * em_hi:+.1f}] | {ratio} |") in table
    assert "sparse_random" not in table  # its setting was not run with sparse_memory
    elsewhere = [{**r, "seed": r["seed"] + 10} if r["method"] == "sparse_count" else r for r in rows]
    assert "sparse_count" not in same_setting(elsewhere)  # no seed in common: nothing paired
    assert same_setting(rows[:1]) == "No control shares a setting with its method on the verdict seeds.\n"


def test_the_subject_blind_guess_scores_each_relations_most_frequent_object():
    facts = [Fact(f"S{i}", relation, obj, "p", "s", "q", ("s",)) for i, (relation, obj) in enumerate(
        [("colour", "red"), ("colour", "red"), ("colour", "blue"), ("type", "int"), ("type", "str")])]
    assert prior_em(facts) == pytest.approx(3 / 5)  # red for both red subjects, one of int/str


@pytest.mark.slow
def test_split_scores_equal_evaluation_and_a_token_by_token_count(tiny_data_dir):
    """Perplexity against evaluate() (the framework's), accuracy against a plain count of argmax hits."""
    from xlm_pkm.data.stream import TokenStream
    from xlm_pkm.train.evaluation import evaluate

    stream = TokenStream(tiny_data_dir, "valid", 4, 16, train=False)
    model = random_lm(len(stream.dictionary))
    ppl, accuracy = split_scores(model, stream)
    assert ppl == pytest.approx(evaluate(model, stream, torch.device("cpu"))["ppl"], rel=1e-6)  # float32 sums
    hits = total = 0
    for x, y in stream:
        predicted = model(x).argmax(-1)
        hits += sum(int(predicted[b, t]) == int(y[b, t]) for b in range(y.shape[0]) for t in range(y.shape[1]))
        total += y.numel()
    assert accuracy == hits / total


def test_the_report_gives_each_backgrounds_read_shares(tmp_path):
    import torch

    from xlm_pkm.finetune.memory_finetune import Background

    doc_freq = torch.tensor([4, 4, 1, 0, 2, 0, 0, 1])  # 4 documents: slots 0-1 read by all, 12 reads in all
    Background({"t": doc_freq}, {"t": doc_freq}, 4, 400, "f", 100).to_file(tmp_path / "bg.pt", source="test")
    assert "| m | 4 | 100 | 8 | 37.5% | 25.00% |" in backgrounds_table({"m": tmp_path / "bg.pt"})


OWN_FACTS = [  # short statements in the tiny corpus's words: each fits its model.max_len of 16
    {"statements": ["The new leader is Smith.", "Smith is the new leader.", "Now the leader is Smith.",
                    "Their leader is Smith."], "answer": "Smith", "question": "Who is the leader?", "relation": "who"},
    {"statements": ["The old leader is Jones.", "Jones was the old leader.", "Then the leader was Jones.",
                     "The former leader is Jones."], "answer": "Jones", "relation": "who"},
    {"statements": ["The game is on Monday.", "On Monday is the game.", "They play on Monday.",
                    "The match is on Monday."], "answer": "Monday", "relation": "when"},
    {"statements": ["The vote is on Friday.", "On Friday is the vote.", "They vote on Friday.",
                    "The poll is on Friday."], "answer": "Friday", "relation": "when"},
    {"statements": ["The team plays in London.", "In London the team plays.", "London is where the team plays.",
                    "The club plays in London."], "answer": "London"},
]


def test_a_file_of_ones_own_facts_trains_and_scores(finetune_source, tiny_run, tiny_data_dir, tmp_path, capsys):
    """5 facts of one's own: the facts tool makes their data dir with the pretraining codes and vocab, a tiny
    run finetunes on their fact batches, and `continual score` scores it with no study label."""
    from xlm_pkm.experiments.continual import main as continual_main
    from xlm_pkm.experiments.facts import main as facts_main

    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps(f) + "\n" for f in OWN_FACTS))
    out = tmp_path / "facts"
    assert facts_main(["--from", str(own), "--out", str(out), "--codes", str(tiny_data_dir / "codes"),
                       "--vocab", str(tiny_data_dir / "vocab")]) == 0
    facts = load_facts(out / "facts.jsonl")
    assert [f.object for f in facts] == ["Smith", "Jones", "Monday", "Friday", "London"]
    assert facts[0].prompt == "The new leader is" and facts[0].question == "Who is the leader?"
    assert [f.relation for f in facts] == ["who", "who", "when", "when", "-"] and facts[1].question == ""
    run = tiny_run(tmp_path, "train.exp_id=own", f"train.init_from={finetune_source[0]}", f"data.path={out}",
                   "data.fact_batches=4", "data.eval_batch_size=1", "train.max_steps=10", "optim.schedule=constant")
    assert run.step == 10
    capsys.readouterr()
    assert continual_main(["score", str(run.run_dir / "best.pt"), "--facts", str(out)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["step"] == 10 and "model" not in row and "valid_ppl" not in row
    assert row["em_prior"] == pytest.approx(3 / 5) and row["fc_chance"] == pytest.approx((4 * 0.5 + 1) / 5)
    assert all(0 <= row[k] <= 1 for k in ("em", "em_question", "fc", "fc_question", "fc_shuffled", "em_first"))

    # --baseline: each score's change from the model it was finetuned from, which is scored once, then remembered
    base = json.loads(capsys.readouterr().out if continual_main(["score", str(finetune_source[0]), "--facts",
                                                                 str(out)]) == 0 else "")
    for scored in ("scored", "remembered"):
        assert continual_main(["score", str(run.run_dir / "best.pt"), "--facts", str(out), "--baseline",
                               str(finetune_source[0])]) == 0, scored
        captured = capsys.readouterr()
        change = json.loads(captured.out)["change"]
        assert set(change) == {"em", "em_question", "fc", "fc_question"}  # no --data: no perplexity
        for key, c in change.items():
            assert c == {"baseline": base[key], "change": round(100 * (row[key] - base[key]), 2), "unit": "points"}
        assert f"em {row['em']:.4g} (" in captured.err
    assert len((out / "baseline_scores.jsonl").read_text().splitlines()) == 1  # the second check read it


def test_forgetting_is_read_in_the_same_windows_whatever_the_runs_eval_batch_size(finetune_source, tiny_data_dir,
                                                                                  tmp_path):
    """A facts run evaluates its few-token valid split with data.eval_batch_size=1, the model it is compared to
    with many rows: the same weights under either config score the same corpus perplexity and accuracy."""
    from xlm_pkm.experiments.continual import score_checkpoint
    from xlm_pkm.experiments.facts import read_own_facts, write_facts_dir

    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps(f) + "\n" for f in OWN_FACTS))
    facts = write_facts_dir(tmp_path / "facts", read_own_facts(own), 0, str(tiny_data_dir / "codes"),
                            str(tiny_data_dir / "vocab"))
    state = torch.load(finetune_source[0], weights_only=False)
    assert state["config"]["data"]["eval_batch_size"] == 32  # conftest's TINY
    state["config"]["data"]["eval_batch_size"] = 1
    torch.save(state, tmp_path / "one_row.pt")
    rows = [score_checkpoint(path, facts, tiny_data_dir, max_batches=2) for path in (finetune_source[0],
                                                                                    tmp_path / "one_row.pt")]
    assert all(rows[0][k] == rows[1][k] for k in ("valid_ppl", "test_ppl", "test_acc"))

REPO = Path(__file__).resolve().parents[1]
# A tiny model the example's statements fit (21-25 tokens of the tiny corpus's 500 BPE codes): conftest's TINY
# model, wider, with 256 slots and the default model's BatchNorm query
FACTS_MODEL = [*(o for o in TINY if o.startswith("model.")), "model.max_len=32", "model.dim=64",
               "model.memory.k_dim=32", "model.memory.n_keys=16", "model.memory.query_norm=batchnorm"]


@pytest.mark.slow
def test_the_shipped_facts_setting_learns_the_example_above_the_subject_blind_guess(tiny_data_dir, tmp_path, capsys):
    """docs/finetuning.md's loop with what the repository ships, data/facts/example.jsonl (5 facts of one relation,
    5 answers) and configs/finetune/facts.yaml unchanged, from a tiny model pretrained for 400 steps: the facts
    are learnt about their subjects, EM above the subject-blind guess (20%) and the forced choice above its
    shuffled-subject control.
    The margin, measured on this test's models (issue 63: after 200 pretraining steps EM landed on the guess, 20%,
    on an Intel Xeon and on 5 of 12 runs here): pretraining seeds 0-3 x ATEN_CPU_CAPABILITY native (AVX-512),
    avx2 and default gave EM 40-80% after 400 steps, never 20%; seed 2, used here, 80% under all three (forced
    choice 60-80% against 0% shuffled)."""
    from xlm_pkm.experiments.continual import main as continual_main
    from xlm_pkm.experiments.facts import main as facts_main
    from xlm_pkm.finetune.slot_counts import main as slot_counts_main
    from xlm_pkm.train.trainer import Trainer

    def trained(config, *overrides):
        trainer = Trainer(load_config(config, [f"train.dump_path={tmp_path}", *overrides]), test=False)
        try:
            trainer.train()
        finally:
            trainer.close()
        return trainer.run_dir / "best.pt"

    source = trained(None, *TINY, *FACTS_MODEL, f"data.path={tiny_data_dir}", "train.exp_id=src", "train.seed=2",
                     "train.max_steps=400", "train.eval_every=400", "train.log_every=400")
    facts, background = tmp_path / "my_facts", tmp_path / "slot_counts.pt"
    assert facts_main(["--from", str(REPO / "data/facts/example.jsonl"), "--out", str(facts),
                       "--codes", str(tiny_data_dir / "codes"), "--vocab", str(tiny_data_dir / "vocab")]) == 0
    assert slot_counts_main([str(source), "--data", str(tiny_data_dir), "--doc-tokens", "96", "--documents", "200",
                             "--out", str(background)]) == 0  # 6 rows of 16: about a fact batch of 4 statements
    mine = trained(REPO / "configs/finetune/facts.yaml", *FACTS_MODEL, "data.bptt=16", "train.device=cpu",
                   "train.num_threads=1", f"data.path={facts}", "train.exp_id=mine", f"train.init_from={source}",
                   f"optim.memory_finetune.background={background}")
    capsys.readouterr()
    assert continual_main(["score", str(mine), "--facts", str(facts)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["step"] == 320 and row["em_prior"] == 0.2 and row["fc_chance"] == pytest.approx(0.2)
    assert row["em"] > row["em_prior"] and row["fc"] > row["fc_shuffled"]


def test_a_malformed_facts_file_is_one_line(tmp_path):
    from xlm_pkm.experiments.facts import read_own_facts

    cases = {'{"statements": ["Smith leads."], "answer": "Smith"}': "'Smith leads.' must hold the answer 'Smith'",
             '{"statements": ["The leader is Smith.", "He leads."], "answer": "Smith"}': "does not hold the answer",
             '{"statements": ["a b"], "answer": "b", "relaton": "x"}': "unknown key(s) relaton",
             '{"statements": [], "answer": "b"}': "statements must be a non-empty list", "[1": "not JSON"}
    for line, message in cases.items():
        (tmp_path / "f.jsonl").write_text('{"statements": ["a b"], "answer": "b"}\n' + line + "\n")
        with pytest.raises(ValueError, match=re.escape("f.jsonl:2: ") + ".*" + re.escape(message)) as e:
            read_own_facts(tmp_path / "f.jsonl")
        assert "\n" not in str(e.value)


def test_facts_without_fastbpe_is_one_line_and_status_2(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """No fastBPE anywhere (no FASTBPE, no tools/fastbpe/fast, nothing on PATH): the facts command says so in one
    line and exits 2, as every command's one-line error (before: a traceback)."""
    from xlm_pkm.data import fastbpe
    from xlm_pkm.experiments.facts import main as facts_main

    monkeypatch.delenv("FASTBPE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(fastbpe, "REPO_ROOT", tmp_path)
    status = facts_main(["--from", str(REPO / "data/facts/example.jsonl"), "--out", str(tmp_path / "out"),
                         "--codes", str(tiny_data_dir / "codes"), "--vocab", str(tiny_data_dir / "vocab")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1].startswith("python -m xlm_pkm.experiments.facts: error: fastBPE command-line tool")
    assert not any("Traceback" in line for line in err)


def test_changes_from_a_baseline_are_points_and_perplexity_percent():
    from xlm_pkm.experiments.continual import changes

    got = changes({"em": 0.4, "fc": 0.8, "valid_ppl": 48.6, "test_acc": 0.25, "em_question": None},
                  {"em": 0.2, "fc": 0.2, "valid_ppl": 30.0, "test_acc": 0.3, "em_question": 0.1})
    assert got == {"em": {"baseline": 0.2, "change": 20.0, "unit": "points"},
                   "fc": {"baseline": 0.2, "change": 60.0, "unit": "points"},
                   "valid_ppl": {"baseline": 30.0, "change": 62.0, "unit": "percent"},
                   "test_acc": {"baseline": 0.3, "change": -5.0, "unit": "points"}}


def test_the_table_against_another_reference_answers_the_method_forgets_less():
    """--also-reference's table (method_less): the claim is "the method forgets less than the reference" (Lin et
    al.'s "LoRA forgets less than full finetuning"), so R < 1 holds and R > 1 is reversed, the same R and interval
    as the main table's claim "the reference forgets less" with the words swapped (issue 84)."""
    rows = [_row("memory", "pretrained", "-", 0, 0.0, test_ppl=20.0)]
    sweeps = {("full", "lr=1"): (0.4, (4.0, 5.0, 6.0)), ("full", "lr=2"): (0.8, (8.0, 10.0, 12.0)),
              ("less", "lr=1"): (0.4, (1.0, 1.1, 1.2)), ("less", "lr=2"): (0.8, (2.0, 2.2, 2.4)),
              ("more", "lr=1"): (0.4, (40.0, 52.0, 55.0)), ("more", "lr=2"): (0.8, (80.0, 90.0, 130.0))}
    for (method, setting), (em, changes) in sweeps.items():
        rows += [_row("memory", method, setting, seed, em, test_ppl=20.0 + change)
                 for seed, change in zip((3, 0, 1, 2), (changes[0], *changes))]
    claimed = common_em(rows, reference=("memory", "full"), levels=(0.6,), method_less=True)
    plain = common_em(rows, reference=("memory", "full"), levels=(0.6,))
    assert "R = Δ test ppl / full's [95%] (verdict: the method forgets less than full)" in claimed

    def cell(table, method):
        return next(line for line in table.splitlines() if f"| {method} |" in line).split(" | ")[-1]

    assert cell(claimed, "less").startswith("0.22 [") and "(holds, 3 seeds)" in cell(claimed, "less")
    assert "(reversed, 3 seeds)" in cell(plain, "less")
    assert "(reversed, 3 seeds)" in cell(claimed, "more") and "(holds, 3 seeds)" in cell(plain, "more")
    assert cell(claimed, "less").split(" (")[0] == cell(plain, "less").split(" (")[0]  # the same R and interval
