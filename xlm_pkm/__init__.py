"""xlm-pkm: transformer language models with Product Key Memory layers (Lample et al. 2019).

    from xlm_pkm import ProductKeyMemory       # the layer alone: needs only torch

Importing the package imports nothing else; `ProductKeyMemory` and `TransformerLM` are loaded when
first used (xlm_pkm.model.memory, xlm_pkm.model.transformer), and need only torch.
"""

__version__ = "0.1.0"

_LAZY = {"ProductKeyMemory": "xlm_pkm.model.memory", "TransformerLM": "xlm_pkm.model.transformer"}
__all__ = ["ProductKeyMemory", "TransformerLM", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xlm_pkm' has no attribute {name!r}")
