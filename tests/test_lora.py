"""optim.lora: adapters only train, a LoRA run resumes exactly, its best.pt is a plain model; peft stays optional."""

import sys

import pytest
import torch
from conftest import logged_losses, whole_checkpoint

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.errors import ConfigError
from xlm_pkm.finetune.lora import MISSING_PEFT
from xlm_pkm.launch.cli import evaluate_main

LORA = ("optim.lora.rank=2", "optim.lora.alpha=4", "optim.lr=1e-2")


def test_lora_without_peft_is_a_one_line_config_error(tiny_trainer, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ConfigError, match=r"^optim.lora needs peft: pip install 'xlm-pkm\[lora\]'") as err:
        tiny_trainer(tmp_path, *LORA)
    assert str(err.value) == MISSING_PEFT


def test_lora_with_another_trainable_set_is_rejected(tiny_trainer, tmp_path):
    with pytest.raises(ConfigError, match="optim.trainable must be all"):
        tiny_trainer(tmp_path, *LORA, "optim.trainable=memory_values")


@pytest.mark.slow
def test_lora_trains_adapters_only_and_best_pt_is_the_merged_model(tiny_trainer, tmp_path):
    pytest.importorskip("peft")
    trainer = tiny_trainer(tmp_path, *LORA, "train.exp_id=lora", "train.eval_every=8")
    before = {k.replace(".base_layer.", "."): v.clone() for k, v in trainer.model.state_dict().items()
              if ".lora_" not in k}
    trained = sorted(name for name, p in trainer.model.named_parameters() if p.requires_grad)
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert any(".qkv." in n for n in trained) and any(".fc1." in n for n in trained)
    try:
        trainer.train()
    finally:
        trainer.close()
    after = trainer.model.state_dict()
    for key, value in before.items():  # base weights untouched, memory values included
        assert torch.equal(after.get(key, after.get(key.replace(".weight", ".base_layer.weight")
                                                     .replace(".bias", ".base_layer.bias"))), value), key
    model = load_trained(trainer.run_dir / "best.pt").model
    assert set(model.state_dict()) == set(before)  # plain names: any consumer loads it
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    trainer.model.eval()
    with torch.no_grad():  # the merged plain model computes what the adapted one does
        torch.testing.assert_close(model(x), trainer.model(x), rtol=1e-4, atol=1e-5)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(k.endswith(".weight") and k.split(".")[-2] in ("qkv", "out", "fc1", "fc2")
                           for k in changed)
    assert evaluate_main(["--checkpoint", str(trainer.run_dir / "best.pt"), "--max-batches", "2"]) == 0


@pytest.mark.slow
def test_lora_run_resumes_exactly(tiny_run, reference_run, tmp_path):
    pytest.importorskip("peft")
    full = reference_run(*LORA)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *LORA)
    assert any(".lora_B." in k for k in whole_checkpoint(tmp_path / "tiny" / "cut" / "checkpoint.pt")["model"])
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *LORA)
    assert logged_losses(resumed.run_dir) == logged_losses(full.run_dir)
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name
