"""The rules a settings field declares beside it, and `check`, which applies them to a section.

Every component keeps its settings as a dataclass in its package's settings module, which imports none of its
code (model/memory/memory_settings.py's MemoryConfig, optim/optim_settings.py's OptimConfig...); config.py
composes them into a run's Config. A field states what
values it takes in its metadata, and a section states the rules between its fields in a `check` method:

    @dataclass
    class MemoryConfig:
        knn: int = field(default=32, metadata=positive())          # > 0 (each item of a list)
        input_dropout: float = field(default=0.0, metadata=probability())   # in [0, 1)
        key_type: str = field(default="product", metadata=one_of(KEY_SEARCHES))  # a registered name
        query_norm: Literal["batchnorm", "layernorm", "none"] = "batchnorm"   # one of the Literal's
        heads: int = field(default=4, metadata=architecture(positive()))   # refused changed on resume

        def check(self, prefix: str) -> None:       # optional: rules between this section's fields
            ...                                     # raise ConfigError(f"{prefix}knn: ...")

    check(MemoryConfig(knn=0), "model.memory.")     # ConfigError: model.memory.knn: must be > 0, got 0

Every float must also be finite. `check` applies the field rules of every leaf (sub-sections recursively,
keys named from `prefix`), then each section's own `check(prefix)`, sub-sections before the section that
holds them; each error is a one-line ConfigError naming the key. one_of takes the Registry itself (or a
function returning it), read when checked, so a registration made later (a plugin) counts.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable, Literal

from xlm_pkm.errors import ConfigError

RULE, CHOICES, ARCHITECTURE, EXECUTION = "rule", "choices", "architecture", "execution"  # the metadata keys


def _each(test: Callable[[object], bool], what: str) -> dict:
    def rule(key: str, value) -> None:
        if not all(map(test, value if isinstance(value, list) else [value])):
            raise ConfigError(f"{key}: {what}, got {value}")

    return {RULE: rule}


def positive() -> dict:
    """Field metadata: the number (each number of a list) is > 0."""
    return _each(lambda v: v > 0, "must be > 0")


def non_negative() -> dict:
    """Field metadata: the number (each number of a list) is >= 0."""
    return _each(lambda v: v >= 0, "must be >= 0")


def probability() -> dict:
    """Field metadata: the number is in [0, 1) (a dropout, an Adam beta)."""
    return _each(lambda v: 0 <= v < 1, "must be in [0, 1)")


def one_of(registry) -> dict:
    """Field metadata: the name (each name of a list) is registered in `registry` (a registry.Registry, or
    any mapping), or in what a function of no argument returns."""
    return {CHOICES: registry}


def architecture(rule: dict | None = None) -> dict:
    """Field metadata: the key defines the model (its shapes or what it computes), so a run cannot resume with
    another value (architecture_changes); `rule` is the field's other metadata, if any."""
    return {**(rule or {}), ARCHITECTURE: True}


def architecture_keys(section, prefix: str = "") -> dict:
    """{dotted key: value} of the fields of `section` (and its sub-sections) marked architecture()."""
    return {key: value for key, f, _, value in _leaves(section, prefix) if f.metadata.get(ARCHITECTURE)}


def execution(rule: dict | None = None) -> dict:
    """Field metadata: the key chooses how a computation runs (a kernel, a fused optimizer, a layout of the tables),
    not what it computes (the same result up to float rounding), so a study's trained runs stay its runs when it
    changes (experiments/study_plan.StudyRun's changes); `rule` is the field's other metadata, if any."""
    return {**(rule or {}), EXECUTION: True}


def execution_keys(section, prefix: str = "") -> set[str]:
    """The dotted keys of the fields of `section` (and its sub-sections) marked execution()."""
    return {key for key, f, _, _ in _leaves(section, prefix) if f.metadata.get(EXECUTION)}


def choices(f: dataclasses.Field, tp) -> list | None:
    """The values a field may take: the names in its registry, or its Literal's; None if any."""
    if CHOICES in f.metadata:
        registry = f.metadata[CHOICES]
        return list(registry() if callable(registry) else registry)
    if typing.get_origin(tp) is list:
        (tp,) = typing.get_args(tp)
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def check(section, prefix: str = ""):
    """Applies the field rules of `section` (a settings dataclass) and of its sub-sections, then each
    section's own `check(prefix)`, sub-sections first; returns `section`."""
    for key, f, tp, value in _leaves(section, prefix):
        allowed = choices(f, tp)
        names = value if isinstance(value, list) else [value]
        if allowed is not None and not all(_is_one_of(name, allowed) for name in names):
            each = "each one of" if isinstance(value, list) else "one of"
            raise ConfigError(f"{key}: expected {each} {' | '.join(map(choice_text, allowed))}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        if RULE in f.metadata:
            f.metadata[RULE](key, value)
    _check_sections(section, prefix)
    return section


def _is_one_of(value, allowed: list) -> bool:
    """value is one of `allowed` and of its type: true is not 1 (a Literal may hold both "auto" and true)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def choice_text(value) -> str:
    """A choice as YAML writes it: true, false, auto."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _leaves(section, prefix: str):
    """(dotted key, field, type, value) of every field that is not a section, sections recursively."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, hints[f.name], value


def _check_sections(section, prefix: str) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_sections(value, f"{prefix}{f.name}.")
    own = getattr(section, "check", None)
    if own is not None:
        own(prefix)
