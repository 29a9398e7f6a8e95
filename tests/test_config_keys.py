"""train.py --keys: every config key, its default and its doc, read from config.py so it cannot go stale."""

import json

import pytest

from xlm_pkm.config import Config, load_config, to_dict
from xlm_pkm.errors import ConfigError
from xlm_pkm.launch.cli import train_main
from xlm_pkm.launch.config_keys import describe_keys, keys


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    return {k for key, v in tree.items()
            for k in (_leaves(v, f"{prefix}{key}.") if isinstance(v, dict) else {f"{prefix}{key}"})}


def test_every_key_of_the_config_is_listed_once_with_a_doc():
    listed = [k for k, _, _ in keys()]
    assert sorted(listed) == sorted(_leaves(to_dict(Config())))
    assert [k for k, _, doc in keys() if not doc] == []  # a new field needs its comment in config.py


def test_the_listed_defaults_are_the_defaults_as_overrides_read_them():
    lines = describe_keys().splitlines()
    overrides = [line.split("  # ")[0].replace(" = ", "=", 1).strip() for line in lines]
    assert to_dict(load_config(None, overrides)) == to_dict(load_config(None, []))
    assert all(json.loads(o.split("=", 1)[1]) is not None for o in overrides)


def test_keys_of_one_section_and_a_wrong_section(capsys):
    assert train_main(["--keys", "model.memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out and all(line.startswith("model.memory.") for line in out)
    assert any(line.startswith("model.memory.knn = 32 ") and "keys selected per head" in line for line in out)
    with pytest.raises(ConfigError, match=r"--keys memory: no such section \(sections: data, model, model.engram, model.memory,"):
        describe_keys("memory")
    assert train_main(["--keys", "memory"]) == 2
    assert capsys.readouterr().err.startswith("train.py: error: --keys memory: no such section")


def test_help_points_to_the_keys(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "Config keys, their defaults and what they do: --keys (every section) or --keys SECTION" in text
