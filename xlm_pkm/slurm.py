"""Launch training on SLURM with submitit, one process per GPU.

    python -m xlm_pkm.slurm --nodes 4 --gpus-per-node 8 --partition learn --time 4320 \\
        --config configs/paper/l12_d1024_m1.yaml optim.lr=1e-4

Arguments it does not know (config overrides, --no-test) go to train.py. The run's exp_id is the SLURM job id (unless given), which survives a requeue. SLURM sends USR2
`--signal-delay` seconds before the time limit (and SIGTERM on pre-emption): every rank saves
checkpoint.pt at the next step boundary, rank 0 requeues the job, and the requeued job resumes.
`--cluster local` runs the same job as local processes; `--cluster debug` in this process.

The SLURM look-ups of a run live here too: its job id, the rendezvous of srun-launched ranks, the
requeue. Importing this module needs no submitit (the launcher imports it when it runs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def job_id() -> str | None:
    """The SLURM job id (the same after a requeue), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID")


def set_rendezvous_env() -> None:
    """MASTER_ADDR/PORT for ranks started by srun without torchrun: the allocation's first host."""
    hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
    os.environ["MASTER_ADDR"] = hosts.split()[0].decode()
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))


def requeue(log) -> None:
    """Puts this SLURM job back in the queue; the requeued job resumes from checkpoint.pt."""
    log.info(f"requeuing SLURM job {job_id()}")
    subprocess.run(["scontrol", "requeue", job_id()], check=True)


class TrainJob:
    """The callable submitit pickles: sets up torch.distributed variables, then runs train.py's main.
    A run stopped by a signal (exit status 75, it requeued itself) is not a failure."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def __call__(self) -> int:
        import submitit

        from xlm_pkm.cli import EXIT_STOPPED, train_main

        job = submitit.JobEnvironment()
        if job.num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        argv = self.argv
        if not any(a.startswith("train.exp_id=") for a in argv):
            argv = [*argv, f"train.exp_id={job.job_id}"]
        status = train_main(argv)
        if status not in (0, EXIT_STOPPED):
            raise RuntimeError(f"train.py exited with status {status}; see the job's stderr")
        return status


def main(argv: list[str] | None = None):
    import submitit

    from xlm_pkm.cli import DEFAULT_CONFIG

    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.slurm", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="one task (process) per GPU; 0 for CPU jobs")
    parser.add_argument("--tasks-per-node", type=int, default=0, help="default: gpus-per-node (or 1)")
    parser.add_argument("--cpus-per-task", type=int, default=10)
    parser.add_argument("--mem-gb", type=int, default=0, help="0: the partition's default")
    parser.add_argument("--partition", default="")
    parser.add_argument("--time", type=int, default=4320, help="time limit in minutes")
    parser.add_argument("--signal-delay", type=int, default=120, help="seconds between USR2 and the time limit")
    parser.add_argument("--job-name", default="xlm-pkm")
    parser.add_argument("--folder", default="dumped/slurm/%j", help="submitit's logs and pickles")
    parser.add_argument("--cluster", default=None, choices=["slurm", "local", "debug"], help="default: auto")
    args, train_args = parser.parse_known_args(argv)  # the rest goes to train.py: overrides, --no-test

    executor = submitit.AutoExecutor(folder=args.folder, cluster=args.cluster)
    tasks = args.tasks_per_node or max(args.gpus_per_node, 1)
    params = {"timeout_min": args.time, "nodes": args.nodes, "tasks_per_node": tasks,
              "cpus_per_task": args.cpus_per_task, "name": args.job_name}
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.mem_gb:
        params["mem_gb"] = args.mem_gb
    if args.partition:
        params["slurm_partition"] = args.partition
    if executor.cluster == "slurm":
        params["slurm_signal_delay_s"] = args.signal_delay
    executor.update_parameters(**params)
    job = executor.submit(TrainJob(["--config", args.config, *train_args]))
    print(f"submitted job {job.job_id}; logs in {args.folder.replace('%j', str(job.job_id))}")
    if executor.cluster == "debug":  # runs here, now
        job.result()
    return job


if __name__ == "__main__":
    main()
    sys.exit(0)
