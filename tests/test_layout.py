"""The package's layout: no import cycle, and no import back up a layer. Each subpackage's __init__.py
lists its files and says which layers it may import ("May import: ..."), or single modules of a layer
("data.dictionary"); these tests hold it to that."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xlm_pkm"
# The top-level modules (no __init__.py of their own to say it): what each may import. The layers, bottom up:
# errors, settings, registry, utils, model.memory, model, data, optim, runtime, config, checkpoint, finetune,
# train, inference, launch, experiments. Each component's settings dataclass sits in its package's settings
# module (model/model_settings.py, model/memory/memory_settings.py, optim/optim_settings.py; data/stream.py;
# finetune's two in optim/: finetune/ loads checkpoints, which read configs), so config.py, which composes them,
# sits above those layers and below the ones that load or run a config.
TOP_LEVEL = {"errors": set(), "settings": {"errors"}, "registry": set(),
             "config": {"errors", "settings", "utils", "model", "data", "optim", "runtime"}}
SUBPACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def _imports(path: Path, package: str, source: str | None = None) -> set[str]:
    """The xlm_pkm modules that the module at `path` (in `package`) imports, wherever in it: at its top, in a
    function's body, under `if TYPE_CHECKING:` (for annotations only, never run: still an arrow a reader follows).
    `source`: the module's text, if not the file's."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
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


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package (a package by its __init__.py)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    return {name.removesuffix(".__init__"): path for name, path in files.items()}


def _import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, over every import of every module (_imports), `sources`
    standing for the text of the modules they name. A module's own packages are left out: their __init__.py
    runs before it in any case (`from xlm_pkm.optim import lazy_adam` in optim/ names the module lazy_adam)."""
    modules, sources = _modules(), sources or {}
    return {name: {m for m in _imports(path, _package_of(name, path), sources.get(name))
                   if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` ({module: modules it imports}): the modules along it, the first one again at
    the end (a -> b -> a); None when the arrows run one way."""
    state = {}  # module -> "open" while on the path from the root being searched, "done" once searched

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                return [*path[path.index(dep):], dep]  # the open modules are those on the path
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_no_import_cycle_over_every_import():
    """No module imports, at its top, in a function or for its annotations only, a module that imports it: the
    arrows of the package run one way. Each component's settings (and the registries its names are chosen from)
    sit in a module that imports none of the component's code (model/memory/memory_settings.py,
    model/model_settings.py, optim/optim_settings.py), so the code imports its settings and never the reverse."""
    graph = _import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(m.removeprefix("xlm_pkm.") for m in cycle)
    assert "xlm_pkm.launch.slurm" not in graph["xlm_pkm.runtime.distributed"] | graph["xlm_pkm.train.run_dir"]


@pytest.mark.parametrize("added", [
    "if TYPE_CHECKING:\n    from xlm_pkm.model.memory.pkm import ProductKeyMemory\n",  # for annotations only
    "def f():\n    from xlm_pkm.model.memory.keys import ProductKeys\n",  # in a function's body
])
def test_an_import_back_into_the_code_is_a_cycle(added):
    """The test above fails on one import that closes a circle, wherever in the module: the memory's settings
    naming the layer that imports them, as they did before they had a module of their own."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}) == ["b", "c", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    settings = "xlm_pkm.model.memory.memory_settings"
    source = (PACKAGE / "model" / "memory" / "memory_settings.py").read_text() + "\n" + added
    cycle = find_cycle(_import_graph({settings: source}))
    assert cycle is not None and settings in cycle, cycle


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
        imported = _imports(path, _package_of(name, path))
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
                assert re.search(rf"\b{re.escape(path.name)}\b", doc), (
                    f"{package}/__init__.py does not list {path.name}")
        for sub in package.iterdir():
            if (sub / "__init__.py").is_file():
                assert f"{sub.name}/" in doc, f"{package}/__init__.py does not list {sub.name}/"


@pytest.mark.slow
def test_no_registry_is_imported_by_a_module_name_string():
    """A settings field holds its registry itself (settings.one_of(KEY_SEARCHES)), never "module:NAME" looked up
    with importlib: an exported folder carries copies of these modules under other names, and the import
    graph above stays the whole truth. (A config's `plugins` are the user's own modules, imported by name.)"""
    spec = re.compile(r"""import_module\(\s*f?["']xlm_pkm|["']xlm_pkm(\.\w+)+:\w+["']|__import__\(\s*f?["']xlm_pkm""")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sorted(PACKAGE.rglob("*.py"))
             for m in spec.finditer(p.read_text())]
    assert not found, found
    check = ("import importlib, sys\n"
             "real = importlib.import_module\n"
             "def spy(name, *args, **kwargs):\n"
             "    assert not name.startswith('xlm_pkm'), name\n"
             "    return real(name, *args, **kwargs)\n"
             "importlib.import_module = spy\n"
             "import xlm_pkm.config, xlm_pkm.model.memory\n"
             "cfg = xlm_pkm.config.load_config(ROOT + '/configs/variants/ultramem.yaml')\n"
             "xlm_pkm.config.load_config_dict(xlm_pkm.config.to_dict(cfg))\n"
             "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + check], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout == "ok\n", out.stderr
