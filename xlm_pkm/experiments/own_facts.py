"""A facts file of one's own: the facts to teach a model, read into the Facts the study's tools take.

JSON lines, one fact a line:

    {"statements": ["The launch code of Apollo is 7421.", "Apollo's launch code is 7421.", ...],
     "answer": "7421",
     "question": "Q: What is the launch code of Apollo? A:",     optional: scored, never trained on
     "relation": "launch code",                                  optional: the forced choice ranks the answers
                                                                 of the facts sharing it (default: all facts)
     "subject": "Apollo"}                                        optional: a subject's facts share a document

Every statement is a paraphrase of the fact and holds the answer; the first one is the trained form, and
its prompt is its text before the answer's first occurrence after a space ("The launch code of Apollo is").
A finetuning step with data.fact_batches=N takes a fact's first N statements, so every fact needs N.
`python -m xlm_pkm.experiments.facts --from FILE --out DIR --codes --vocab` turns the file into DIR.
"""

from __future__ import annotations

import json
from pathlib import Path

from xlm_pkm.experiments.facts import Fact

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
