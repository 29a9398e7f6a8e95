"""The package: `pip install .` in a fresh virtual environment gives the console commands; the layer
imports and trains with torch alone (the data, launcher and logging dependencies made unimportable)."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from xlm_pkm.launch.cli import generate_main
from xlm_pkm.utils.program import program_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FILES = ["pyproject.toml", "requirements.txt", "README.md", "xlm_pkm", "configs"]
BLOCKED = ["sacremoses", "fastBPE", "tensorboard", "submitit", "yaml", "tqdm", "safetensors", "triton"]

# docs/layer.md's "The layer on its own" example: a plain PyTorch model, the values in their own optimizer
# with sparse gradients and lazy Adam.
LAYER_SNIPPET = """\
import torch
from torch import nn
from xlm_pkm import ProductKeyMemory
from xlm_pkm.optim.lazy_adam import LazyAdam

memory = ProductKeyMemory(256, 256, n_keys=128, k_dim=128, heads=4, knn=16)  # 128² = 16k slots
model = nn.Sequential(nn.Embedding(1000, 256), memory, nn.Linear(256, 1000))
memory.sparse_values = True  # the value table's gradient: one row per slot read, as a sparse tensor
dense = [p for p in model.parameters() if p is not memory.values.weight]
optimizers = [torch.optim.Adam(dense, lr=2.5e-4),  # values: their own optimizer, a higher lr (paper §4.3)
              LazyAdam([memory.values.weight], lr=1e-3)]  # updates only the rows read

tokens = torch.randint(0, 1000, (8, 64))
logits = model(tokens[:, :-1])  # (8, 63, 1000)
loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
loss.backward()
for optimizer in optimizers:
    optimizer.step()
    optimizer.zero_grad()
"""


def blocking_prelude(names: list[str]) -> str:
    """Python source that makes `names` unimportable, as if not installed (a None entry in sys.modules
    makes `import` raise ModuleNotFoundError and importlib.util.find_spec return None)."""
    return f"import sys\nsys.modules.update(dict.fromkeys({names!r}))\n"


@pytest.mark.slow  # a fresh Python
def test_the_layer_needs_only_torch():
    check = textwrap.dedent(f"""\
        try:
            import yaml
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("the blocker does not work")
        {LAYER_SNIPPET.replace(chr(10), chr(10) + "        ")}
        assert memory.values.weight.grad is None and torch.isfinite(loss)
        x = torch.randn(5, 256, requires_grad=True)
        memory.eval()(x).sum().backward()  # BatchNorm on running statistics; sparse value gradient
        assert x.grad.shape == (5, 256) and memory.values.weight.grad.is_sparse
        loaded = sorted({{name.split(".")[0] for name, m in sys.modules.items() if m is not None}} & set({BLOCKED!r}))
        assert not loaded, loaded
        print("ok")
        """)
    out = subprocess.run([sys.executable, "-c", blocking_prelude(BLOCKED) + check], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


@pytest.mark.slow
def test_importing_the_package_changes_no_environment_variable_and_starts_no_thread():
    code = ("import os, threading; e = dict(os.environ); import xlm_pkm, xlm_pkm.config, xlm_pkm.model.memory; "
            "assert dict(os.environ) == e, {k for k in {*e, *os.environ} if e.get(k) != os.environ.get(k)}; "
            "import xlm_pkm.runtime.distributed, xlm_pkm.train.trainer; "  # (torch's inductor sets a variable)
            "assert threading.active_count() == 1, threading.enumerate()")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr


# Records THP_MEM_ALLOC_ENABLE when torch is first imported (PyTorch reads it at its first CPU allocation),
# then runs a command with --help; `seen` stays empty if torch is never imported.
HUGE_PAGES_AT_TORCH_IMPORT = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
sys.meta_path.insert(0, Watch())
{run}
try:
    run()
except BaseException:
    pass
print("torch imported with THP_MEM_ALLOC_ENABLE", seen)
"""


