"""The runs under a dump folder, listed and compared: `python -m xlm_pkm.runs list|compare` (or xlm-pkm-runs).

    run_record.py   what one run directory holds: its config, events, test result, status (running, finished...)
    sizes.py        total and active parameters and training FLOPs per token of a config's model (meta device)
    table.py        the comparison table of runs: the keys that differ, sizes, perplexities, memories, tokens/s,
                    mean ± sd over the seeds of one config; markdown or CSV
    __main__.py     the command line: list DIR, compare RUN... [--by KEY] [--format markdown|csv]

May import: errors, utils, config, model.
"""
