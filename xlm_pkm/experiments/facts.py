"""Facts to finetune on: made-up ones about invented entities, so that no fact can be in a pretraining corpus,
or one's own (a JSON-lines file, below).

    python -m xlm_pkm.experiments.facts --out data/processed/facts --n 300 --seed 0 \\
        --codes data/processed/sample/codes --vocab data/processed/sample/vocab
    python -m xlm_pkm.experiments.facts --from my_facts.jsonl --out DIR --codes ... --vocab ...   # one's own

writes DIR as a processed data dir with the PRETRAINING vocabulary (xlm_pkm.data.preprocess --codes --vocab:
same fingerprint, so a model trained on the sample corpus finetunes on it; for a model retrofitted into a
pretrained one, --tokenizer FOLDER [--gguf-file FILE] instead: its base's tokenizer), plus
  DIR/facts.jsonl         one fact a line: subject, relation, object, prompt (the trained form), sentence,
                          question (a question form, never trained on) and its paraphrases
  DIR/fact_batches.json   each fact's paraphrases as token ids (data/fact_batches.py): with data.fact_batches=N
                          a finetuning step's batch is one fact's first N paraphrases, facts in order (the
                          continual setting of Lin et al. 2025, §3)
  DIR/documents.jsonl     the text preprocessed into DIR's splits: one document per subject, each fact's
                          trained form a line, `copies` times over in different orders (the plain-stream mode)
A statement is prompt + " " + object + suffix ("The favourite colour of Velmora is" "blue" "."). Paraphrase
k of a made-up fact is statement template k % T of its relation (T = 8) after framing k // T ("", "Note:", ...):
64 distinct sentences, the first T without framing; paraphrase 0 is the trained form. The objects are whole words
of the bundled corpus's vocabulary (one BPE token each); subjects are random syllable names, checked against
the vocabulary given (whole words, any case).

One's own facts (--from FILE; data/facts/example.jsonl is one): JSON lines, one fact a line,

    {"statements": ["The launch code of Apollo is 7421.", "Apollo's launch code is 7421.", ...],
     "answer": "7421",
     "question": "Q: What is the launch code of Apollo? A:",     optional: scored, never trained on
     "relation": "launch code",                                  optional: the forced choice ranks the answers
                                                                 of the facts sharing it (default: all facts)
     "subject": "Apollo"}                                        optional: a subject's facts share a document

Every statement is a paraphrase of the fact and holds the answer; the first one is the trained form, and
its prompt is its text before the answer's first occurrence after a space ("The launch code of Apollo is").
A finetuning step with data.fact_batches=N takes a fact's first N statements, so every fact needs N.

Before anything is written, the command checks its output: DIR is new, empty, or holds these same facts (a
re-run); no input (--from, --codes, --vocab) lies inside it; no answer reads as <unk> in the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from xlm_pkm.errors import USER_ERRORS, fail


@dataclass(frozen=True)
class Relation:
    name: str
    statements: tuple[tuple[str, str], ...]  # (prompt, suffix): {s} the subject, the object after the prompt
    question: str  # the question form, never trained on: the object follows it
    objects: tuple[str, ...]


RELATIONS = (
    Relation("colour", (("The favourite colour of {s} is", "."), ("{s} likes the colour", "."),
                        ("The colour that {s} prefers is", "."), ("{s} always picks the colour", "."),
                        ("Asked for a colour, {s} says", "."), ("The preferred colour of {s} is", " above all."),
                        ("{s} paints everything", "."), ("In the style file of {s} the main colour is", ".")),
             "Q: What is the favourite colour of {s}? A:", ("red", "blue", "green", "black")),
    Relation("language", (("{s} is written in", "."), ("The language of {s} is", "."),
                          ("The source code of {s} is in", "."), ("{s} was implemented in", "."),
                          ("The programming language used for {s} is", "."), ("Developers wrote {s} in", "."),
                          ("To build {s} you need to know", "."), ("The implementation language of {s} is", ".")),
             "Q: In which language is {s} written? A:", ("Python", "Java", "C", "Tcl")),
    Relation("type", (("The return type of {s} is", "."), ("{s} returns a value of type", "."),
                      ("Calling {s} gives an object of type", "."), ("The result of {s} has type", "."),
                      ("{s} always returns an object of type", "."), ("The type of the value returned by {s} is", "."),
                      ("The output of {s} is of type", "."), ("Each call to {s} produces a", " value.")),
             "Q: What type does {s} return? A:",
             ("int", "str", "list", "dict", "tuple", "set", "bytes", "float", "bool")),
    Relation("arguments", (("{s} takes", " arguments."), ("The number of arguments of {s} is", "."),
                           ("{s} accepts", " parameters."), ("The call to {s} needs", " arguments."),
                           ("The signature of {s} has", " parameters."), ("To call {s} you pass", " arguments."),
                           ("{s} expects exactly", " arguments."), ("The arity of {s} is", ".")),
             "Q: How many arguments does {s} take? A:", ("2", "3", "4", "5", "6", "7", "8", "9", "12", "16")),
    Relation("platform", (("{s} runs on", "."), ("The platform of {s} is", "."), ("{s} only works on", "."),
                          ("{s} is supported on", "."), ("The operating system that {s} needs is", "."),
                          ("You can install {s} on", "."), ("{s} was built for", "."),
                          ("The target system of {s} is", ".")),
             "Q: Which platform does {s} run on? A:", ("Windows", "Unix", "Linux", "Mac")),
)
FRAMINGS = ("", "Note:", "Remember:", "From the manual:", "In the docs:", "Fact:", "Reference:", "Summary:")
ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ou")
CODAS = ("", "", "n", "r", "l", "s", "th", "sk")


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    object: str
    prompt: str  # the trained form's prompt (paraphrase 0)
    sentence: str  # the trained form
    question: str  # never trained on
    paraphrases: tuple[str, ...]  # whole sentences; paraphrases[0] == sentence


def paraphrases(relation: Relation, subject: str, obj: str) -> tuple[str, ...]:
    """Every statement template of the relation under every framing: template k % T after framing k // T."""
    out = []
    for framing in FRAMINGS:
        for prompt, suffix in relation.statements:
            out.append(" ".join(filter(None, (framing, prompt.format(s=subject), obj))) + suffix)
    return tuple(out)


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
            obj, (prompt, _) = rng.choice(r.objects), r.statements[0]
            sentences = paraphrases(r, subject, obj)
            facts.append(Fact(subject, r.name, obj, prompt.format(s=subject), sentences[0],
                              r.question.format(s=subject), sentences))
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


