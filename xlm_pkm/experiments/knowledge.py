"""What a model already knew: greedy exact match on simple world-knowledge questions, and how much of what its
baseline knew a finetuned model still knows (the continual study's second forgetting measure, beside perplexity
on held-out text).

    questions = read_own_facts("data/knowledge/world.jsonl")     # facts.py's format: each question is a statement,
                                                                 # scored after its text before the answer
    scores = knowledge_scores(model, codec, questions)           # knowledge_em, knowledge_hits ("0110...")
    knowledge_kept(scores["knowledge_hits"], baseline_hits)      # EM over the questions the baseline answered

A question is answered when greedy decoding after its prompt produces the answer's tokens under the model's codec
(fact_scores.greedy_matches; a retrofit's data dir holds its base's tokenizer). The hits are a string of 0/1 in
file order, so that a row remembered for a baseline says which questions it answered; knowledge_kept is the
fraction of those that a finetuned model still answers (None when the baseline answered none).
"""

from __future__ import annotations

from xlm_pkm.data.text_codec import Codec
from xlm_pkm.experiments.fact_scores import greedy_matches, prompt_and_object
from xlm_pkm.experiments.facts import Fact


def knowledge_scores(model, codec: Codec, questions: list[Fact]) -> dict:
    """knowledge_em (the fraction of questions whose answer greedy decoding completes after the prompt) and
    knowledge_hits (each question's outcome, 0 or 1, in order)."""
    pairs = [prompt_and_object(codec, q.prompt, q.object) for q in questions]
    hits = greedy_matches(model, pairs, codec.dictionary.pad)
    return {"knowledge_em": sum(hits) / len(hits), "knowledge_hits": "".join(str(int(h)) for h in hits)}


def knowledge_kept(hits: str, baseline_hits: str) -> float | None:
    """The fraction of the questions the baseline answered (a 1 in baseline_hits) that `hits` answers too; None
    when the baseline answered none."""
    if len(hits) != len(baseline_hits):
        raise ValueError(f"knowledge hits of {len(hits)} questions against a baseline's of {len(baseline_hits)}: "
                         f"score both on the same --knowledge file")
    known = [h for h, b in zip(hits, baseline_hits) if b == "1"]
    return known.count("1") / len(known) if known else None
