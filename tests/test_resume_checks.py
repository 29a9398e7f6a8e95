"""Resuming with settings the checkpoint cannot take is refused in one line before any step, the run
directory untouched; settings it can take still resume. (A damaged sharded value file on resume:
tests/test_value_shards.py, under torchrun.)"""

from __future__ import annotations

import pytest

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.config import Config, migrate
from xlm_pkm.launch.cli import train_main
from xlm_pkm.model.transformer import ModelConfig, TransformerLM
from xlm_pkm.optim.optimizers import OptimConfig, Optimizers


def run_files(run_dir) -> dict[str, bytes]:
    """Every file of a run directory but its lock (which records each command that takes it)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_another_optimizer_is_refused_naming_old_and_new_and_a_compatible_change_resumes(tiny_run, tiny_overrides,
                                                                                          tmp_path, capsys):
    run_dir = tiny_run(tmp_path, "train.exp_id=opt", "train.max_steps=4").run_dir  # Adam and Adam, stopped at 4
    before = run_files(run_dir)
    path = run_dir / "checkpoint.pt"
    keep = f"or start a new run from its weights: train.init_from={path} and a new train.exp_id"
    cases = {
        ("optim.values_optimizer=sgd",):
            "saved with optim.values_optimizer=adam, resumed with optim.values_optimizer=sgd, which cannot take over "
            f"its optimizer state; resume with optim.values_optimizer=adam, {keep}",
        ("optim.optimizer=adagrad",):
            "saved with optim.optimizer=adam, resumed with optim.optimizer=adagrad, which cannot take over its "
            f"optimizer state; resume with optim.optimizer=adam, {keep}",
        ("optim.optimizer=adagrad", "optim.values_optimizer=adagrad"):
            "saved with optim.optimizer=adam and optim.values_optimizer=adam, resumed with optim.optimizer=adagrad "
            "and optim.values_optimizer=adagrad, which cannot take over its optimizer state; resume with "
            f"optim.optimizer=adam optim.values_optimizer=adam, {keep}",
    }
    capsys.readouterr()
    for extra, message in cases.items():  # the run's own max_steps (8): it would train on at once
        assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=opt", *extra)]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"train.py: error: {path}: {message}"], err
        assert run_files(run_dir) == before  # nothing written: checkpoint.pt, config.yaml, logs

    # another lr, and lazy_adam for the values (Adam's moments, read on the rows of each step): resumed
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=opt", "optim.lr=1e-3",
                                                    "optim.values_optimizer=lazy_adam")]) == 0
    resumed = checkpoint.load(path)
    assert resumed["step"] == 8 and resumed["config"]["optim"]["values_optimizer"] == "lazy_adam"
    assert "resumed at step 4" in (run_dir / "train.log").read_text()


def test_the_check_reads_the_config_of_earlier_versions():
    """A checkpoint's config as earlier versions recorded it: no optim.optimizer (Adam then), the values'
    optimizer as model.memory.sparse (true: lazy_adam)."""
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_len=8, mem_layers=[2])
    cfg.model.memory.n_keys, cfg.model.memory.k_dim, cfg.model.memory.heads, cfg.model.memory.knn = 6, 8, 2, 4
    old = {"model": {"memory": {"sparse": True}}, "optim": {"lr": 1e-3}}
    old = migrate(old)  # in today's keys, as RunCheckpoints.load_last gives it
    for values_optimizer in ("lazy_adam", "adam"):  # the same state: resumes
        Optimizers(TransformerLM(cfg.model), OptimConfig(values_optimizer=values_optimizer)).check_resumable(old)
    optimizers = Optimizers(TransformerLM(cfg.model), OptimConfig(optimizer="adagrad", values_optimizer="sgd"))
    with pytest.raises(ValueError, match=r"^the checkpoint: saved with optim.optimizer=adam and "
                                         r"optim.values_optimizer=lazy_adam, resumed with optim.optimizer=adagrad "
                                         r"and optim.values_optimizer=sgd, .*train.init_from=CHECKPOINT and a new"):
        optimizers.load_state_dict(optimizers.state_dict(), old)
    assert all(not g.optimizer.state for g in optimizers.groups)  # nothing loaded