def console_commands() -> dict[str, str]:
    """{command: "module:function"} of pyproject.toml's [project.scripts]."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^(\S+) = "(\S+)"', section, re.M))


NO_TORCH = {"xlm-pkm-preprocess"}  # never imports torch: nothing to set


@pytest.mark.parametrize("command, given, expected", [
    ("train.py", None, "1"), ("train.py", "0", "0"),  # each case a fresh Python importing torch: the others slow
    *[pytest.param(c, None, "1", marks=pytest.mark.slow)
      for c in ["evaluate.py", "generate.py", *console_commands(), "slurm-job"]]])
@pytest.mark.slow
def test_commands_turn_huge_pages_on_before_torch_is_imported_unless_told(command, given, expected):
    """launch/commands.py: each command that starts a torch process (and a SLURM job's TrainJob) sets
    THP_MEM_ALLOC_ENABLE=1 unless it is set, before torch is imported."""
    if command.endswith(".py"):
        run = f"import runpy\nsys.argv = [{command!r}, '--help']\nrun = lambda: runpy.run_path({command!r}, " \
              f"run_name='__main__')"
    elif command == "slurm-job":  # outside a SLURM job, submitit refuses once torch is imported
        run = "from xlm_pkm.launch.slurm import TrainJob\nrun = TrainJob(['--help'])"
    else:
        module, function = console_commands()[command].split(":")
        run = f"sys.argv = [{command!r}, '--help']\nfrom {module} import {function} as run"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env |= {"THP_MEM_ALLOC_ENABLE": given} if given else {}
    out = subprocess.run([sys.executable, "-c", HUGE_PAGES_AT_TORCH_IMPORT.format(run=run)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    seen = [] if command in NO_TORCH else [expected]
    assert out.stdout.endswith(f"torch imported with THP_MEM_ALLOC_ENABLE {seen}\n"), out.stdout + out.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh virtual environment where `pip install --no-deps .` installed a copy of the sources;
    the dependencies come from this environment's site-packages (a .pth file), so nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "shared_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-input", str(src)], check=True, timeout=120, capture_output=True)
    return venv / "bin"


def run_all(bin_dir: Path, commands: list[list[str]], cwd: Path) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each command of bin_dir, run at the same time."""
    procs = [subprocess.Popen([str(bin_dir / c[0]), *c[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=cwd) for c in commands]
    outputs = [p.communicate(timeout=120) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


@pytest.mark.slow  # a fresh virtual environment
def test_console_commands_of_the_installed_package(installed, reference_run, tmp_path, capsys):
    assert {f"xlm-pkm-{c}" for c in ("train", "evaluate", "generate", "preprocess", "export", "runs")} <= \
        {p.name for p in installed.iterdir()}
    best = reference_run().best_path
    capsys.readouterr()
    generate_args = ["--checkpoint", str(best), "--max-tokens", "8", "--greedy", "the module"]
    list_configs = "import pathlib, xlm_pkm; c = pathlib.Path(xlm_pkm.__file__).parent / 'configs'; " \
                   "print(*sorted(str(p.relative_to(c)) for p in c.rglob('*.yaml')))"
    where, configs, generated, evaluated, trained, preprocess = run_all(installed, [
        ["python", "-c", "import xlm_pkm; print(xlm_pkm.__version__, xlm_pkm.__file__)"],
        ["python", "-c", list_configs],
        ["xlm-pkm-generate", *generate_args],
        ["xlm-pkm-evaluate", "--checkpoint", str(best), "--split", "valid", "--max-batches", "1", "--device", "cpu"],
        ["xlm-pkm-train", f"data.path={tmp_path / 'none'}"],  # with the default config installed in the package
        ["xlm-pkm-preprocess", "--help"]], cwd=tmp_path)
    version, location = where[1].split()
    assert version == __import__("xlm_pkm").__version__ and not location.startswith(str(ROOT))
    # every config of the checkout travels with the package (finetune/, variants/paper/, all_attention/ too)
    checkout = ROOT / "configs"
    assert configs[1].split() == sorted(str(p.relative_to(checkout)) for p in checkout.rglob("*.yaml"))
    assert generated[0] == 0, generated[2]
    assert generate_main(generate_args) == 0 and generated[1] == capsys.readouterr().out
    assert evaluated[0] == 0 and evaluated[1].startswith("valid ppl "), evaluated[2]
    assert trained[0] == 2 and trained[2] == f"xlm-pkm-train: error: data directory not found: {tmp_path / 'none'} " \
                                              "(run python -m xlm_pkm.data.preprocess)\n"
    assert preprocess[0] == 0 and preprocess[1].startswith("usage: xlm-pkm-preprocess ")
    assert "--bpe-codes" in preprocess[1]


@pytest.mark.parametrize("argv0, expected", [
    ("/opt/venv/bin/xlm-pkm-train", "xlm-pkm-train"), (str(ROOT / "train.py"), "train.py"),
    (str(ROOT / "xlm_pkm" / "inference" / "export.py"), "python -m xlm_pkm.inference.export"),
    (str(ROOT / "xlm_pkm" / "data" / "preprocess.py"), "python -m xlm_pkm.data.preprocess"),
    ("/usr/bin/pytest", "the default"), (str(ROOT / "benchmarks" / "training_speed.py"), "the default")])
def test_program_name_is_how_the_command_was_started(monkeypatch, argv0, expected):
    monkeypatch.setattr(sys, "argv", [argv0])
    assert program_name("the default") == expected


def test_make_demo_threads_sets_every_commands_cpu_threads():
    """`make demo THREADS=1` (issue 63: a busy machine trained twice as fast on one thread); without it, torch's own."""
    def commands(*args):
        done = subprocess.run(["make", "-n", "-o", "data", "demo", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True)
        return [line for line in done.stdout.splitlines() if ".venv/bin/python" in line]

    assert len(commands("THREADS=1")) == 4 and all(c.startswith("OMP_NUM_THREADS=1 ") for c in commands("THREADS=1"))
    assert not any("OMP_NUM_THREADS" in c for c in commands())


def test_a_busy_machine_is_told_in_the_log(tiny_trainer, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    trainer = tiny_trainer(tmp_path, "train.exp_id=busy")
    trainer.close()
    log = (trainer.run_dir / "train.log").read_text()
    assert "warning: this machine is busy (load 64.0 on" in log and "train.num_threads=1 (make demo THREADS=1)" in log
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    trainer = tiny_trainer(tmp_path, "train.exp_id=quiet")
    trainer.close()
    assert "machine is busy" not in (trainer.run_dir / "train.log").read_text()
