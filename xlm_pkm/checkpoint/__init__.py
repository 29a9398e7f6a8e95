"""Checkpoints: files written whole and finite, sharded value files, a run's checkpoints, trained models.

    safe_load.py        load_torch_file: a torch file read as data (weights_only), never as code
    files.py            save_atomic, load (with checks), vocabulary and architecture checks, NonFiniteError
    dcp_tensors.py      checkpoint.pt's tensors through Distributed Checkpoint: every rank its part, resharded on load
    dcp_reader.py       Distributed Checkpoint's folders read as data: .metadata unpickled with an allow-list
    sharded_values.py   sharded memory values: one file per rank beside best.pt, re-sharded on load
    run_checkpoints.py  RunCheckpoints: a run's checkpoint.pt (resume, any number of processes) and best.pt (evaluation)
    trained.py          load_trained: a trained model from a run checkpoint or an exported folder (its files'
                        hashes), checked

May import: errors, utils, config, runtime, data, model.
"""
