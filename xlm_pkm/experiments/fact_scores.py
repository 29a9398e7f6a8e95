"""How much of a facts file a model has learnt: exact match, forced choice, and the controls that say
whether it is above chance.

Exact match (EM): the greedy completion of each fact's object after its trained prompt (and after its
question form, never trained on). Greedy decoding produces the object's tokens iff the argmax after the
prompt and each gold prefix of the object is the next gold token, so one teacher-forced forward per batch
decides it (the batch right-padded: the model is causal).

A model that learnt only which objects go with a relation already scores EM at the subject-blind guess
(em_prior: each relation's most common object). What shows facts learnt about the subjects:

    forced choice (fc)  the gold object ranked first among its relation's objects (those of the facts file)
                        by log p(o | prompt) = Σ_j log p(o_j | prompt, o_<j), the continuation's summed token
                        log-likelihood (a multi-token object: every token counts, no length normalisation);
                        a tie at the top with k - 1 others scores 1/k (random tie-breaking's expectation);
                        chance (fc_chance) is the mean over facts of 1 / (objects of the fact's relation)
    shuffled subjects   the same EM and ranking after the prompt of another fact of the same relation, the
    (em/fc_shuffled)    gold staying this fact's object (the subjects permuted among the facts: a seeded
                        derangement within each relation): a model that learnt only relation -> object
                        priors scores there as on the true prompts; one that learnt the facts, less
    uncommon            EM and fc on the facts whose object is not its relation's most common one (with
    (em/fc_uncommon)    ties, not any of the most common): the subject-blind guess scores 0 there
    by position         EM on the first, middle and last third of the facts in file order, the order they
    (em_first, ...)     were trained in (facts [0, n/3), [n/3, 2n/3), [2n/3, n), rounded down): retention
                        of early facts against their overwriting by later ones

and, fact by fact in file order (per_fact), the outcomes the own-against-shuffled comparison pairs: em and
em_shuffled as strings of 0/1, fc and fc_shuffled as credits.
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from xlm_pkm.data.text_codec import Codec
from xlm_pkm.experiments.facts import Fact

THIRDS = ("first", "middle", "last")


def prompt_and_object(codec: Codec, prompt: str, obj: str) -> tuple[list[int], list[int]]:
    """(ids of <s> + the prompt, ids of the object that follows it), tokenised as in training."""
    prompt_ids, full = codec.encode(prompt), codec.encode(f"{prompt} {obj}")
    if full[:len(prompt_ids)] != prompt_ids:
        raise ValueError(f"{prompt!r} is tokenised differently when followed by {obj!r}")
    return prompt_ids, full[len(prompt_ids):]


def _padded(pairs: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """(B, T) prompt + object[:-1] of each pair, right-padded."""
    tokens = torch.full((len(pairs), max(len(p) + len(o) for p, o in pairs) - 1), pad, dtype=torch.long)
    for row, (p, o) in enumerate(pairs):
        seq = (p + o)[:-1]
        tokens[row, :len(seq)] = torch.tensor(seq)
    return tokens


@torch.no_grad()
def greedy_matches(model, pairs: list[tuple[list[int], list[int]]], pad: int, batch_size: int = 64) -> list[bool]:
    """For each (prompt ids, object ids): whether greedy decoding after the prompt produces the object."""
    model.eval()
    device = next(model.parameters()).device
    matches = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start:start + batch_size]
        predicted = model(_padded(batch, pad).to(device)).argmax(-1).cpu()  # (B, T): the greedy next tokens
        for row, (p, o) in enumerate(batch):
            matches.append(predicted[row, len(p) - 1:len(p) - 1 + len(o)].tolist() == o)
    return matches


@torch.no_grad()
def continuation_logliks(model, pairs: list[tuple[list[int], list[int]]], pad: int,
                         batch_size: int = 64) -> list[float]:
    """For each (prompt ids, object ids): Σ_j log p(o_j | prompt, o_<j), from one forward per batch."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start:start + batch_size]
        logp = model(_padded(batch, pad).to(device)).double().log_softmax(-1).cpu()  # (B, T, V)
        for row, (p, o) in enumerate(batch):
            positions = torch.arange(len(p) - 1, len(p) - 1 + len(o))
            out.append(float(logp[row, positions, torch.tensor(o)].sum()))
    return out


def exact_match(model, codec: Codec, facts: list[Fact], question: bool = False) -> float:
    """Fraction of facts whose object greedy decoding completes after the trained prompt (or the question)."""
    pairs = [prompt_and_object(codec, f.question if question else f.prompt, f.object) for f in facts]
    return sum(greedy_matches(model, pairs, codec.dictionary.pad)) / len(pairs)


def candidates(facts: list[Fact]) -> dict[str, list[str]]:
    """Relation -> its objects among `facts`, sorted: the choices of the forced choice."""
    objects: dict[str, set[str]] = {}
    for f in facts:
        objects.setdefault(f.relation, set()).add(f.object)
    return {relation: sorted(o) for relation, o in objects.items()}


