"""What the base knew (experiments/knowledge.py): the shipped world-knowledge questions, their greedy EM against
generation token by token on a tiny random Llama retrofit, and knowledge kept over exactly the questions the
baseline answered, through `continual score --knowledge --baseline`."""

import json
import re
from pathlib import Path

import pytest
import torch

from xlm_pkm.experiments.fact_scores import prompt_and_object
from xlm_pkm.experiments.facts import Fact, read_own_facts
from xlm_pkm.experiments.knowledge import knowledge_kept, knowledge_scores

REPO = Path(__file__).resolve().parents[1]
WORLD = REPO / "data" / "knowledge" / "world.jsonl"


def test_the_shipped_questions_are_one_statement_each_scored_after_the_text_before_its_answer():
    questions = read_own_facts(WORLD)
    assert 300 <= len(questions) <= 400
    assert len({q.prompt for q in questions}) == len(questions)  # no question twice
    for q in questions:
        assert q.paraphrases == (q.sentence,) and q.relation != "-" and not q.question
        assert re.fullmatch(r"( \w+)?\.", q.sentence.removeprefix(f"{q.prompt} {q.object}")), q.sentence
        assert 1 <= len(q.object.split()) <= 4, q.object


def naive_answers(model, codec, question: Fact) -> bool:
    """Greedy decoding after the prompt, one full forward per token, against the answer's tokens."""
    ids = codec.encode(question.prompt)
    answer = codec.encode(f"{question.prompt} {question.object}")[len(ids):]
    for token in answer:
        with torch.no_grad():
            predicted = int(model(torch.tensor([ids]))[0, -1].argmax())
        if predicted != token:
            return False
        ids.append(predicted)
    return True


def own_continuations(model, codec, questions: list[Fact]) -> list[Fact]:
    """Questions the model answers, beside the shipped ones it does not: after each distinct word prefix of the
    questions' statements, its greedy word when it is one (a token after a space, and the next one too when it
    continues the word) that tokenises back alike."""
    out, prompts = [], dict.fromkeys(" ".join(q.sentence.split()[:k]) for q in questions
                                     for k in range(1, len(q.sentence.split())))
    for prompt in prompts:
        ids = codec.encode(prompt)
        for _ in range(2):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        first, both = (codec.decode(ids[len(ids) - 2:len(ids) - n]) for n in (1, 0))
        for text, n in ((both, 2), (first, 1)):
            if text.startswith(" ") and text[1:].isalpha() and codec.encode(prompt + text) == ids[:len(ids) - 2 + n]:
                sentence = f"{prompt}{text}."
                out.append(Fact(prompt, "own", text[1:], prompt, sentence, "", (sentence,)))
                break
    return out


@pytest.mark.slow
def test_knowledge_em_is_greedy_generation_token_by_token_on_a_retrofit(tiny_base, tiny_base_data):
    """The shipped questions tokenised by a retrofit's tokenizer, scored in right-padded batches, against one
    sequence at a time; the memory wired in (its gate open), and questions the model answers among them."""
    from xlm_pkm.config import load_config
    from xlm_pkm.data.text_codec import text_codec
    from xlm_pkm.model.retrofit import RetrofitLM, load_base, resolved

    cfg = load_config(None, [f"model.base.path={tiny_base}", "model.base.layers=[1]", "model.memory.n_keys=8",
                             "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
                             "model.memory.query_norm=layernorm"]).model
    torch.manual_seed(0)
    model = RetrofitLM(resolved(cfg), load_base(cfg.base)).eval()
    with torch.no_grad():
        model.beside["1"].gate.fill_(0.5)
    codec = text_codec(tiny_base_data, "tokenizer")
    shipped = read_own_facts(WORLD)
    for q in shipped:  # every question tokenises alike with and without its answer (else one-line error)
        prompt_and_object(codec, q.prompt, q.object)
    questions = shipped[::8] + own_continuations(model, codec, shipped[:100])
    expected = [naive_answers(model, codec, q) for q in questions]
    assert 5 <= sum(expected) < len(expected)
    scores = knowledge_scores(model, codec, questions)
    assert scores["knowledge_hits"] == "".join(str(int(e)) for e in expected)
    assert scores["knowledge_em"] == sum(expected) / len(expected)


def test_knowledge_kept_is_the_em_over_the_baseline_s_answered_questions():
    assert knowledge_kept("110100", "100110") == pytest.approx(2 / 3)  # the baseline answered 0, 3, 4
    assert knowledge_kept("011", "100") == 0.0 and knowledge_kept("111", "000") is None
    with pytest.raises(ValueError, match="4 questions against a baseline's of 3"):
        knowledge_kept("0101", "010")


def _greedy_word(model, codec, prompt: str) -> str | None:
    """The model's greedy next token after `prompt` when it is a whole word that tokenises back alone."""
    with torch.no_grad():
        token = int(model(torch.tensor([codec.encode(prompt)]))[0, -1].argmax())
    word = codec.dictionary[token]
    return word if word.isalpha() and prompt_and_object(codec, prompt, word)[1] == [token] else None


