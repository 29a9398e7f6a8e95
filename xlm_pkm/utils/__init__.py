"""Small helpers with no knowledge of models or runs.

    atomic.py    output files written whole or not at all (OutputError names the file)
    lock.py      one process at a time in a directory (DirectoryBusy)
    progress.py  a progress line on stderr every few seconds; durations as text
    program.py   the name a command was started by, for its usage and error lines
    stop_signals.py  the signals that stop train.py, handled from its first line (StoppedBySignal)
    sparse_grads.py  a row-sparse gradient coalesced without a sort when its rows are already in order, or
                     grouped into runs of equal rows without coalescing (no host sync)
    dtensors.py  DTensors (FSDP's shards) told apart and read locally, without importing them where none exist

May import: errors.
"""
