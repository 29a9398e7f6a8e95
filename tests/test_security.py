"""A checkpoint or an exported folder is data, never code (docs/security.md): a file that would run code when
unpickled is refused in one line and its code never runs; the modules a checkpoint's config names as `plugins`
are imported only on the user's word (--plugins); an exported folder carries no plugins, and a file of it edited
since the export is one line. Each payload here creates a marker file when it runs: the tests fail if it does."""

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint import sharded_values
from xlm_pkm.checkpoint.safe_load import UnsafeFileError
from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.inference.export import export
from xlm_pkm.inference.export import main as export_main
from xlm_pkm.launch.cli import evaluate_main, generate_main
from xlm_pkm.train.run_dir import latest_unfinished
from xlm_pkm.train.trainer import Trainer

OPEN = f"{open.__module__}.{open.__name__}"  # how a pickle names `open`: io.open


class Payload:
    """Unpickled, it opens (creates) `marker`: what any code in a pickle could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, marker: Path) -> None:
    """Adds the payload to the torch file at `path` (read here the unsafe way, as a malicious author would)."""
    state = torch.load(path, weights_only=False)
    state["note"] = Payload(marker)
    torch.save(state, path)


@pytest.fixture
def run_copy(reference_run, tmp_path):
    """A copy of the tiny reference run's directory (checkpoint.pt with its tensors' folder, best.pt)."""
    source = reference_run().run_dir
    copy = tmp_path / "dump" / "tiny" / source.name
    shutil.copytree(source, copy)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["evaluate", "generate", "export"])
def test_a_checkpoint_that_would_run_code_is_refused_by_the_commands(command, run_copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    plant(run_copy / "best.pt", marker)
    argv = {"evaluate": lambda p: evaluate_main(["--checkpoint", p, "--max-batches", "1"]),
            "generate": lambda p: generate_main(["--checkpoint", p, "--max-tokens", "2", "x"]),
            "export": lambda p: export_main([p, str(tmp_path / "out")])}[command]
    assert argv(str(run_copy / "best.pt")) == 2
    assert f"{run_copy / 'best.pt'}: names {OPEN}" in one_line(capsys) and not marker.exists()


def test_resume_init_from_and_exp_id_last_never_unpickle_code(run_copy, tiny_overrides, tmp_path):
    marker = tmp_path / "ran"
    plant(run_copy / "checkpoint.pt", marker)
    dump = run_copy.parent.parent
    with pytest.raises(ConfigError, match=f"names {OPEN}"):
        latest_unfinished(str(dump), "tiny", 1000)
    with pytest.raises(ValueError, match=f"names {OPEN}"):  # resumes the run: its exp_id
        Trainer(load_config(None, tiny_overrides(dump, f"train.exp_id={run_copy.name}", "train.max_steps=12")))
    with pytest.raises(UnsafeFileError, match=f"names {OPEN}"):  # a new run from its weights
        Trainer(load_config(None, tiny_overrides(tmp_path / "new", f"train.init_from={run_copy / 'checkpoint.pt'}")))
    assert not marker.exists()


def test_a_tensor_folder_whose_metadata_would_run_code_is_refused(run_copy, tmp_path):
    """Distributed Checkpoint unpickles `.metadata` with plain pickle: ours with an allow-list of its records."""
    marker = tmp_path / "ran"
    metadata, = run_copy.glob("checkpoint.dcp/step*/.metadata")
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=f"names {OPEN}"):
        load_trained(run_copy / "checkpoint.pt")
    assert not marker.exists()
    metadata.write_bytes(original)  # the allow-list reads what torch writes
    assert load_trained(run_copy / "checkpoint.pt").step == checkpoint.load(run_copy / "checkpoint.pt")["step"]


def test_a_value_shard_file_that_would_run_code_is_refused(run_copy, tmp_path):
    marker = tmp_path / "ran"
    state = checkpoint.load(run_copy / "best.pt")
    torch.save({"step": state["step"], "model": {}, "note": Payload(marker)}, run_copy / "part.pt")
    state[sharded_values.KEY] = {"world": 1, "width": 4, "files": ["part.pt"]}
    with pytest.raises(UnsafeFileError, match=f"part.pt: names {OPEN}"):
        sharded_values.attach(state, run_copy / "best.pt", None)
    state[sharded_values.KEY] = {"world": 1, "width": 4, "files": ["../../elsewhere.pt"]}
    with pytest.raises(ValueError, match="names the value shard '../../elsewhere.pt', not a file beside it"):
        sharded_values.attach(state, run_copy / "best.pt", None)
    assert not marker.exists()


@pytest.mark.parametrize("entry, value, says", [
    ("config", 5, "its config is int, not a dict"),
    ("step", "7", "its step is str, not an integer"),
    ("weight", "a string", "its weight tok_emb.weight is str, not a tensor"),
    ("dcp", "../../other", "its dcp names '../../other', not a folder beside it"),
])
def test_a_checkpoint_with_the_right_keys_and_wrong_types_is_one_line(entry, value, says, run_copy, capsys):
    path = run_copy / ("checkpoint.pt" if entry == "dcp" else "best.pt")
    state = checkpoint.load(path)
    if entry == "weight":
        state["model"]["tok_emb.weight"] = value
    else:
        state[entry] = value
    torch.save(state, path)
    for command in (lambda: evaluate_main(["--checkpoint", str(path), "--max-batches", "1"]),
                    lambda: generate_main(["--checkpoint", str(path), "--max-tokens", "2", "x"]),
                    lambda: export_main([str(path), str(run_copy / "out")])):
        assert command() == 2
        assert f"{path}: {says}: not as an xlm-pkm run writes it" in one_line(capsys)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module on sys.path that creates a marker file when imported: (its name, the marker)."""
    marker, name = tmp_path / "imported", "xlm_pkm_test_marker_plugin"
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    yield name, marker
    sys.modules.pop(name, None)


