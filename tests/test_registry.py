"""Registries accept implementations from a user's own module, named in the config's `plugins`: checked,
built, and imported again where a saved config is read back (evaluate.py, export)."""

import sys
import textwrap

import pytest

from xlm_pkm.config import load_config, load_config_dict, to_dict
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim.schedule import SCHEDULES, scheduled_lr

PLUGIN = textwrap.dedent('''
    """A user's key search and schedule, registered from outside xlm_pkm."""
    from xlm_pkm.model.memory.keys import KEY_SEARCHES
    from xlm_pkm.optim.schedule import SCHEDULES


    @KEY_SEARCHES.register("user_flat")
    class UserFlatKeys(KEY_SEARCHES["flat"]):
        """The flat keys under the user's name."""


    SCHEDULES.register("user_half")(lambda step, cfg: cfg.lr / 2)
''')
SMALL = ["model.dim=16", "model.n_layers=2", "model.n_memories=1", "model.n_heads=2", "model.vocab_size=30",
         "model.memory.n_keys=4", "model.memory.k_dim=8", "model.memory.heads=2", "model.memory.knn=3"]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The module user_plugin on sys.path; its registrations and import undone afterwards."""
    (tmp_path / "user_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))

    def forget():
        sys.modules.pop("user_plugin", None)
        KEY_SEARCHES.pop("user_flat", None)
        SCHEDULES.pop("user_half", None)

    forget()
    yield "user_plugin"
    forget()


def test_a_plugin_registers_a_key_search_and_a_schedule(plugin):
    overrides = [*SMALL, "model.memory.key_type=user_flat", "optim.schedule=user_half"]
    with pytest.raises(ConfigError, match="model.memory.key_type: expected one of .*, got 'user_flat'"):
        load_config(None, overrides)
    cfg = load_config(None, [f"plugins=[{plugin}]", *overrides])
    (_, memory), = TransformerLM(cfg.model).memories()
    assert type(memory.keys).__name__ == "UserFlatKeys" and memory.n_slots == 16
    assert scheduled_lr(10, cfg.optim) == cfg.optim.lr / 2
    saved = to_dict(cfg)
    sys.modules.pop(plugin)  # a new process reading the checkpoint: its config never imports the plugin...
    KEY_SEARCHES.pop("user_flat")
    SCHEDULES.pop("user_half")
    with pytest.raises(ConfigError, match=f"plugins: names {plugin}, which loading never imports"):
        load_config_dict(saved, source="best.pt")
    assert plugin not in sys.modules
    assert load_config_dict(saved, run_config=True) == cfg and "user_flat" in KEY_SEARCHES  # ...a run's own does


@pytest.mark.parametrize("plugins, message", [
    ("[no_such_module_here]", "plugins: cannot import 'no_such_module_here' (No module named 'no_such_module_here')"),
    ("user_plugin", "plugins: expected a list of module names, got 'user_plugin'"),
])
def test_bad_plugins_get_one_line_errors(plugins, message):
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}"):
        load_config(None, [f"plugins={plugins}"])

