"""Starting runs: the command lines of train.py, evaluate.py and generate.py, and SLURM submission.

    commands.py     the commands' entry points (train.py..., console commands): process defaults, then torch
    cli.py          train_main, evaluate_main, generate_main: the command lines of train.py, evaluate.py, generate.py
    resume.py       the command that resumes a stopped run, as it was launched
    run_config.py   the config a command line runs: a resumed run's own config.yaml, the overrides on top
    config_keys.py  train.py --keys: every config key, its default and its doc, read from the settings dataclasses
    slurm.py        one process per GPU on SLURM through submitit, requeued on its time limit

May import: errors, utils, config, registry, runtime, data, model, optim, checkpoint, finetune, train, inference,
runs.
"""
