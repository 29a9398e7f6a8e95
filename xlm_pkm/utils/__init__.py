"""Small helpers with no knowledge of models or runs.

    atomic.py    output files written whole or not at all (OutputError names the file)
    lock.py      one process at a time in a directory (DirectoryBusy)
    path_component.py  a name from a config that becomes one file or folder name (no /, no .., <= 255 bytes)
    path_kind.py  whether a path the user gave is a file or a folder to read (not a pipe, a broken link), in words
    progress.py  a progress line on stderr every few seconds; durations as text
    program.py   the name a command was started by, for its usage and error lines
    stop_signals.py  the signals that stop train.py, handled from its first line (StoppedBySignal)
    sparse_grads.py  a row-sparse gradient coalesced without a sort when its rows are already in order, or
                     grouped into runs of equal rows without coalescing (no host sync)
    dtensors.py  DTensors (FSDP's shards) told apart and read locally, without importing them where none exist
    chunks.py    a large tensor read a slice at a time: reductions without a temporary of its size

May import: errors.
"""