@pytest.mark.slow
def test_continual_score_keeps_the_baseline_s_answers_and_remembers_them(finetune_source, tiny_corpus, tiny_data_dir,
                                                                          tmp_path, capsys):
    """A hand-made file whose answers are the baseline's greedy words on some questions and another model's on
    others: the baseline answers exactly the first set, and knowledge_kept is the other model's EM over that set
    alone (against one-at-a-time scoring); the baseline's row is remembered with the file's hash."""
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.data.text_codec import TextCodec
    from xlm_pkm.experiments.continual import main as continual_main
    from xlm_pkm.experiments.facts import write_facts_dir

    own = tmp_path / "facts.jsonl"
    own.write_text(json.dumps({"statements": ["The module is written in Python."], "answer": "Python"}) + "\n")
    facts = write_facts_dir(tmp_path / "facts", read_own_facts(own), 0, str(tiny_data_dir / "codes"),
                            str(tiny_data_dir / "vocab"))
    base_path, other_path = finetune_source[0], tmp_path / "other.pt"
    state = torch.load(base_path, weights_only=False)
    torch.manual_seed(0)
    state["model"] = {k: v + 0.5 * v.std() * torch.randn_like(v) if v.is_floating_point() and v.numel() > 1 else v
                      for k, v in state["model"].items()}  # another model of the same kind: its own greedy words
    torch.save(state, other_path)
    codec = TextCodec(facts)
    base, other = (load_trained(p, facts).model for p in (base_path, other_path))
    lines = [line for doc in tiny_corpus.read_text().splitlines() for line in json.loads(doc)["text"].splitlines()
             if len(line.split()) > 6]
    rows, known = [], []
    for prompt in (" ".join(line.split()[:k]) for line in lines[:40] for k in (2, 3)):
        if len(codec.encode(prompt)) >= 12:  # the tiny model reads 16 positions
            continue
        words = _greedy_word(base, codec, prompt), _greedy_word(other, codec, prompt)
        for word in dict.fromkeys(w for w in words if w):
            if f" {word}" not in prompt:
                rows.append({"statements": [f"{prompt} {word}."], "answer": word, "relation": "greedy"})
                known.append(word == words[0])
    assert sum(known) >= 3 and not all(known)
    world = tmp_path / "world.jsonl"
    world.write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = read_own_facts(world)
    other_hits = [naive_answers(other, codec, q) for q in questions]
    assert all(h for h, k in zip(other_hits, known) if not k)  # answered, and not the baseline's: left out of kept
    kept = sum(h for h, k in zip(other_hits, known) if k) / sum(known)
    capsys.readouterr()
    for scored in ("scored", "remembered"):
        assert continual_main(["score", str(other_path), "--facts", str(facts), "--knowledge", str(world),
                               "--baseline", str(base_path)]) == 0, scored
        row = json.loads(capsys.readouterr().out)
        assert row["knowledge_hits"] == "".join(str(int(h)) for h in other_hits)
        assert row["knowledge_em"] == pytest.approx(sum(other_hits) / len(other_hits))
        assert row["knowledge_kept"] == pytest.approx(kept)
        baseline = row["change"]["knowledge_em"]
        assert baseline["baseline"] == pytest.approx(sum(known) / len(known)) and baseline["unit"] == "points"
    remembered = [json.loads(line) for line in (facts / "baseline_scores.jsonl").read_text().splitlines()]
    assert len(remembered) == 1 and remembered[0]["row"]["knowledge_hits"] == "".join(str(int(k)) for k in known)
    assert len(remembered[0]["key"]["knowledge"]) == 32  # the file's blake2b: another file is scored anew


@pytest.mark.slow
def test_the_report_gives_knowledge_kept_from_the_pretrained_row_where_rows_have_hits(tmp_path):
    """Rows scored with --knowledge: knowledge kept from the pretrained row of the same seed (a column of the
    sweep and of the seeds' table); rows without hits (an older scores file) leave the report as it was."""
    from xlm_pkm.experiments.continual_report import over_seeds, with_changes, write_report

    def row(method, setting, seed, em, hits=None):
        out = {"model": "memory", "method": method, "setting": setting, "seed": seed, "em": em, "fc": em,
               "valid_ppl": 20.0, "test_ppl": 25.0 + em, "test_acc": 0.3}
        return out if hits is None else {**out, "knowledge_hits": hits, "knowledge_em": hits.count("1") / len(hits)}

    rows = [row("pretrained", "-", 0, 0.0, "1110"), row("pretrained", "-", 1, 0.0, "0111"),
            row("pretrained", "-", 3, 0.0, "1111"), row("sparse", "t=1", 0, 0.5, "1001"),
            row("sparse", "t=1", 1, 0.5, "0111"), row("sparse", "t=1", 3, 0.5, "0001")]
    kept = [r.get("knowledge_kept") for r in with_changes(rows)]
    assert kept == [1.0, 1.0, 1.0, pytest.approx(1 / 3), 1.0, 0.25]  # over the base's own 1s: 1 of 3, 3 of 3
    sparse = {r["method"]: r for r in over_seeds(rows)}["sparse"]
    assert sparse["knowledge_kept"] == pytest.approx(2 / 3) and sparse["knowledge_kept_sd"] > 0
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(results, tmp_path / "with").read_text()
    assert "knowledge kept: the EM over the world-knowledge questions" in report
    assert "| memory | sparse | t=1 | 50.0% | · | 50.0% | · | · | +0.00 | +0.50 | +0.00 | 25.0% |" in report
    assert "| Δ test acc | knowledge kept |" in report and "66.7 ± 47.1% |" in report
    results.write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("knowledge")}) + "\n"
                               for r in rows))
    assert "knowledge" not in write_report(results, tmp_path / "without").read_text()
