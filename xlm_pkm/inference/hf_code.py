"""The code an exported folder carries, so that transformers runs the model where xlm_pkm is not installed.

    files = folder_code({"modeling_xlm_pkm.py": "xlm_pkm.inference.hf_modeling"}, MODEL_MODULES)  # {name: source}

Each entry module under its file name, and each carried module (declared in hf_config.py) as a flat file named
after it (xlm_pkm.model.memory.pkm -> pkm.py), every import of xlm_pkm rewritten, from the syntax tree, as an
import of a sibling file: `from xlm_pkm.a.b import X` (or `from .b import X` inside xlm_pkm/a/) becomes
`from .b import X`, the one form by which transformers' remote code finds and copies a folder's other files.
Flat files rather than one file joining them: each module keeps its own namespace (no two modules' private names
can collide) and its line numbers (a traceback points at the source).

Refused with a one-line FolderCodeError naming the module and the import (export stops before writing anything):
an import of an xlm_pkm module that is not carried, an import of xlm_pkm in a form that cannot be rewritten
(`import xlm_pkm.a`, a statement sharing its line), two carried modules with one file name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "xlm_pkm"
ROOT = Path(__file__).resolve().parents[2]  # the folder holding xlm_pkm/


class FolderCodeError(Exception):
    """xlm_pkm's code cannot go into an exported folder as declared: a bug of the package, not of the user's input."""


def folder_code(entries: dict[str, str], modules: Iterable[str]) -> dict[str, str]:
    """{file name in the folder: source} of the entry modules ({file name: module}) and the carried `modules`."""
    files = dict(entries)
    for module in modules:
        name = f"{module.rpartition('.')[2]}.py"
        if files.setdefault(name, module) != module:
            raise FolderCodeError(f"{files[name]} and {module} would both be {name} in an exported folder")
    siblings = {module: Path(name).stem for name, module in files.items()}  # module -> the name it is imported by
    return {name: _rewritten(module, siblings) for name, module in files.items()}


def _rewritten(module: str, siblings: dict[str, str]) -> str:
    """The source of `module` with each statement importing from xlm_pkm replaced by `from .sibling import ...`."""
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if module.partition(".")[0] != PACKAGE or not path.is_file():
        raise FolderCodeError(f"{module}: not a module file of {PACKAGE} (a package's __init__ is not carried)")
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    rewrites = []  # (first line, last line, new line) of each statement, in the order of the source
    for node in _imports_of_xlm_pkm(ast.parse(text, str(path))):
        first, last = lines[node.lineno - 1].encode(), lines[node.end_lineno - 1].encode()
        statement = " ".join(line.strip() for line in lines[node.lineno - 1:node.end_lineno])
        where = f"{module} line {node.lineno} ({statement})"
        indent, rest = first[:node.col_offset].decode(), last[node.end_col_offset:].decode()
        if indent.strip() or not (rest.strip() == "" or rest.lstrip().startswith("#")):
            raise FolderCodeError(f"{where}: an import of {PACKAGE} sharing its line cannot be rewritten for an "
                                  f"exported folder")
        target = _imported_module(module, node, where)
        if target not in siblings:
            raise FolderCodeError(f"{where}: imports {target}, which an exported folder does not carry (add it "
                                  f"to the carried modules in hf_config.py, or do not import it)")
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        rewrites.append((node.lineno, node.end_lineno, f"{indent}from .{siblings[target]} import {names}{rest}"))
    for start, end, line in reversed(rewrites):
        lines[start - 1:end] = [line]
    return "".join(lines)


def _imports_of_xlm_pkm(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The statements of `tree`, at any depth, that import xlm_pkm or one of its modules (relative ones included),
    in the order of the source."""
    return sorted((node for node in ast.walk(tree) if _imports_xlm_pkm(node)), key=lambda node: node.lineno)


def _imports_xlm_pkm(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.partition(".")[0] == PACKAGE for alias in node.names)
    return isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").partition(".")[0] == PACKAGE)


def _imported_module(module: str, node: ast.Import | ast.ImportFrom, where: str) -> str:
    """The dotted name of the xlm_pkm module that `node` (inside `module`) imports names from."""
    if isinstance(node, ast.Import):
        raise FolderCodeError(f"{where}: cannot be rewritten for an exported folder: import names from a module "
                              f"(from {PACKAGE}.a.b import X)")
    if not node.level:
        return node.module
    package = module.split(".")[:-1]  # a carried module is a module file, never a package's __init__
    return ".".join(package[:len(package) + 1 - node.level] + ([node.module] if node.module else []))
