"""The package's layout: no import cycle, and no import back up a layer. Each subpackage's __init__.py
lists its files and says which layers it may import ("May import: ..."), or single modules of a layer
("data.dictionary"); these tests hold it to that."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xlm_pkm"
# The top-level modules (no __init__.py of their own to say it): what each may import.
TOP_LEVEL = {"errors": set(), "registry": set(), "config": {"errors", "utils"}}
SUBPACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def _imports(path: Path, package: str) -> set[str]:
    """The xlm_pkm modules that the module at `path` (in `package`) imports, wherever in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("xlm_pkm"):
                found |= {f"{base}.{a.name}" for a in node.names} | {base}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("xlm_pkm")}
    return found


def test_no_import_cycle_between_the_package_modules():
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "xlm_pkm").rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in files.items()}
    graph = {name: {m for m in _imports(path, name if path.name == "__init__.py" else name.rsplit(".", 1)[0])
                    if m in modules and m != name and not name.startswith(m + ".")}  # not a package's own __init__
             for name, path in modules.items()}
    state = {}  # name -> "open" while on the path, "done" after

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", "import cycle: " + " -> ".join([*path, name, dep])
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert "xlm_pkm.launch.slurm" not in graph["xlm_pkm.runtime.distributed"] | graph["xlm_pkm.train.run_dir"]


def _layer(module: str) -> str:
    """The layer of an xlm_pkm module: its subpackage (model.memory apart from model), or its top-level name."""
    parts = module.split(".")[1:]
    if parts[:2] == ["model", "memory"]:
        return "model.memory"
    if not parts or not ((PACKAGE / parts[0]).is_dir() or (PACKAGE / f"{parts[0]}.py").is_file()):
        return ""  # the root package itself (xlm_pkm.__version__): it imports nothing when imported
    return parts[0]


def _allowed(package: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    found = re.search(r"^May import: (.*?)\.(?:\s|$)", doc, re.M | re.S)
    assert found, f"{package}/__init__.py: its docstring says nothing of what it may import ('May import: ...')"
    listed = re.sub(r"\(.*?\)", "", found.group(1), flags=re.S)  # without remarks in parentheses
    allowed = {name.strip() for name in listed.split(",")} | {""}
    return allowed | ({"model.memory"} if "model" in allowed else set())  # model.memory is below model


def _permitted(module: str, allowed: set[str]) -> bool:
    """Whether the xlm_pkm module (or name in it) `module` is in an allowed layer or an allowed single module."""
    dotted = module.removeprefix("xlm_pkm.")
    return _layer(module) in allowed or any(dotted == a or dotted.startswith(a + ".") for a in allowed if "." in a)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("package", SUBPACKAGES, ids=lambda p: ".".join(p.relative_to(PACKAGE).parts))
def test_a_subpackage_imports_only_the_layers_its_docstring_allows(package):
    layer = _layer(_module_name(package / "__init__.py"))
    allowed = _allowed(package) | {layer}
    for path in sorted(package.glob("*.py")):
        name = _module_name(path)
        imported = _imports(path, name if path.name == "__init__.py" else name.rsplit(".", 1)[0])
        outside = sorted({m for m in imported if not _permitted(m, allowed)})
        assert not outside, f"{path.relative_to(ROOT)} imports {outside}: not below its layer"


@pytest.mark.parametrize("package", SUBPACKAGES, ids=lambda p: ".".join(p.relative_to(PACKAGE).parts))
def test_a_single_module_allowed_imports_only_what_its_importer_may(package):
    """A module allowed on its own (model may import data.dictionary, not data) brings no other of its layer."""
    allowed = _allowed(package) | {_layer(_module_name(package / "__init__.py"))}
    for single in sorted(a for a in allowed if "." in a and a != "model.memory"):
        path = PACKAGE.joinpath(*single.split(".")).with_suffix(".py")
        imported = _imports(path, "xlm_pkm." + single.rsplit(".", 1)[0])
        outside = sorted({m for m in imported if not _permitted(m, allowed)})
        assert not outside, f"{path.relative_to(ROOT)} imports {outside}, which {package.name}/ may not"


@pytest.mark.parametrize("module", sorted(TOP_LEVEL))
def test_a_top_level_module_imports_only_what_it_may(module):
    used = {_layer(m) for m in _imports(PACKAGE / f"{module}.py", "xlm_pkm")} - {""}
    assert used <= TOP_LEVEL[module], f"xlm_pkm/{module}.py imports {sorted(used - TOP_LEVEL[module])}"


def test_every_module_has_a_place_and_is_listed_by_its_package():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert loose == sorted(TOP_LEVEL), f"modules at the top of xlm_pkm/ outside the layers: {loose}"
    for package in SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        for path in package.glob("*.py"):
            if path.name != "__init__.py":
                assert re.search(rf"\b{re.escape(path.name)}\b", doc), f"{package}/__init__.py does not list {path.name}"
        for sub in package.iterdir():
            if (sub / "__init__.py").is_file():
                assert f"{sub.name}/" in doc, f"{package}/__init__.py does not list {sub.name}/"
