"""Every command's --help opens with a whole sentence: a description taken from its module's docstring is never
cut at the end of the docstring's first line."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUT = 'description=__doc__.split("\\n")[0]'  # the first line only: whole only when it ends a sentence
USES = sorted(p for p in (ROOT / "xlm_pkm").rglob("*.py") if CUT in p.read_text())


@pytest.mark.parametrize("path", USES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_first_docstring_line_used_as_a_description_ends_a_sentence(path):
    first = re.match(r'\s*(?:#.*\n)*\s*"""(.*)', path.read_text()).group(1).rstrip()
    assert first.endswith((".", "]", ")")), f"{path.relative_to(ROOT)}: --help would end on {first[-30:]!r}"
