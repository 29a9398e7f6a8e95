"""Every memory variant (docs/variants.md), Engram beside a PKM included, through the framework's own commands:
a run killed and resumed equals the uninterrupted one bit for bit, evaluate.py reports its usage and KL (and
the share of Engram's rows read), train.init_from starts from it."""

import json

import pytest
import torch

from xlm_pkm.launch.cli import evaluate_main

VARIANTS = {  # overrides of the tiny config (tests/conftest.py), with the values' sparse optimizer
    "relu": ["model.memory.score=relu"],
    "memory_plus": ["model.mem_layers=[1,2]", "model.memory.gated=true", "model.memory.share_values=true"],
    "peer": ["model.memory.values=peer", "model.memory.share_keys=true"],
    "pkm_engram": ["model.engram.layers=[1]", "model.engram.table_size=64", "model.engram.ngram_dim=8",
                   "model.engram.heads=2"],
    "ultramem": ["model.memory.key_type=tucker", "model.memory.tucker.cores=2", "model.memory.values=expanded",
                 "model.memory.expanded.expansion=2", "model.memory.score=identity", "optim.values_lr_decay_steps=8"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_resumes_exactly_evaluates_and_initialises_a_run(name, tiny_run, reference_run, train_losses,
                                                                  tiny_overrides, tmp_path, capsys):
    extra = (*VARIANTS[name], "optim.values_optimizer=lazy_adam")
    full = reference_run(*extra)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *extra)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *extra)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)
    for key, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[key]), key

    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(full.best_path), "--split", "test", "--max-batches", "2",
                          "--json", str(tmp_path / "test.json")]) == 0
    result = json.loads((tmp_path / "test.json").read_text())
    memories, engrams = result["memories"], result.get("engrams", [])
    assert memories and all(0 < m["usage"] <= 100 and m["kl"] >= 0 for m in memories)
    assert len(engrams) == ("engram" in name) and all(0 < e["usage"] <= 100 and e["kl"] >= 0 for e in engrams)

    start = tiny_run(tmp_path, "train.exp_id=init", "train.max_steps=1", f"train.init_from={full.best_path}", *extra)
    assert start.state.step == 1
