"""train.init_from: a new run starts from a trained model's weights (checkpoint or exported folder),
retrofits a memory into a dense model, refuses what does not fit in one line, and resumes exactly."""

import pytest
import torch
from conftest import whole_checkpoint

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.errors import ConfigError
from xlm_pkm.inference.export import export
from xlm_pkm.launch.cli import train_main


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """The trained tiny models to start from: with its memory ('memory') and without ('dense')."""
    dump = tmp_path_factory.mktemp("trained")
    return {"memory": tiny_run(dump, "train.exp_id=memory"),
            "dense": tiny_run(dump, "train.exp_id=dense", "model.mem_layers=[]")}


def _weights(path) -> dict[str, torch.Tensor]:
    return whole_checkpoint(path)["model"]


@pytest.mark.parametrize("source", ["best.pt", "checkpoint.pt", "exported"])
def test_loaded_weights_equal_the_trained_models(trained, tiny_trainer, tmp_path, source):
    run_dir = trained["memory"].run_dir
    path = export(run_dir / "best.pt", tmp_path / "exported") if source == "exported" else run_dir / source
    trainer = tiny_trainer(tmp_path, "train.exp_id=ft", f"train.init_from={path}", test=False)
    try:
        assert trainer.step == 0 and not trainer.resumed
        expected = _weights(run_dir / ("best.pt" if source == "exported" else source))
        own = trainer.model.state_dict()
        assert sorted(own) == sorted(expected)
        for name, tensor in own.items():
            assert torch.equal(tensor, expected[name]), name
        assert trainer.optimizers.state_dict()["dense"]["state"] == {}  # fresh optimizers
    finally:
        trainer.close()
    log = (trainer.run_dir / "train.log").read_text()
    assert f"initialised from {path} (step 8 of its run): {len(own)} tensors loaded, 0 new, 0 dropped" in log


def test_retrofit_loads_the_shared_tensors_and_lists_new_and_dropped(trained, tiny_trainer, tmp_path):
    """The dense model's FFN at layer 2 becomes a memory: the rest is the dense model's, the memory is new."""
    path = trained["dense"].run_dir / "best.pt"
    with pytest.raises(ConfigError, match="set train.init_strict=false") as e:
        tiny_trainer(tmp_path, "train.exp_id=strict", f"train.init_from={path}", test=False)
    assert "\n" not in str(e.value) and "new: blocks.1.sublayers.1.keys.weight" in str(e.value)
    assert "the trained model's settings: model.mem_layers=[] (here: " in str(e.value)  # the override it differs by
    fresh = tiny_trainer(tmp_path, "train.exp_id=fresh", test=False)  # the same model, not initialised
    trainer = tiny_trainer(tmp_path, "train.exp_id=retro", f"train.init_from={path}", "train.init_strict=false",
                           test=False)
    fresh.close()
    trainer.close()
    dense, own, initial = _weights(path), trainer.model.state_dict(), fresh.model.state_dict()
    new = sorted(set(own) - set(dense))
    dropped = sorted(set(dense) - set(own))
    memory = "blocks.1.sublayers.1."  # the second sublayer of the last block: FFN there, memory here
    assert "blocks.1.sublayers.1.values.weight" in new and all(name.startswith(memory) for name in new)
    assert dropped == [memory + f"{fc}.{leaf}" for fc in ("fc1", "fc2") for leaf in ("bias", "weight")]
    for name, tensor in own.items():
        assert torch.equal(tensor, initial[name] if name in new else dense[name]), name
    log = (trainer.run_dir / "train.log").read_text()
    assert f"{len(own) - len(new)} tensors loaded, {len(new)} new, {len(dropped)} dropped" in log
    assert "  new: blocks.1.sublayers.1.keys.weight, blocks.1.sublayers.1.query_net.0.{weight, bias}" in log
    assert "  dropped: blocks.1.sublayers.1.fc1.{bias, weight}, blocks.1.sublayers.1.fc2.{bias, weight}" in log


def test_a_tensor_of_another_shape_is_named(trained, tiny_trainer, tmp_path):
    path = trained["memory"].run_dir / "best.pt"
    with pytest.raises(ValueError,
                       match=r"blocks\.1\.sublayers\.1\.values\.weight is \(64, 32\) there, \(256, 32\) here") as e:
        tiny_trainer(tmp_path, f"train.init_from={path}", "model.memory.n_keys=16", test=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_bad_sources_are_one_line(trained, tiny_overrides, tmp_path, capsys):
    best = trained["memory"].run_dir / "best.pt"
    other_vocab = checkpoint.load(best) | {"vocab_fingerprint": "0" * 16}
    torch.save(other_vocab, tmp_path / "other_vocab.pt")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    cases = {"missing.pt": "missing.pt does not exist", "notes.txt": "not a readable checkpoint",
             "empty": "not a folder written by python -m xlm_pkm.inference.export",
             "other_vocab.pt": "trained with another vocabulary"}
    for name, message in cases.items():
        code = train_main(["--no-test", *tiny_overrides(tmp_path, f"train.exp_id={name}",
                                                        f"train.init_from={tmp_path / name}")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (name, err)


@pytest.mark.slow
def test_a_finetuning_run_resumes_exactly(trained, tiny_overrides, tiny_run, train_losses, tmp_path,
                                         monkeypatch, signal_at_step):
    init = f"train.init_from={trained['memory'].run_dir / 'best.pt'}"
    reference = tiny_run(tmp_path, "train.exp_id=whole", init)
    signal_at_step(4)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=cut", init)]) == 75
    monkeypatch.undo()
    resumed = tiny_run(tmp_path, "train.exp_id=cut", init)
    assert train_losses(resumed.run_dir) == train_losses(reference.run_dir)
    assert "ignored: the run resumes from its own checkpoint" in (resumed.run_dir / "train.log").read_text()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, reference.model.state_dict()[name]), name
