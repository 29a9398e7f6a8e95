"""Launch training on SLURM with submitit, one process per GPU (or per node on CPU).

    python -m xlm_pkm.launch.slurm --nodes 4 --gpus-per-node 8 --partition learn --time 4320 \\
        --config configs/paper/l12_d1024_m1.yaml optim.lr=1e-4
    python -m xlm_pkm.launch.slurm --nodes 2 --gpus-per-node 0 --cpus-per-task 4 --partition cpu ...  # CPU

Arguments it does not know (config overrides, --no-test) go to train.py. The run's exp_id is the SLURM
job id (unless given), which survives a requeue. SLURM sends USR2 `--signal-delay` seconds before the
time limit: every rank saves checkpoint.pt at the next step boundary, rank 0 requeues the job, and
the requeued job resumes (outside the training loop, submitit requeues it through
TrainJob.checkpoint). SIGTERM (scancel; pre-emption, which SLURM requeues itself) saves and stops
without requeueing. A request that no node of the partition can hold (GPUs on a CPU partition, more
CPUs than a node has) is refused with one line before submitting. `--cluster local` runs the same
job as local processes; `--cluster debug` in this process.

Reading SLURM's environment while a job runs is xlm_pkm/runtime/slurm_env.py's (low level); this module
launches, so it imports the command line (cli.py), but only when it runs: a job unpickles TrainJob
before submitit installs its signal handlers, and a USR2 arriving meanwhile would kill it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from xlm_pkm.errors import EXIT_STOPPED
from xlm_pkm.launch.commands import set_process_defaults


class LaunchError(ValueError):
    """A job that SLURM could not run as asked."""


class TrainJob:
    """The callable submitit pickles: sets up torch.distributed variables, then runs train.py's main.
    A run stopped by a signal (exit status 75) is not a failure; an error (its one line already on
    stderr) ends the task with train.py's exit status, without a traceback."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def __call__(self) -> int:
        set_process_defaults()  # before torch is imported, as train.py does
        import submitit

        from xlm_pkm.launch.cli import train_main  # not at unpickling: before submitit's signal handlers

        job = submitit.JobEnvironment()
        if job.num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        status = train_main(self.argv)
        if status not in (0, EXIT_STOPPED):
            raise SystemExit(status)
        return status

    def checkpoint(self):
        """submitit calls this on USR2 outside the training loop (start-up, the final test evaluation):
        the same job again, which resumes from the run's last checkpoint.pt."""
        import submitit

        return submitit.helpers.DelayedSubmission(TrainJob(self.argv))


def _gpus(gres: str) -> int:
    """GPUs in a sinfo %G field ('gpu:8', 'gpu:a100:4(S:0-1)', '(null)')."""
    return sum(int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def check_request(partition: str, nodes: int, tasks_per_node: int, cpus_per_task: int, gpus_per_node: int) -> None:
    """Refuses (LaunchError, one line) a request that no `nodes` nodes of the partition (default: the
    cluster's default partition) can hold, instead of a job that never starts."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%c|%G"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"cannot read the partitions with sinfo: {e}") from None
    rows = [line.split("|") for line in out.split()]
    name = partition or next((p.rstrip("*") for p, _, _ in rows if p.endswith("*")), "")
    found = [(int(cpus), _gpus(gres)) for p, cpus, gres in rows if p.rstrip("*") == name]
    where = f"partition {name!r}" if partition else f"the default partition {name!r}"
    if not found:
        raise LaunchError(f"{where} not found (sinfo lists: {', '.join(sorted({p for p, _, _ in rows}))})")
    if len(found) < nodes:
        raise LaunchError(f"--nodes {nodes}: {where} has {len(found)} node(s)")
    most_gpus, most_cpus = max(g for _, g in found), max(c for c, _ in found)
    if gpus_per_node > most_gpus:
        raise LaunchError(f"--gpus-per-node {gpus_per_node}: {where} has "
                          f"{f'at most {most_gpus} GPUs per node' if most_gpus else 'no GPUs'}"
                          f"{'' if most_gpus else '; use --gpus-per-node 0 (CPU jobs, one task per node)'}")
    if tasks_per_node * cpus_per_task > most_cpus:
        raise LaunchError(f"{tasks_per_node} task(s) per node x --cpus-per-task {cpus_per_task}: the nodes of "
                          f"{where} have at most {most_cpus} CPUs")


def main(argv: list[str] | None = None):
    import submitit

    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.launch.slurm", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="default: configs/default.yaml (a resumed run: its own config.yaml)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="one task (process) per GPU; 0 for CPU jobs")
    parser.add_argument("--tasks-per-node", type=int, default=0, help="default: gpus-per-node (or 1)")
    parser.add_argument("--cpus-per-task", type=int, default=10)
    parser.add_argument("--mem-gb", type=int, default=0, help="0: the partition's default")
    parser.add_argument("--partition", default="", help="default: the cluster's default partition")
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
        check_request(args.partition, args.nodes, tasks, args.cpus_per_task, args.gpus_per_node)
        params["slurm_signal_delay_s"] = args.signal_delay
    executor.update_parameters(**params)
    job = executor.submit(TrainJob([*(["--config", args.config] if args.config else []), *train_args]))
    print(f"submitted job {job.job_id}; logs in {args.folder.replace('%j', str(job.job_id))}")
    if executor.cluster == "debug":  # runs here, now
        job.result()
    return job


def run() -> int:
    """`python -m xlm_pkm.launch.slurm`: 0 once submitted; 2 with one line when the request is refused."""
    try:
        main()
    except LaunchError as e:
        print(f"xlm_pkm.launch.slurm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # through the importable module: its TrainJob then pickles by reference
    from xlm_pkm.launch import slurm

    sys.exit(slurm.run())
