"""Starting a run from a trained model (`train.init_from`): its weights, nothing of its run.

    weights = trained_weights("dumped/default/demo/best.pt")     # or checkpoint.pt, or an exported folder
    report = load_weights(model, weights, strict=True)          # InitReport: loaded, new, dropped

The new run keeps its own directory, step 0, fresh optimizers and schedule and its own data; the
vocabulary must be the trained model's (fingerprints equal). Every tensor of the new model that the
trained one has with the same shape is copied; a tensor of another shape is an error naming it. With
`strict` (train.init_strict, the default) the two models must have the same tensors; without it the
new model may differ by whole tensors (retrofitting: a memory where the trained model had an FFN, or
added after it), which keep their fresh initialisation (`new`) while the trained model's tensors that
the new one lacks are left out (`dropped`).

Sharded value tables (model.memory.shard_values) come whole from the trained model (however many
processes saved it) and each rank keeps its own columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint import sharded_values
from xlm_pkm.checkpoint.trained import read_exported
from xlm_pkm.errors import ConfigError


@dataclass
class TrainedWeights:
    tensors: dict[str, torch.Tensor]  # state-dict name -> tensor (value tables whole)
    step: int  # the trained run's step
    vocab_fingerprint: str | None
    source: Path


@dataclass
class InitReport:
    loaded: list[str]  # copied from the trained model
    new: list[str]  # the trained model has no such tensor: freshly initialised
    dropped: list[str]  # the trained model's tensors that this model has not


def trained_weights(path: str | Path) -> TrainedWeights:
    """The weights of a run checkpoint (best.pt, checkpoint.pt) or of an exported folder (export.py)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"train.init_from: {path} does not exist (a run's best.pt or checkpoint.pt, "
                                f"or a folder written by python -m xlm_pkm.inference.export)")
    if path.is_dir():
        model, dictionary, _, metadata = read_exported(path)
        return TrainedWeights(model.state_dict(), int(metadata.get("step", 0)), dictionary.fingerprint(), path)
    state = sharded_values.attach(checkpoint.load(path), path, None)  # whole value tables
    return TrainedWeights(state["model"], state["step"], state.get("vocab_fingerprint"), path)


def load_weights(model: nn.Module, weights: TrainedWeights, strict: bool = True) -> InitReport:
    """Copies into `model` every tensor that `weights` has with the same shape (a sharded value table:
    this rank's columns). Another shape is a ValueError naming the tensor; with `strict`, a tensor on one
    side only is a ConfigError."""
    own = model.state_dict()
    tensors = checkpoint.migrate_model_state(weights.tensors, own)
    shards = {name: p.value_shard for name, p in model.named_parameters(remove_duplicate=False)
              if hasattr(p, "value_shard")}
    matching, new, mismatched = {}, [], []
    for name, mine in own.items():
        if name not in tensors:
            new.append(name)
            continue
        theirs = tensors[name]
        if name in shards:  # (slots, dim) -> (slots, dim / world): this rank's columns
            theirs = theirs[:, shards[name].columns(theirs.shape[1])]
        if theirs.shape != mine.shape:
            mismatched.append(f"{name} is {tuple(theirs.shape)} there, {tuple(mine.shape)} here")
        matching[name] = theirs
    dropped = sorted(set(tensors) - set(own))
    if mismatched:
        raise ValueError(f"train.init_from {weights.source}: tensors of another shape than this model's: "
                         + "; ".join(mismatched[:5]) + (f" (and {len(mismatched) - 5} more)" if len(mismatched) > 5 else ""))
    if strict and (new or dropped):
        raise ConfigError(f"train.init_from {weights.source}: this model differs from the trained one (new: "
                          f"{summarize(new) or 'none'}; dropped: {summarize(dropped) or 'none'}); set "
                          f"train.init_strict=false to load the tensors both have (retrofit)")
    model.load_state_dict(matching, strict=False)
    return InitReport(sorted(matching), new, dropped)


def summarize(names: list[str], limit: int = 8) -> str:
    """Tensor names grouped by module ('blocks.3.ffn.{fc1.weight, fc1.bias}'), at most `limit` groups."""
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        groups.setdefault(module, []).append(leaf)
    parts = [f"{module}.{{{', '.join(leaves)}}}" if len(leaves) > 1 else f"{module}.{leaves[0]}" if module else leaves[0]
             for module, leaves in groups.items()]
    return ", ".join(parts[:limit]) + (f", ... ({len(names)} tensors in all)" if len(parts) > limit else "")