def test_a_checkpoints_plugins_are_imported_only_on_the_users_word(plugin, run_copy, capsys):
    name, marker = plugin
    state = checkpoint.load(run_copy / "best.pt")
    state["config"]["plugins"] = [name]
    torch.save(state, run_copy / "best.pt")
    assert evaluate_main(["--checkpoint", str(run_copy / "best.pt"), "--max-batches", "1"]) == 2
    assert f"plugins: names {name}, which loading never imports" in one_line(capsys)
    assert not marker.exists() and name not in sys.modules
    assert evaluate_main(["--checkpoint", str(run_copy / "best.pt"), "--max-batches", "1", "--plugins", name]) == 0
    assert marker.exists()


def test_an_export_never_imports_a_module_it_ships(plugin, reference_run, tmp_path, monkeypatch):
    """config.json edited to name plugins, and the module beside it (and the folder the working directory, so
    that an import by name would find it): refused before anything is imported."""
    name, marker = plugin
    sys.path.remove(str(tmp_path / "plugins"))
    out = export(reference_run().best_path, tmp_path / "exported")
    shutil.move(tmp_path / "plugins" / f"{name}.py", out / f"{name}.py")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "plugins": [name]}))
    monkeypatch.chdir(out)
    monkeypatch.syspath_prepend(str(out))
    with pytest.raises(ValueError, match=r"config.json: names plugins .*which an exported folder never carries"):
        load_trained(out, out)
    assert not marker.exists() and name not in sys.modules


def test_a_file_of_an_export_edited_since_is_noticed(reference_run, tmp_path, capsys):
    """The folder's code runs under transformers' trust_remote_code without a check of its own: our loader and
    --verify compare every file with the hash its weights record."""
    out = export(reference_run().best_path, tmp_path / "exported")
    assert export_main(["--verify", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("files as exported")
    modeling = out / "modeling_xlm_pkm.py"
    code = modeling.read_text()
    modeling.write_text(code + "\nimport os  # added after the export\n")
    with pytest.raises(ValueError, match=f"{modeling}: edited since the export"):
        load_trained(out, out)
    assert export_main(["--verify", str(out)]) == 2
    assert f"{modeling}: edited since the export" in one_line(capsys)
    modeling.write_text(code)
    (out / "vocab").unlink()
    assert export_main(["--verify", str(out)]) == 2
    assert "vocab: recorded by" in one_line(capsys)
