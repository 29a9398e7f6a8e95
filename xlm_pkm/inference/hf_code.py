"""The code an exported folder carries, so that transformers runs the model without xlm_pkm installed.

    files = folder_code({"modeling_xlm_pkm.py": "inference/hf_modeling.py"})   # file name -> source text

Each entry module, under its new name, and every xlm_pkm module it imports (at any depth, also inside
functions), each as a flat file named after its module (xlm_pkm/model/memory/pkm.py -> pkm.py), with
`from xlm_pkm.a.b import X` rewritten to `from .b import X`: transformers' remote code loads a folder's
modules through the relative imports of the form `from .b import X` that it finds. Two modules with one
name, a module imported from its package (`from xlm_pkm.a import b`), or an xlm_pkm import left in another
form raise: the folder would not load.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # xlm_pkm/
ABSOLUTE = re.compile(r"^(\s*)from xlm_pkm((?:\.\w+)+) import ([\w, ]+)", re.M)  # from xlm_pkm.a.b import X, Y
RELATIVE = re.compile(r"^\s*from \.(\w+) import ", re.M)  # from .b import X (a sibling module)


def folder_code(entries: dict[str, str]) -> dict[str, str]:
    """{file name in the folder: source} for the entry modules ({name: path under xlm_pkm/}) and their imports."""
    files: dict[str, str] = {}
    origin: dict[str, Path] = {}  # flat file name -> the module it holds
    todo = [(name, PACKAGE / path) for name, path in entries.items()]
    while todo:
        name, path = todo.pop()
        if origin.setdefault(name, path) != path:
            raise ValueError(f"{origin[name]} and {path} would both be {name} in an exported folder")
        if name in files:
            continue
        text = path.read_text(encoding="utf-8")
        imported = [path.parent / f"{module}.py" for module in RELATIVE.findall(text)]

        def flat(match: re.Match) -> str:
            indent, dotted, names = match.groups()
            target = PACKAGE.joinpath(*dotted.strip(".").split(".")).with_suffix(".py")
            if not target.is_file():  # `from xlm_pkm.a import m`: transformers finds only `from .m import` in a folder
                raise ValueError(f"{path}: import names from xlm_pkm's modules for an exported folder, not "
                                 f"modules from a package ({match.group(0).strip()})")
            imported.append(target)
            return f"{indent}from .{target.stem} import {names}"

        files[name] = ABSOLUTE.sub(flat, text)
        if re.search(r"^\s*(from|import) xlm_pkm\b", files[name], re.M):
            raise ValueError(f"{path}: an import of xlm_pkm that an exported folder cannot resolve")
        todo += [(module.name, module) for module in imported]
    return files
