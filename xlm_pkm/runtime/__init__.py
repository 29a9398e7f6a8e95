"""Where and how this process runs: device and precision, ranks and collectives, SLURM's environment.

    precision.py    fp32 | fp16 | bf16 through torch.amp (autocast, GradScaler); the device from its name (DEVICES)
    distributed.py  the process group from torchrun's or srun's variables; collectives, DDP, a lost rank's error
    fsdp.py         train.parallel=fsdp: the dense model fully sharded (FSDP2), the memory tables kept out
    slurm_env.py    what a running job reads from SLURM: job id, restarts, requeue
    hardware.py     the device's peak FLOP/s and bandwidth, for MFU

The launchers (launch/) start processes; this package is what every process, and every layer above
it (checkpoints, training, evaluation), asks about its own.

May import: errors, utils.
"""