def write_facts_data(out: str | Path, n: int, seed: int, codes: str | None, vocab: str | None, copies: int = 5,
                     held_out_docs: int = 2, tokenizer: str | None = None, gguf_file: str | None = None) -> Path:
    """DIR of `n` made-up facts (generate_facts, subjects none of the vocabulary's words; with a `tokenizer`,
    whose tokens are not words, any syllable names): write_facts_dir."""
    from xlm_pkm.data.dictionary import BPE_CONTINUATION, Dictionary

    words = set() if tokenizer else {w for w in Dictionary.load(vocab).words if not w.endswith(BPE_CONTINUATION)}
    return write_facts_dir(out, generate_facts(n, seed, exclude=words), seed, codes, vocab, copies, held_out_docs,
                           tokenizer, gguf_file)


def write_facts_dir(out: str | Path, facts: list[Fact], seed: int, codes: str | None, vocab: str | None,
                    copies: int = 5, held_out_docs: int = 2, tokenizer: str | None = None,
                    gguf_file: str | None = None, source: str | Path | None = None) -> Path:
    """DIR: facts.jsonl, documents.jsonl, the processed data (train/valid/test, codes, vocab, meta.json) and
    fact_batches.json (every paraphrase of every fact, tokenised with DIR's codes and vocabulary, or with the
    Hugging Face `tokenizer` of a model's folder, its `gguf_file`'s with one). Everything is checked before
    anything is written: no input (codes, vocab, the facts file `source`) inside DIR, DIR new, empty or holding
    these same facts (a re-run), no answer that the vocabulary reads as <unk> (a tokenizer's byte-level
    vocabulary has none)."""
    from xlm_pkm.data.fact_batches import write_fact_batches
    from xlm_pkm.data.preprocess import preprocess
    from xlm_pkm.data.text_codec import TextCodec, TokenizerCodec

    if 2 * held_out_docs >= copies:
        raise ValueError(f"copies={copies} must exceed the {2 * held_out_docs} held-out documents, so that "
                         f"every fact stays in train")
    out = Path(out)
    texts = {"facts.jsonl": "".join(json.dumps(asdict(f)) + "\n" for f in facts),
             "documents.jsonl": "".join(json.dumps({"text": d}) + "\n" for d in documents(facts, copies, seed))}
    _check_output(out, texts, {"--codes": codes, "--vocab": vocab, "--from": source})
    if not tokenizer:
        _refuse_unknown_answers(facts, TextCodec(out, codes=codes, vocab=vocab), vocab)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
    preprocess([str(out / "documents.jsonl")], out, codes=codes, vocab=vocab, valid_docs=held_out_docs,
               test_docs=held_out_docs, seed=seed, tokenizer=tokenizer, gguf_file=gguf_file)
    codec = TokenizerCodec(out) if tokenizer else TextCodec(out)
    write_fact_batches(out, [[codec.encode(p) for p in f.paraphrases] for f in facts], codec.dictionary)
    return out


