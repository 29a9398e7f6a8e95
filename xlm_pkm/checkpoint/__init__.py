"""Checkpoints: files written whole and finite, sharded value files, a run's checkpoints, trained models.

    files.py            save_atomic, load (with checks), vocabulary and architecture checks, NonFiniteError
    dcp_tensors.py      checkpoint.pt's tensors through Distributed Checkpoint: every rank its part, resharded on load
    sharded_values.py   sharded memory values: one file per rank beside best.pt, re-sharded on load
    run_checkpoints.py  RunCheckpoints: a run's checkpoint.pt (resume, any number of processes) and best.pt (evaluation)
    trained.py          load_trained: a trained model from a run checkpoint or an exported folder, checked

May import: errors, utils, config, runtime, data, model.
"""
