"""Named implementations of one kind of component (key searches, value optimizers, block types).

    KEY_SEARCHES = Registry("memory key type")

    @KEY_SEARCHES.register("product")
    class ProductKeys(nn.Module): ...

    KEY_SEARCHES["product"]      # the class; an unknown name raises KeyError listing the known ones

A config field names its implementation with a string; the config loader checks the name against the
registry (see `choices` in config.py), so adding an implementation never touches the config code.
The registries: KEY_SEARCHES (model/memory/keys.py, model.memory.key_type), SUBLAYERS (model/blocks.py,
model.sublayers), DENSE_OPTIMIZERS, VALUE_OPTIMIZERS and SCHEDULES (optim.py: optim.optimizer,
optim.values_optimizer, optim.schedule).

Outside this package, a module of your own registers into them when imported; name it in the
config's `plugins` (`plugins: [my_pkg.my_keys]`, or the override `plugins=[my_pkg.my_keys]`) and
every command that reads the config (train.py, evaluate.py, generate.py, export) imports it first.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class Registry(dict):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = obj
            return obj

        return add

    def __missing__(self, name: str):
        raise KeyError(f"unknown {self.kind} {name!r} (known: {', '.join(self)})")
