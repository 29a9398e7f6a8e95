"""Named implementations of one kind of component (key searches, value optimizers, block types).

    KEY_SEARCHES = Registry("memory key type")

    @KEY_SEARCHES.register("product")
    class ProductKeys(nn.Module): ...

    KEY_SEARCHES["product"]      # the class; an unknown name raises KeyError listing the known ones

A settings field names its implementation with a string; the field declares the registry itself
(`field(default="product", metadata=one_of(KEY_SEARCHES))`, settings.py), and the config loader checks the
name against it, so adding an implementation never touches the config code. Each registry lives beside the
settings that name it, in its package's settings module (which imports none of the package's code), and is
filled by the modules that implement the names, when imported. The registries: KEY_SEARCHES
(model.memory.key_type; filled by model/memory/keys.py), SCORE_FUNCTIONS (model.memory.score; scores.py),
VALUE_STORES (model.memory.values; value_stores.py), all three in model/memory/memory_settings.py; SUBLAYERS
(model.sublayers; model/blocks.py) in model/model_settings.py; DENSE_OPTIMIZERS and VALUE_OPTIMIZERS
(optim.optimizer, optim.values_optimizer; optim/optimizers.py: their entries are DenseOptimizer /
ValueOptimizer, which declare their state size) and SCHEDULES (optim.schedule; optim/schedule.py) in
optim/optim_settings.py. The implementations' modules re-export them (`from xlm_pkm.model.memory.keys import
KEY_SEARCHES` works). A registry made with an `entry` type refuses anything else.

Outside this package, a module of your own registers into them when imported; name it in the
config's `plugins` (`plugins: [my_pkg.my_keys]`, or the override `plugins=[my_pkg.my_keys]`) and
every command that reads the config (train.py, evaluate.py, generate.py, export) imports it first.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class Registry(dict):
    def __init__(self, kind: str, entry: type | None = None):
        super().__init__()
        self.kind, self.entry = kind, entry

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if self.entry is not None and not isinstance(obj, self.entry):
                raise TypeError(f"{self.kind} {name!r}: register a {self.entry.__name__}, got {obj!r}")
            self[name] = obj
            return obj

        return add

    def __missing__(self, name: str):
        raise KeyError(f"unknown {self.kind} {name!r} (known: {', '.join(self)})")