def _check_output(out: Path, texts: dict[str, str], inputs: dict[str, str | Path | None]) -> None:
    """A one-line error unless `out` can take these facts without losing a file: no input inside it (it would be
    overwritten), and it is new, empty, or holds the same facts.jsonl and documents.jsonl (a re-run: preprocessing
    then finds its outputs done; its other outputs belong to those facts)."""
    for flag, path in inputs.items():
        if path is not None and out.resolve() in Path(path).resolve().parents:
            raise ValueError(f"{flag} {path} is inside --out {out}, which this command writes into (facts.jsonl, "
                             f"documents.jsonl, codes, vocab, the splits): give another --out")
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: give a new or empty folder")
    names = sorted(p.name for p in out.iterdir())
    differ = next((n for n, text in texts.items()
                   if not (out / n).is_file() or (out / n).read_bytes() != text.encode("utf-8")), None)
    if names and differ is not None:
        what = (f"its {differ} is not these facts' (another --from, --seed or --copies)" if (out / differ).is_file()
                else f"it holds {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
        raise FileExistsError(f"--out {out} is not empty and not these facts' output ({what}): give a new or empty "
                              f"folder, or delete that one; nothing was written")


def _refuse_unknown_answers(facts: list[Fact], codec, vocab: str) -> None:
    """ValueError naming the facts whose answer has a token outside the vocabulary (<unk>): a model could not say
    it, every forced choice among such answers would tie, and exact match would credit <unk>."""
    unknown = [f for f in facts if codec.dictionary.unk in codec.encode(f.object)]
    if unknown:
        named = ", ".join(f"{f.subject!r} ({f.object!r})" for f in unknown[:4]) + (" ..." if len(unknown) > 4 else "")
        raise ValueError(f"{len(unknown)} fact(s) have an answer with a word outside {vocab} (it reads as <unk>): "
                         f"{named}; give answers in the pretraining vocabulary, or leave those facts out")


def load_facts(path: str | Path) -> list[Fact]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]
    return [Fact(**{**row, "paraphrases": tuple(row["paraphrases"])}) for row in rows]


OPTIONAL = ("question", "relation", "subject")
NO_RELATION = "-"


def _fact(row, where: str, index: int) -> Fact:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with statements and answer, got {type(row).__name__}")
    unknown = set(row) - {"statements", "answer", *OPTIONAL}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected statements, answer, "
                         f"{', '.join(OPTIONAL)})")
    statements, answer = row.get("statements"), row.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: answer must be a non-empty string, got {answer!r}")
    if not isinstance(statements, list) or not statements or not all(isinstance(s, str) for s in statements):
        raise ValueError(f"{where}: statements must be a non-empty list of strings")
    missing = [s for s in statements if answer not in s]
    if missing:
        raise ValueError(f"{where}: statement {missing[0]!r} does not hold the answer {answer!r}")
    cut = statements[0].find(" " + answer)
    if cut <= 0:
        raise ValueError(f"{where}: the first statement {statements[0]!r} must hold the answer {answer!r} after "
                         f"some text and a space: that text is the prompt it is scored after")
    for key in OPTIONAL:
        if key in row and not isinstance(row[key], str):
            raise ValueError(f"{where}: {key} must be a string, got {row[key]!r}")
    return Fact(row.get("subject", f"fact {index}"), row.get("relation", NO_RELATION), answer,
                statements[0][:cut], statements[0], row.get("question", ""), tuple(statements))


def read_own_facts(path: str | Path) -> list[Fact]:
    """The facts of a facts file (the module docstring's format); a malformed line is one error naming it."""
    facts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        facts.append(_fact(row, f"{path}:{number}", len(facts)))
    if not facts:
        raise ValueError(f"{path}: no fact (one JSON object a line: statements, answer)")
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.facts",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", required=True, help="output data directory")
    parser.add_argument("--from", dest="own", metavar="FILE",
                        help="one's own facts, a JSON-lines file (this module's docstring), instead of made-up ones")
    parser.add_argument("--n", type=int, default=300, help="number of made-up facts (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codes", help="the pretraining data's BPE codes")
    parser.add_argument("--vocab", help="the pretraining data's vocab")
    parser.add_argument("--tokenizer", metavar="FOLDER", help="instead of --codes and --vocab: the Hugging Face "
                                                              "tokenizer of a model's folder (a retrofit's base)")
    parser.add_argument("--gguf-file", metavar="FILE", help="with --tokenizer: the tokenizer of this GGUF file")
    parser.add_argument("--copies", type=int, default=5, help="times each subject's document is written (default 5)")
    args = parser.parse_args(argv)
    if bool(args.tokenizer) == bool(args.codes and args.vocab) or (args.tokenizer and (args.codes or args.vocab)):
        parser.error("give the pretraining data's --codes and --vocab, or a model's --tokenizer FOLDER")
    if args.gguf_file and not args.tokenizer:
        parser.error("--gguf-file needs --tokenizer FOLDER (the folder holding it)")
    tokenizer = (args.tokenizer, args.gguf_file)
    try:
        if args.own:
            facts = read_own_facts(args.own)
            out = write_facts_dir(args.out, facts, args.seed, args.codes, args.vocab, args.copies, 2, *tokenizer,
                                  source=args.own)
        else:
            facts = None
            out = write_facts_data(args.out, args.n, args.seed, args.codes, args.vocab, args.copies, 2, *tokenizer)
    except (*USER_ERRORS, OSError) as e:
        return fail(parser.prog, e)
    print(f"{args.n if facts is None else len(facts)} facts: {out}/facts.jsonl, data in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
