"""Training: the loop and what it is made of.

    trainer.py     Trainer: set-up, the loop, signals and time limits, logging; resume through checkpoint/
    step.py        one step's two halves: forward/backward under autocast, the optimizers' update
    state.py       TrainState: counters, RNG states, data cursor (one per rank, in checkpoint.pt)
    evaluation.py  perplexity, memory usage and KL, speed on one split (also evaluate.py)
    build.py       data streams, the model and its optimizers from a Config
    memory_estimate.py  the memory per rank a config needs on W processes (train.py --dry-run), from the meta device
    run_dir.py     the run directory, its lock, its recorded config
    run_log.py     train.log, metrics.jsonl, TensorBoard; W&B through wandb_log.py
    wandb_log.py   train.wandb: the run's scalars and config to Weights & Biases, one W&B run per run directory

May import: errors, utils, config, registry, runtime, data, model, optim, checkpoint, finetune.
Never imports experiments/ or launch/.
"""
