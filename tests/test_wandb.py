"""train.wandb: W&B gets metrics.jsonl's scalars at their steps and config.yaml's config, a resumed run continues
its W&B run, and a run without the wandb package stops at its start with one line. W&B runs offline here."""

import json
import sys
from fnmatch import fnmatch

import pytest
import yaml

from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.launch.cli import train_main
from xlm_pkm.train.run_dir import RUN_OUTPUTS
from xlm_pkm.train.trainer import Trainer
from xlm_pkm.train.wandb_log import ID_FILE, MISSING_WANDB

WANDB = ("train.wandb.project=pkm-tests", "train.wandb.mode=offline")


@pytest.fixture
def wandb_runs(monkeypatch, tmp_path):
    """Every W&B run the test opens, as {"init": its wandb.init arguments, "logged": [(data, step), ...]};
    W&B offline and silent, its settings and caches under tmp_path."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    runs, init = [], wandb.init

    def recording_init(**kwargs):
        run = init(**kwargs)
        record, log = {"init": kwargs, "logged": []}, run.log

        def recording_log(data, step=None, commit=None):
            record["logged"].append((dict(data), step))
            log(data, step=step, commit=commit)

        monkeypatch.setattr(run, "log", recording_log)
        runs.append(record)
        return run

    monkeypatch.setattr(wandb, "init", recording_init)
    return runs


def _flat(prefix: str, value) -> dict:
    """{tag: number} of an event's metrics, named as TensorBoard's tags (the memories' list by layer)."""
    if isinstance(value, list):
        value = {f"layer{item['layer']}": {k: v for k, v in item.items() if k != "layer"} for item in value}
    if isinstance(value, dict):
        return {tag: x for key, item in value.items() for tag, x in _flat(f"{prefix}/{key}", item).items()}
    return {prefix: value} if isinstance(value, (int, float)) and not isinstance(value, bool) else {}


@pytest.mark.slow
def test_wandb_logs_the_metrics_and_the_config_of_the_run(tiny_run, wandb_runs, tmp_path):
    run_dir = tiny_run(tmp_path, *WANDB, "train.exp_id=w", "train.max_steps=4", "train.eval_every=2").run_dir
    (wandb_run,) = wandb_runs
    run_id = (run_dir / ID_FILE).read_text().strip()
    assert wandb_run["init"]["id"] == run_id and wandb_run["init"]["resume"] is None
    assert wandb_run["init"]["name"] == "tiny/w" and wandb_run["init"]["mode"] == "offline"
    assert wandb_run["init"]["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = [(_flat(e["event"], {k: v for k, v in e.items() if k not in ("event", "step", "time")}), e["step"])
                for e in events]
    logged = wandb_run["logged"]
    assert logged == expected  # every event's scalars, at its step, in order
    assert [step for _, step in logged] == [1, 2, 2, 3, 4, 4]  # train, then valid at steps 2 and 4
    train, valid = logged[0][0], logged[2][0]
    assert {"train/loss", "train/ppl", "train/lr/dense", "train/grad_norm/dense", "train/tokens_per_sec",
            "train/eta_s"} <= set(train)
    assert {"valid/ppl", "valid/memories/layer2/usage", "valid/memories/layer2/kl"} <= set(valid)
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))  # W&B's files: in the run directory


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tiny_run, wandb_runs, signal_at_step, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    train_step = Trainer.train_step
    signal_at_step(3)  # SIGUSR2 during step 3: a checkpoint, then the run stops
    stopped = tiny_run(tmp_path, *WANDB, "train.exp_id=r", "train.max_steps=5")
    assert stopped.stopped and stopped.step == 3
    run_id = (stopped.run_dir / ID_FILE).read_text().strip()
    monkeypatch.setattr(Trainer, "train_step", train_step)  # no signal this time
    tiny_run(tmp_path, *WANDB, "train.exp_id=r", "train.max_steps=5")
    first, resumed = wandb_runs
    assert first["init"]["id"] == resumed["init"]["id"] == run_id
    assert (first["init"]["resume"], resumed["init"]["resume"]) == (None, "allow")
    assert [step for _, step in first["logged"]] == [1, 2, 3]
    assert [step for _, step in resumed["logged"]] == [4, 5, 5]  # train 4, 5; valid 5
    assert len(list((tmp_path / "wandb_dir" / "wandb").glob(f"offline-run-*-{run_id}*"))) == 2


def test_wandb_without_the_package_stops_at_the_start_in_one_line(tiny_overrides, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert train_main(["--no-test", *tiny_overrides(tmp_path, *WANDB, "train.exp_id=n")]) == 2
    assert capsys.readouterr().err == f"train.py: error: {MISSING_WANDB}\n"
    assert MISSING_WANDB == "train.wandb: needs the wandb package: pip install 'xlm-pkm[wandb]'"
    assert not (tmp_path / "tiny").exists()  # nothing written


def test_a_wandb_that_cannot_start_stops_the_run_in_one_line_before_its_outputs(wandb_runs, tiny_overrides, tmp_path,
                                                                                 monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # online (the default) and not logged in
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.wandb.project=pkm-tests", "train.exp_id=o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: train.wandb: W&B did not start (") and err.count("\n") == 1, err
    assert "train.wandb.mode=offline" in err and wandb_runs == []
    written = [p.name for p in (tmp_path / "tiny" / "o").iterdir()]  # none that would refuse the same command again
    assert not [name for name in written if any(fnmatch(name, output) for output in RUN_OUTPUTS)], written


def test_wandb_config_keys_are_checked_in_one_line():
    assert load_config(None, list(WANDB)).train.wandb.mode == "offline"
    with pytest.raises(ConfigError, match=r"^train.wandb.mode: expected one of online \| offline, got 'cloud'$"):
        load_config(None, ["train.wandb.mode=cloud"])
