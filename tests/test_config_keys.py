"""train.py --keys: every config key, its default and its doc, read from the settings dataclasses (each beside its
component) so it cannot go stale; the keys of earlier versions; every config of the repository loads."""

import json
import re
from pathlib import Path

import pytest
import yaml

from xlm_pkm.config import Config, load_config, load_config_dict, to_dict
from xlm_pkm.errors import ConfigError
from xlm_pkm.launch.cli import train_main
from xlm_pkm.launch.config_keys import describe_keys, keys


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    return {k for key, v in tree.items()
            for k in (_leaves(v, f"{prefix}{key}.") if isinstance(v, dict) else {f"{prefix}{key}"})}


def test_every_key_of_the_config_is_listed_once_with_a_doc():
    listed = [k for k, _, _ in keys()]
    assert sorted(listed) == sorted(_leaves(to_dict(Config())))
    assert [k for k, _, doc in keys() if not doc] == []  # a new field needs its comment beside it


def test_the_listed_defaults_are_the_defaults_as_overrides_read_them():
    lines = describe_keys().splitlines()
    overrides = [line.split("  # ")[0].replace(" = ", "=", 1).strip() for line in lines]
    assert to_dict(load_config(None, overrides)) == to_dict(load_config(None, []))
    assert all(json.loads(o.split("=", 1)[1]) is not None for o in overrides)


@pytest.mark.slow
def test_keys_of_one_section_and_a_wrong_section(capsys):
    assert train_main(["--keys", "model.memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out and all(line.startswith("model.memory.") for line in out)
    assert any(line.startswith("model.memory.knn = 16 ") and "keys selected per head" in line  # configs/default.yaml's
               and line.endswith("(built-in default 32)") for line in out)
    with pytest.raises(ConfigError,
                       match=r"--keys memory: no such section \(sections: data, model, model.base, model.engram, "
                             r"model.memory,"):
        describe_keys("memory")
    assert train_main(["--keys", "memory"]) == 2
    assert capsys.readouterr().err.startswith("train.py: error: --keys memory: no such section")


def test_keys_shows_the_values_the_command_would_train_with_the_built_in_default_beside(capsys):
    """Issue 63: --keys model showed the built-in defaults (dim 1024, 12 layers), not what `python train.py` trains
    (configs/default.yaml: 256, 4): it shows the values of the config given (by default configs/default.yaml) and
    its overrides, the built-in default beside where they differ."""
    default = load_config(REPO / "configs/default.yaml")
    assert (default.model.dim, Config().model.dim) == (256, 1024)  # the case of the issue
    assert train_main(["--keys", "model"]) == 0
    lines = {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["model.dim"].startswith("model.dim = 256 ") and lines["model.dim"].endswith("(built-in default 1024)")
    assert lines["model.n_layers"].startswith(f"model.n_layers = {default.model.n_layers} ")
    assert "built-in default" not in lines["model.vocab_size"]  # the same in both
    small = str(REPO / "configs/small.yaml")
    assert train_main(["--keys", "model.memory", "--config", small, "model.memory.knn=3"]) == 0
    lines = {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["model.memory.knn"].startswith("model.memory.knn = 3 ") and "(built-in default 32)" in lines[
        "model.memory.knn"]


def test_help_points_to_the_keys(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "Config keys, their defaults and what they do: --keys (every section) or --keys SECTION" in text


REPO = Path(__file__).resolve().parent.parent
OLD_VARIANT_KEYS = {  # keys of earlier versions (flat in model.memory) -> their sections beside the variants' code
    "model.memory.peer_activation": ("model.memory.peer.activation", "relu"),
    "model.memory.tucker_rank": ("model.memory.tucker.rank", 3),
    "model.memory.tucker_cores": ("model.memory.tucker.cores", 2),
    "model.memory.tucker_topm": ("model.memory.tucker.topm", 40),
    "model.memory.tucker_both_signs": ("model.memory.tucker.both_signs", True),
    "model.memory.tucker_aux_coeff": ("model.memory.tucker.aux_coeff", 0.5),
    "model.memory.tucker_aux_margin": ("model.memory.tucker.aux_margin", 0.25),
    "model.memory.value_expansion": ("model.memory.expanded.expansion", 4),
    "model.memory.value_dim": ("model.memory.expanded.value_dim", 64),
}


@pytest.mark.parametrize("old", sorted(OLD_VARIANT_KEYS))
def test_a_renamed_key_in_a_users_config_names_its_new_key(old):
    new, value = OLD_VARIANT_KEYS[old]
    with pytest.raises(ConfigError, match=rf"^config key {re.escape(old)} was renamed to {re.escape(new)}$"):
        load_config(None, [f"{old}={json.dumps(value)}"])


def test_a_stored_config_of_an_earlier_version_is_migrated():
    """A checkpoint's or a run's config.yaml with the variants' flat keys loads with their values moved."""
    stored = to_dict(Config())
    memory = stored["model"]["memory"]
    for section in ("peer", "tucker", "expanded"):
        del memory[section]
    for old, (_new, value) in OLD_VARIANT_KEYS.items():
        memory[old.rsplit(".", 1)[1]] = value
    cfg = load_config_dict(stored)
    assert cfg == load_config(None, [f"{new}={json.dumps(value)}" for new, value in OLD_VARIANT_KEYS.values()])
    assert cfg.model.memory.tucker.rank == 3 and cfg.model.memory.expanded.value_dim == 64


@pytest.mark.slow
def test_every_config_of_the_repository_loads():
    """configs/ and the studies' own config files load (a study file, study.yaml, through the study loader, its
    cells' configs too); the configs the study runs recorded (results/**/config.yaml, some of an earlier version)
    load as stored configs."""
    from xlm_pkm.experiments.study_plan import load_study

    files = [*sorted((REPO / "configs").rglob("*.yaml")),
             *sorted(p for p in (REPO / "results").rglob("*.yaml") if p.name not in ("config.yaml", "study.yaml"))]
    assert len(files) > 30
    for path in files:
        load_config(path)
    studies = sorted((REPO / "results").rglob("study.yaml"))
    assert studies
    for path in studies:
        study = load_study(path)
        for cell in study.cells:
            study.grid_runs(cell)  # each cell's config with its overrides, checked
    recorded = sorted((REPO / "results").rglob("config.yaml"))
    assert recorded
    for path in recorded:
        load_config_dict(yaml.safe_load(path.read_text()), source=str(path))
