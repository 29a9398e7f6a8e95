"""Accidents of issue 51 that lost, overwrote or hung a run, each reproduced (docs/reliability.md)."""

import json
import shutil

import pytest
import torch

from xlm_pkm.checkpoint.files import NonFiniteError
from xlm_pkm.launch.cli import evaluate_main, generate_main

TINY_VALUES = "blocks.1.sublayers.1.values.weight"  # the tiny model's value table


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- 1. evaluate.py --json never overwrites a file it did not write ------------------------------------
def test_evaluate_json_on_a_checkpoint_is_refused_before_evaluating(reference_run, capsys, monkeypatch, tmp_path):
    import xlm_pkm.launch.cli

    run = reference_run()
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(run.ckpt_path, checkpoint)
    before = checkpoint.read_bytes()
    evaluate_checkpoint = xlm_pkm.launch.cli.evaluate_checkpoint
    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", lambda *a, **k: pytest.fail("evaluated anyway"))
    assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(checkpoint)]) == 2
    assert f"--json {checkpoint}: exists and is not a result written by evaluate.py" in one_line(capsys)
    assert checkpoint.read_bytes() == before
    assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(tmp_path)]) == 2
    assert "is a directory" in one_line(capsys)
    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", evaluate_checkpoint)
    result = tmp_path / "result.json"
    for _ in range(2):  # a result of its own is replaced
        assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(result), "--max-batches", "1"]) == 0
    assert json.loads(result.read_text())["split"] == "test"


# ---- 9. a non-finite weight in a checkpoint (bit rot) --------------------------------------------------
def test_a_nan_weight_is_refused_by_evaluate_generate_and_resume(reference_run, tiny_run, tiny_trainer, tmp_path,
                                                                 capsys):
    damaged = tmp_path / "damaged.pt"
    state = torch.load(reference_run().best_path, weights_only=False)
    state["model"][TINY_VALUES][3, 1] = float("nan")
    torch.save(state, damaged)
    assert evaluate_main(["--checkpoint", str(damaged), "--max-batches", "1"]) == 2
    assert f"{damaged}: weight {TINY_VALUES} holds nan or inf" in one_line(capsys)
    assert generate_main(["--checkpoint", str(damaged), "--max-tokens", "3"]) == 2
    assert f"{damaged}: weight {TINY_VALUES} holds nan or inf" in one_line(capsys)
    run_dir = tiny_run(tmp_path, "train.exp_id=rot", "train.max_steps=2").run_dir
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    state["model"][TINY_VALUES][0, 0] = float("inf")
    torch.save(state, run_dir / "checkpoint.pt")
    with pytest.raises(NonFiniteError, match=f"checkpoint.pt: weight {TINY_VALUES} holds nan or inf") as refused:
        tiny_trainer(tmp_path, "train.exp_id=rot", "train.max_steps=4")
    assert "Last good checkpoint" not in str(refused.value)