def choice_credits(gold: float, others: list[float]) -> float:
    """1 / k when the gold's score is the highest, tied with k - 1 others; 0 when another is higher."""
    return 0.0 if any(o > gold for o in others) else 1 / (1 + sum(o == gold for o in others))


def forced_choice(model, codec: Codec, facts: list[Fact], prompts: list[str]) -> list[float]:
    """Per fact, its credit (choice_credits) when its relation's objects are ranked by their log-likelihood
    after prompts[i] (the fact's own prompt, or another's for the shuffled control)."""
    choices = candidates(facts)
    pairs, spans = [], []
    for f, prompt in zip(facts, prompts):
        spans.append((len(pairs), choices[f.relation]))
        pairs += [prompt_and_object(codec, prompt, o) for o in choices[f.relation]]
    scores = continuation_logliks(model, pairs, codec.dictionary.pad)
    credits = []
    for f, (start, objects) in zip(facts, spans):
        own = scores[start:start + len(objects)]
        gold = objects.index(f.object)
        credits.append(choice_credits(own[gold], own[:gold] + own[gold + 1:]))
    return credits


def shuffled_partners(facts: list[Fact], seed: int = 0) -> list[int]:
    """For each fact, the index of another fact of its relation whose prompt it is scored after: within each
    relation the facts in a seeded random order, each taking the next one's prompt (a derangement; a
    relation with one fact keeps its own)."""
    rng, partner = random.Random(seed), list(range(len(facts)))
    by_relation: dict[str, list[int]] = {}
    for i, f in enumerate(facts):
        by_relation.setdefault(f.relation, []).append(i)
    for members in by_relation.values():
        order = rng.sample(members, len(members))
        for i, j in zip(order, order[1:] + order[:1]):
            partner[i] = j
    return partner


def most_common_objects(facts: list[Fact]) -> dict[str, set[str]]:
    """Relation -> its most common object(s) among `facts` (every one tied at the top)."""
    counts: dict[str, Counter] = {}
    for f in facts:
        counts.setdefault(f.relation, Counter())[f.object] += 1
    return {relation: {o for o, n in c.items() if n == max(c.values())} for relation, c in counts.items()}


def prior_em(facts: list[Fact]) -> float:
    """EM of a guess that ignores the subject: each relation's most frequent object. A model above it has
    learnt something about the subjects, not only which objects go with which relation."""
    counts: dict[str, Counter] = {}
    for f in facts:
        counts.setdefault(f.relation, Counter())[f.object] += 1
    return sum(max(c.values()) for c in counts.values()) / len(facts)


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def fact_scores(model, codec: Codec, facts: list[Fact], shuffle_seed: int = 0) -> dict:
    """Every score of the module docstring, each a fraction of the facts it covers (None: no fact, e.g. no
    question given); em_question and fc_question over the facts with a question; per_fact."""
    pad = codec.dictionary.pad
    hits = greedy_matches(model, [prompt_and_object(codec, f.prompt, f.object) for f in facts], pad)
    credits = forced_choice(model, codec, facts, [f.prompt for f in facts])
    partner = shuffled_partners(facts, shuffle_seed)
    shuffled = [prompt_and_object(codec, facts[j].prompt, f.object) for f, j in zip(facts, partner)]
    shuffled_hits = greedy_matches(model, shuffled, pad)
    shuffled_credits = forced_choice(model, codec, facts, [facts[j].prompt for j in partner])
    asked = [f for f in facts if f.question]
    common = most_common_objects(facts)
    uncommon = [i for i, f in enumerate(facts) if f.object not in common[f.relation]]
    choices = candidates(facts)
    n = len(facts)
    out = {"em": _mean(hits), "em_question": exact_match(model, codec, asked, question=True) if asked else None,
           "fc": _mean(credits),
           "fc_question": _mean(forced_choice(model, codec, asked, [f.question for f in asked])) if asked else None,
           "em_shuffled": _mean(shuffled_hits), "fc_shuffled": _mean(shuffled_credits),
           "em_uncommon": _mean([hits[i] for i in uncommon]), "fc_uncommon": _mean([credits[i] for i in uncommon]),
           "em_prior": prior_em(facts), "fc_chance": _mean([1 / len(choices[f.relation]) for f in facts])}
    for third, (lo, hi) in zip(THIRDS, ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n))):
        out[f"em_{third}"] = _mean(hits[lo:hi])
    per_fact = {"em": "".join(str(int(h)) for h in hits), "em_shuffled": "".join(str(int(h)) for h in shuffled_hits),
                "fc": [round(c, 4) for c in credits], "fc_shuffled": [round(c, 4) for c in shuffled_credits]}
    return {**{key: None if value is None else float(value) for key, value in out.items()}, "per_fact": per_fact}
