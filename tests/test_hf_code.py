"""The code of an exported folder (inference/hf_code.py): the declared modules as flat files importing each other
by `from .name import X`, and the imports it refuses, on a small package of its own (xlm_pkm/a/, xlm_pkm/b/)."""

import textwrap

import pytest

from xlm_pkm.inference import hf_code
from xlm_pkm.inference.hf_code import FolderCodeError, folder_code


@pytest.fixture
def package(tmp_path, monkeypatch):
    """write({"a/m.py": source, ...}): modules of an xlm_pkm package under tmp_path, the one folder_code reads."""
    monkeypatch.setattr(hf_code, "ROOT", tmp_path)

    def write(modules: dict[str, str]) -> None:
        for name, source in modules.items():
            path = tmp_path / "xlm_pkm" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))

    return write


def test_imports_of_carried_modules_become_imports_of_sibling_files(package):
    package({"a/entry.py": '''
        """Reads `from xlm_pkm.a.c import X` in its docstring: text, not an import."""
        import os
        from xlm_pkm.a.c import C as Renamed  # noqa: F401  (a comment kept)
        from .c import D
        from xlm_pkm.b.d import (
            E,
            F,
        )


        def late():
            from xlm_pkm.b.d import G
            return G
        ''', "a/c.py": "C = D = 1\n", "b/d.py": "from ..a.c import C\nE = F = G = C\n"})
    files = folder_code({"modeling.py": "xlm_pkm.a.entry"}, ["xlm_pkm.a.c", "xlm_pkm.b.d"])
    assert files == {"modeling.py": textwrap.dedent('''
        """Reads `from xlm_pkm.a.c import X` in its docstring: text, not an import."""
        import os
        from .c import C as Renamed  # noqa: F401  (a comment kept)
        from .c import D
        from .d import E, F


        def late():
            from .d import G
            return G
        '''), "c.py": "C = D = 1\n", "d.py": "from .c import C\nE = F = G = C\n"}


def test_a_carried_module_importing_one_off_the_list_is_refused(package):
    package({"a/entry.py": "from xlm_pkm.a.c import C\nfrom xlm_pkm.b.d import E\n", "a/c.py": "C = 1\n",
             "b/d.py": "E = 1\n"})
    with pytest.raises(FolderCodeError) as error:
        folder_code({"modeling.py": "xlm_pkm.a.entry"}, ["xlm_pkm.a.c"])
    assert str(error.value) == ("xlm_pkm.a.entry line 2 (from xlm_pkm.b.d import E): imports xlm_pkm.b.d, which an "
                                "exported folder does not carry (add it to the carried modules in hf_config.py, or "
                                "do not import it)")


@pytest.mark.parametrize("statement, why", [
    ("import xlm_pkm.a.c", "cannot be rewritten for an exported folder: import names from a module"),
    ("from xlm_pkm.a import c", "imports xlm_pkm.a, which an exported folder does not carry"),
    ("from . import c", "imports xlm_pkm.a, which an exported folder does not carry"),
    ("x = 1; from xlm_pkm.a.c import C", "an import of xlm_pkm sharing its line cannot be rewritten"),
    ("from xlm_pkm.a.c import C; x = 1", "an import of xlm_pkm sharing its line cannot be rewritten"),
])
def test_an_import_of_xlm_pkm_in_a_form_that_cannot_be_rewritten_is_refused(statement, why, package):
    package({"a/entry.py": f"def f():\n    {statement}\n", "a/c.py": "C = 1\n"})
    with pytest.raises(FolderCodeError, match="^xlm_pkm.a.entry line 2 ") as error:
        folder_code({"modeling.py": "xlm_pkm.a.entry"}, ["xlm_pkm.a.c"])
    assert why in str(error.value) and "\n" not in str(error.value)


def test_two_carried_modules_with_one_file_name_are_refused(package):
    package({"a/entry.py": "", "a/stats.py": "", "b/stats.py": ""})
    with pytest.raises(FolderCodeError, match="^xlm_pkm.a.stats and xlm_pkm.b.stats would both be stats.py in an "
                                              "exported folder$"):
        folder_code({"modeling.py": "xlm_pkm.a.entry"}, ["xlm_pkm.a.stats", "xlm_pkm.b.stats"])
    with pytest.raises(FolderCodeError, match="^xlm_pkm.a.stats and xlm_pkm.b.stats would both be stats.py"):
        folder_code({"stats.py": "xlm_pkm.a.stats"}, ["xlm_pkm.b.stats"])  # an entry's file name too


def test_only_module_files_of_xlm_pkm_are_carried(package):
    package({"a/entry.py": "", "a/__init__.py": ""})
    for module in ("xlm_pkm.a", "xlm_pkm.a.missing", "os.path"):
        with pytest.raises(FolderCodeError, match=f"^{module}: not a module file of xlm_pkm"):
            folder_code({"modeling.py": "xlm_pkm.a.entry"}, [module])


def test_the_readmes_fresh_environment_line_installs_what_an_exported_folder_imports():
    """The modules an exported folder carries import, at their top level, only the standard library and what the
    README's `pip install` line for a fresh environment names (numpy comes with transformers; Triton is imported
    only where a GPU kernel runs)."""
    import ast
    import importlib.util
    import re
    import sys
    from pathlib import Path

    from xlm_pkm.inference.hf_config import MODEL_MODULES, TOKENIZER_MODULES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    [line] = re.findall(r"`pip install torch [^`]*`", readme)
    named = {re.split(r"[<>=]", word.strip("'"))[0] for word in line.strip("`").split()[2:]}
    modules = {*MODEL_MODULES, *TOKENIZER_MODULES, "xlm_pkm.inference.hf_modeling", "xlm_pkm.inference.hf_tokenizer"}
    imported = set()
    for module in modules:
        for node in ast.parse(open(importlib.util.find_spec(module).origin).read()).body:
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add((node.module or "").split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"xlm_pkm"} <= named | {"numpy"}, line
    assert named == {"torch", "transformers", "safetensors", "sacremoses"}
