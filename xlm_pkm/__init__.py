"""xlm-pkm: transformer language models with Product Key Memory layers (Lample et al. 2019).

    from xlm_pkm import ProductKeyMemory       # the layer alone: needs only torch

Importing the package imports nothing else; `ProductKeyMemory` and `TransformerLM` are loaded when
first used (xlm_pkm.model.memory, xlm_pkm.model.transformer), and need only torch. Importing it changes
nothing in the process: no environment variable, thread or global state.

Huge pages: train.py and the other commands set THP_MEM_ALLOC_ENABLE=1 (PyTorch's switch for CPU tensors
of 2 MB and more on transparent huge pages) before torch is imported: a sparse step on CPU is 1.19x
faster with it at 512² slots (docs/benchmarks.md, "Huge pages"). PyTorch reads it once, at its first
CPU allocation, so a library user sets it before importing torch:

    THP_MEM_ALLOC_ENABLE=1 python my_script.py      # or os.environ["THP_MEM_ALLOC_ENABLE"] = "1" first

The subpackages, lowest layer first; each may import only layers below it (its __init__.py says which,
and tests/test_layout.py checks it):

    errors.py     UserError, the base of every one-line error; exit statuses
    utils/        atomic output files, directory lock, progress lines, program name
    config.py     every knob as a dataclass, checked once;  registry.py: name -> implementation
    runtime/      device and precision, ranks and collectives, SLURM's environment, peak FLOP/s
    data/         corpus -> Moses -> fastBPE -> shards; streams; text codecs
    model/        the transformer and the all-attention family; model/memory/: the memory layer
    optim/        dense and sparse optimizers, the lr schedule, clipping
    checkpoint/   checkpoint files, sharded values, a run's checkpoints, trained models
    finetune/     init_from, trainable, LoRA, sparse memory finetuning, slot counts
    train/        the trainer, its step and state, evaluation, run directory and log
    inference/    generation, sampling, export
    runs/         the runs under a dump folder, listed and compared (python -m xlm_pkm.runs)
    launch/       the commands (train.py, evaluate.py...), their process defaults, SLURM
    experiments/  reproduction, reports, introspection, the continual-learning study
"""

__version__ = "0.1.0"

_LAZY = {"ProductKeyMemory": "xlm_pkm.model.memory", "TransformerLM": "xlm_pkm.model.transformer"}
__all__ = ["ProductKeyMemory", "TransformerLM", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xlm_pkm' has no attribute {name!r}")
