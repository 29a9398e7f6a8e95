"""optim.trainable: frozen parameters and a frozen query network's BatchNorm statistics stay bit-identical
over a run, the chosen ones train, and a pattern matching nothing is a one-line error."""

import pytest
import torch

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.value_stores import is_memory_value


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("spec", ["memory_values", "memory", "[blocks.0.*]"])
def test_frozen_weights_and_statistics_stay_bit_identical(tiny_trainer, tmp_path, spec):
    trainer = tiny_trainer(tmp_path, f"optim.trainable={spec}", "model.memory.query_norm=batchnorm",
                          "train.eval_every=4", test=False)  # evaluation returns to model.train()
    try:
        names = {n for n, _ in trainer.model.named_parameters()}
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        before = _snapshot(trainer.model)
        trainer.train()
        after = _snapshot(trainer.model)
    finally:
        trainer.close()
    values = {n for n, p in trainer.model.named_parameters() if is_memory_value(p)}
    memory_ids = {id(p) for _, m in trainer.model.memories() for p in m.parameters()}
    expected = {"memory_values": values,
                "memory": {n for n, p in trainer.model.named_parameters() if id(p) in memory_ids} | values,
                "[blocks.0.*]": {n for n in names if n.startswith("blocks.0.")}}[spec]
    assert trained == expected and trained and trained != names
    for key in before:  # parameters and buffers (BatchNorm running statistics) of frozen modules
        frozen_module = not any(n.startswith(key.rsplit(".", 1)[0] + ".") for n in trained)
        if key in names and key not in trained or key not in names and frozen_module:
            assert torch.equal(before[key], after[key]), key
    assert all(not torch.equal(before[n], after[n]) for n in trained)
    if spec == "memory_values":
        norms = [k for k in before if k.endswith("running_mean")]
        assert norms and all(torch.equal(before[k], after[k]) for k in norms)
    with_state = {id(p) for g in trainer.optimizers.groups for p in g.optimizer.state}
    assert all(p.requires_grad or id(p) not in with_state for p in trainer.model.parameters())


def test_pattern_matching_no_parameter_is_one_line(tiny_trainer, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.trainable: pattern 'nothing\.\*' matches no parameter") as e:
        tiny_trainer(tmp_path, "optim.trainable=[nothing.*]", test=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("freeze_norm_stats", [True, False])
def test_norm_statistics_stay_with_every_parameter_trainable_under_the_option(tiny_trainer, tmp_path,
                                                                            freeze_norm_stats):
    """optim.trainable=all (full finetuning): with optim.freeze_norm_stats the memory's query BatchNorm keeps
    its running statistics bit-identical over the steps (and an evaluation's return to model.train()), while
    its own weights still train; without the option they drift."""
    trainer = tiny_trainer(tmp_path, "optim.trainable=all", "model.memory.query_norm=batchnorm", "train.max_steps=4",
                           "train.eval_every=2", f"optim.freeze_norm_stats={str(freeze_norm_stats).lower()}",
                           test=False)
    try:
        before = _snapshot(trainer.model)
        trainer.train()
        after = _snapshot(trainer.model)
    finally:
        trainer.close()
    stats = [k for k in before if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    weights = [k.replace("running_mean", "weight") for k in stats if k.endswith("running_mean")]
    assert stats and weights and all(p.requires_grad for p in trainer.model.parameters())
    assert all(not torch.equal(before[k], after[k]) for k in weights)  # the BatchNorm's affine weights train
    assert all(torch.equal(before[k], after[k]) for k in stats) == freeze_norm_stats
