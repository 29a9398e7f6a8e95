"""Starting a run from a trained model (`train.init_from`): its weights, nothing of its run.

    trained = load_trained("dumped/default/demo/best.pt", cfg.data.path)   # or an exported folder (trained.py)
    report = load_weights(model, trained, strict=True)                      # InitReport: loaded, new, dropped...

The new run keeps its own directory, step 0, fresh optimizers and schedule and its own data; the
vocabulary must be the trained model's (fingerprints equal). Every tensor of the new model that the
trained one has with the same shape is copied; a tensor of another shape is an error naming it. With
`strict` (train.init_strict, the default) the two models must have the same tensors; without it the
new model may differ by whole tensors (retrofitting: a memory where the trained model had an FFN, or
added after it), which keep their fresh initialisation (`new`) while the trained model's tensors that
the new one lacks are left out (`dropped`).

A retrofit whose base trains (model.base.trainable) from one whose base was frozen: the base's weights, which the
trained model's checkpoint does not hold, are the new model's own from the same files (model.base.path), neither
loaded nor new.

The trained model is loaded by each rank alone (checkpoint/trained.py), its sharded value tables
(model.memory.shard_values) whole however many processes saved it; each rank keeps its own columns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from xlm_pkm.checkpoint.trained import TrainedModel
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.retrofit import RetrofitLM
from xlm_pkm.model.transformer import ModelConfig
from xlm_pkm.settings import architecture_keys


@dataclass
class InitReport:
    source: Path  # the trained model's checkpoint or exported folder
    step: int  # the step of its run
    loaded: list[str]  # copied from the trained model
    new: list[str]  # the trained model has no such tensor: freshly initialised
    dropped: list[str]  # the trained model's tensors that this model has not


def load_weights(model: nn.Module, trained: TrainedModel, strict: bool = True) -> InitReport:
    """Copies into `model` every tensor that the `trained` model (loaded alone: whole value tables) has with
    the same shape (a sharded value table: this rank's columns). Another shape is a ValueError naming the
    tensor; with `strict`, a tensor on one side only is a ConfigError."""
    own = model.state_dict()
    tensors = trained.model.state_dict()  # today's names (load_trained migrated older ones)
    shards = {name: p.value_shard for name, p in model.named_parameters(remove_duplicate=False)
              if hasattr(p, "value_shard")}
    matching, new, mismatched = {}, [], []
    for name, mine in own.items():
        if name not in tensors:
            if not (isinstance(model, RetrofitLM) and model.is_base_key(name)):  # else: the base's, from its files
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
        raise ValueError(f"train.init_from {trained.source}: tensors of another shape than this model's: "
                         + "; ".join(mismatched[:5])
                         + (f" (and {len(mismatched) - 5} more)" if len(mismatched) > 5 else ""))
    if strict and (new or dropped):
        settings = differing_model_settings(trained.cfg.model, model.cfg)
        raise ConfigError(f"train.init_from {trained.source}: this model differs from the trained one (new: "
                          f"{summarize(new) or 'none'}; dropped: {summarize(dropped) or 'none'}"
                          + (f"; the trained model's settings: {settings}" if settings else "")
                          + "); give this model the trained one's settings, or set train.init_strict=false to load "
                            "the tensors both have (retrofit)")
    model.load_state_dict(matching, strict=False)
    return InitReport(trained.source, trained.step, sorted(matching), new, dropped)


def differing_model_settings(trained: ModelConfig, own: ModelConfig, limit: int = 5) -> str:
    """'model.key=value (here: value)' for each architecture setting (settings.architecture) where the trained
    model differs from this one, at most `limit`: the overrides that would give this model the trained one's
    tensors."""
    theirs, mine = architecture_keys(trained, "model."), architecture_keys(own, "model.")
    keys = [k for k in theirs if theirs[k] != mine.get(k)]
    shown = [f"{k}={json.dumps(theirs[k])} (here: {json.dumps(mine.get(k))})" for k in keys[:limit]]
    return ", ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def summarize(names: list[str], limit: int = 8) -> str:
    """Tensor names grouped by module ('blocks.3.ffn.{fc1.weight, fc1.bias}'), at most `limit` groups."""
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        groups.setdefault(module, []).append(leaf)
    parts = [f"{module}.{{{', '.join(leaves)}}}" if len(leaves) > 1
             else f"{module}.{leaves[0]}" if module else leaves[0]
             for module, leaves in groups.items()]
    return ", ".join(parts[:limit]) + (f", ... ({len(names)} tensors in all)" if len(parts) > limit else "")
