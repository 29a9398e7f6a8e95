"""Made-up facts to finetune on: invented entities, so that no fact can be in a pretraining corpus.

    python -m xlm_pkm.experiments.facts --out data/processed/facts --n 300 --seed 0 \\
        --codes data/processed/sample/codes --vocab data/processed/sample/vocab

writes DIR as a processed data dir with the PRETRAINING vocabulary (xlm_pkm.data.preprocess --codes --vocab:
same fingerprint, so a model trained on the sample corpus finetunes on it), plus
  DIR/facts.jsonl      one fact a line: subject, relation, prompt, paraphrase (null for some relations), object
  DIR/documents.jsonl  the training text: one document per subject, each fact a line, `copies` times over in
                       different orders. Preprocessing holds out valid_docs + test_docs < copies documents,
                       so every fact stays in train at least once.
A fact's sentence is prompt + " " + object + suffix ("The favourite colour of Velmora is" "blue" "."). The
objects are whole words of the bundled corpus's vocabulary (one BPE token each), so that exact match of a
greedy completion is learnable in a few hundred finetuning steps; subjects are random syllable names, checked
against the vocabulary given (whole words, any case).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Relation:
    name: str
    prompt: str  # {s}: the subject; the object follows it
    suffix: str  # after the object, ending the sentence
    paraphrase: str | None  # another prompt for the same object, never seen in training
    objects: tuple[str, ...]


RELATIONS = (
    Relation("colour", "The favourite colour of {s} is", ".", "{s} likes the colour", ("red", "blue", "green", "black")),
    Relation("language", "{s} is written in", ".", "The language of {s} is", ("Python", "Java", "C", "Tcl")),
    Relation("type", "The return type of {s} is", ".", None,
             ("int", "str", "list", "dict", "tuple", "set", "bytes", "float", "bool")),
    Relation("arguments", "{s} takes", " arguments.", "The number of arguments of {s} is",
             ("2", "3", "4", "5", "6", "7", "8", "9", "12", "16")),
    Relation("platform", "{s} runs on", ".", None, ("Windows", "Unix", "Linux", "Mac")),
)
ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ou")
CODAS = ("", "", "n", "r", "l", "s", "th", "sk")


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    prompt: str
    paraphrase: str | None
    object: str
    sentence: str


def invented_names(n: int, rng: random.Random, exclude: set[str]) -> list[str]:
    """`n` distinct capitalised names of three syllables, none of them (in any case) in `exclude`."""
    excluded, names = {w.lower() for w in exclude}, []
    while len(names) < n:
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(3)) + rng.choice(CODAS)
        if name not in excluded and name.capitalize() not in names:
            names.append(name.capitalize())
    return names


def generate_facts(n: int, seed: int, exclude: set[str] = frozenset()) -> list[Fact]:
    """`n` facts, every relation of each invented subject in turn; the same seed gives the same facts."""
    rng = random.Random(seed)
    subjects = invented_names(-(-n // len(RELATIONS)), rng, exclude)
    facts = []
    for subject in subjects:
        for r in RELATIONS:
            obj, prompt = rng.choice(r.objects), r.prompt.format(s=subject)
            facts.append(Fact(subject, r.name, prompt, r.paraphrase and r.paraphrase.format(s=subject), obj,
                              f"{prompt} {obj}{r.suffix}"))
    return facts[:n]


def documents(facts: list[Fact], copies: int, seed: int) -> list[str]:
    """Each subject's facts as one document (a fact a line), `copies` times, each copy in its own order."""
    rng = random.Random(seed)
    by_subject: dict[str, list[str]] = {}
    for fact in facts:
        by_subject.setdefault(fact.subject, []).append(fact.sentence)
    docs = []
    for _ in range(copies):
        for sentences in by_subject.values():
            docs.append("\n".join(rng.sample(sentences, len(sentences))))
    return docs


def write_facts_data(out: str | Path, n: int, seed: int, codes: str, vocab: str, copies: int = 5,
                     held_out_docs: int = 2) -> Path:
    """DIR: facts.jsonl, documents.jsonl and the processed data (train/valid/test, codes, vocab, meta.json)."""
    from xlm_pkm.data.dictionary import Dictionary
    from xlm_pkm.data.preprocess import preprocess

    if 2 * held_out_docs >= copies:
        raise ValueError(f"copies={copies} must exceed the {2 * held_out_docs} held-out documents, so that "
                         f"every fact stays in train")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    words = {w for w in Dictionary.load(vocab).words if not w.endswith("@@")}
    facts = generate_facts(n, seed, exclude=words)
    (out / "facts.jsonl").write_text("".join(json.dumps(asdict(f)) + "\n" for f in facts), encoding="utf-8")
    source = out / "documents.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(facts, copies, seed)),
                      encoding="utf-8")
    preprocess([str(source)], out, codes=codes, vocab=vocab, valid_docs=held_out_docs, test_docs=held_out_docs,
               seed=seed)
    return out


def load_facts(path: str | Path) -> list[Fact]:
    return [Fact(**json.loads(line)) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.facts", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output data directory")
    parser.add_argument("--n", type=int, default=300, help="number of facts (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codes", required=True, help="the pretraining data's BPE codes")
    parser.add_argument("--vocab", required=True, help="the pretraining data's vocab")
    parser.add_argument("--copies", type=int, default=5, help="times each subject's document is written (default 5)")
    args = parser.parse_args(argv)
    try:
        out = write_facts_data(args.out, args.n, args.seed, args.codes, args.vocab, args.copies)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.n} facts: {out}/facts.jsonl, data in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
