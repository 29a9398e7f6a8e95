"""The SLURM path against a real SLURM (scripts/local_slurm.sh: slurmctld and two slurmd on this machine).

`make test-cluster` starts the cluster, runs these (XLM_PKM_TEST_CLUSTER=1), and stops it; `make test`
skips them. Each job trains a tiny CPU model through scripts/train_slurm.sh
(submitit) and is compared with an uninterrupted run in this process. The jobs run one at a time
(sequential tests: the machine may have 2 cores); every wait has a deadline and fails with the job's
state and the end of its logs.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_two_processes_equal_one, logged_losses, read_events

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ["--gpus-per-node", "0", "--tasks-per-node", "1", "--cpus-per-task", "1"]
# ~40 s of training: long enough for SLURM's time-limit signal, which slurmctld sends from a check it
# makes every 30 s. The schedule does not depend on max_steps, so shorter runs log the same losses.
LONG = ("train.max_steps=4000", "train.log_every=50", "train.eval_every=1000", "train.num_threads=1")


pytestmark = pytest.mark.skipif(not os.environ.get("XLM_PKM_TEST_CLUSTER"),
                                reason="needs a SLURM cluster: `make test-cluster` starts one (scripts/local_slurm.sh)")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The cluster answers (sinfo) with two idle nodes."""
    proc = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and sum(map(int, proc.stdout.split())) == 2, \
        f"no idle 2-node SLURM cluster (SLURM_CONF={os.environ.get('SLURM_CONF')}): {proc.stderr.strip()}"


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def job_info(job: str) -> dict[str, str]:
    """JobState, Restarts, ... of a job that slurmctld still knows (MinJobAge)."""
    return dict(re.findall(r"(\w+)=(\S*)", scontrol("show", "job", "-o", job)))


def wait_for(condition, seconds: float, what: str, job: str | None = None, folder: Path | None = None):
    """condition()'s first truthy value within `seconds`; else fails with the job's state and logs."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    state = job_info(job) if job else {}
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(folder.glob("*.err"))) if folder else ""
    pytest.fail(f"{what}: not within {seconds:.0f} s (job {job}: {state.get('JobState')}, restarts "
                f"{state.get('Restarts')}){logs}")


def submit(tmp_path: Path, tiny_overrides, *args: str, nodes: int = 1) -> tuple[str, Path]:
    """scripts/train_slurm.sh with a tiny CPU run under tmp_path; (job id, submitit folder)."""
    cmd = [str(ROOT / "scripts" / "train_slurm.sh"), "--nodes", str(nodes), *LAUNCH,
           "--folder", str(tmp_path / "submitit" / "%j"), "--no-test", *tiny_overrides(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    return job, tmp_path / "submitit" / job


def finished(job: str, folder: Path, seconds: float = 240) -> dict[str, str]:
    """Waits until the job has COMPLETED; its final info."""
    def done():
        info = job_info(job)
        assert info["JobState"] not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), \
            f"job {job} ended {info['JobState']}:" + "".join(p.read_text()[-1500:] for p in folder.glob("*.err"))
        return info if info["JobState"] == "COMPLETED" else None
    return wait_for(done, seconds, f"job {job} to complete", job, folder)


def logged_step(run_dir: Path) -> int:
    """The last step logged in the run's metrics.jsonl (0 before the first)."""
    try:
        return max((e["step"] for e in read_events(run_dir)), default=0)
    except (FileNotFoundError, ValueError):  # not yet written, or a line being written
        return 0


def stops_and_resumes(run_dir: Path, reason: str) -> list[int]:
    """The steps at which the run stopped for `reason`, each followed by a resume at that step."""
    log = (run_dir / "train.log").read_text()
    stops = [int(s) for s in re.findall(rf"stopping at step (\d+) \({reason}\)", log)]
    for step in stops:
        assert f"resumed at step {step})" in log, log[-3000:]
    return stops


def test_two_nodes_equal_one_process_with_the_same_global_batch(tiny_overrides, reference_run, tmp_path):
    """train_slurm.sh, 2 nodes x 1 task, gloo: ranks from SLURM's environment, losses of one process."""
    extra = ("train.max_steps=4", "optim.values_optimizer=lazy_adam", "train.eval_every=2", "train.num_threads=1")
    single = reference_run(*extra, "data.batch_size=8")
    job, folder = submit(tmp_path, tiny_overrides, *extra, "data.batch_size=4", nodes=2)
    finished(job, folder)
    run_dir = tmp_path / "tiny" / job  # named by the SLURM job id
    assert "2 process(es)" in (run_dir / "train.log").read_text()
    assert_two_processes_equal_one(run_dir, single)


def test_requeued_job_resumes_exactly(tiny_overrides, reference_run, tmp_path):
    """`scontrol requeue` mid-run (SIGTERM, SLURM requeues): the requeued job resumes where it stopped
    and logs the uninterrupted run's losses, bit for bit."""
    reference = reference_run(*LONG)
    job, folder = submit(tmp_path, tiny_overrides, *LONG)
    run_dir = tmp_path / "tiny" / job
    wait_for(lambda: logged_step(run_dir) >= 500, 120, "step 500", job, folder)
    scontrol("requeue", job)
    info = finished(job, folder, seconds=300)
    assert int(info["Restarts"]) >= 1
    stops = stops_and_resumes(run_dir, "SIGTERM")
    assert stops and all(0 < s < 4000 for s in stops)
    assert logged_losses(run_dir) == logged_losses(reference.run_dir)


def test_time_limit_warning_requeues_and_resumes_exactly(tiny_overrides, tiny_run, tmp_path):
    """The time limit's warning (USR2 55 s before a 1-minute limit; slurmctld sends it at its next
    periodic check, so when is up to SLURM): the job checkpoints, requeues itself and resumes at the
    step it stopped. The run is longer than any limit, so the signal always comes mid-training; once it
    has resumed and trained on, scancel ends it, and its losses equal an uninterrupted run's."""
    job, folder = submit(tmp_path, tiny_overrides, "--time", "1", "--signal-delay", "55",
                         "train.max_steps=1000000", *LONG[1:])
    run_dir = tmp_path / "tiny" / job

    def log():
        return (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    stop = int(wait_for(lambda: re.search(r"stopping at step (\d+) \(SIGUSR2\)", log()), 180,
                        "the time limit's warning", job, folder).group(1))
    wait_for(lambda: f"resumed at step {stop})" in log(), 120, "the requeued job to resume", job, folder)
    wait_for(lambda: logged_step(run_dir) >= stop + 200, 120, "200 steps after the resume", job, folder)
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for(lambda: job_info(job)["JobState"] == "CANCELLED", 60, "the job to be cancelled", job, folder)
    assert int(job_info(job)["Restarts"]) >= 1 and f"SLURM job {job} requeued" in log()
    assert stops_and_resumes(run_dir, "SIGUSR2")[0] == stop
    ours = logged_losses(run_dir)
    reference = tiny_run(tmp_path / "reference", "train.exp_id=ref", f"train.max_steps={max(ours)}", *LONG[1:])
    assert ours == logged_losses(reference.run_dir)


def test_scancel_ends_the_job_and_the_run_resumes_by_hand(tiny_overrides, reference_run, tiny_run, tmp_path):
    """scancel's SIGTERM: a checkpoint, no requeue (it used to requeue itself and run again)."""
    reference = reference_run(*LONG)
    job, folder = submit(tmp_path, tiny_overrides, *LONG)
    run_dir = tmp_path / "tiny" / job
    wait_for(lambda: logged_step(run_dir) >= 300, 120, "step 300", job, folder)
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for(lambda: job_info(job)["JobState"] == "CANCELLED", 60, "the job to be cancelled", job, folder)
    time.sleep(15)  # longer than cred_expire: a requeued job would be back
    info = job_info(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0")
    log = (run_dir / "train.log").read_text()
    [stop] = [int(s) for s in re.findall(r"stopping at step (\d+) \(SIGTERM\)", log)]
    assert re.search(r"to resume \(with the same launcher and number of processes\): \S*python3? train.py ", log)
    resumed = tiny_run(tmp_path, *LONG, f"train.exp_id={job}", f"train.max_steps={stop // 50 * 50 + 100}")
    assert f"resumed at step {stop})" in (resumed.run_dir / "train.log").read_text()
    ours, full = logged_losses(run_dir), logged_losses(reference.run_dir)
    assert max(ours) > stop and all(ours[s] == full[s] for s in ours)


def test_time_limit_warning_during_start_up_requeues_the_job(tiny_overrides, tmp_path):
    """USR2 before the training loop (here: while train.py starts, right after submitit's handlers are
    set) goes to submitit, which requeued only a job with a checkpoint() method: TrainJob had none, so
    the job ended FAILED ("timed-out and not checkpointable"). Now it is requeued and finishes."""
    job, folder = submit(tmp_path, tiny_overrides, "--time", "1", "--signal-delay", "5", "train.max_steps=20",
                         "train.num_threads=1")
    rank0 = folder / f"{job}_0_log.out"
    wait_for(lambda: rank0.is_file() and "Loading pickle" in rank0.read_text(), 120, "the job to start", job, folder)
    time.sleep(0.3)  # the handlers are set at once; train.py's imports and set-up take seconds
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    info = finished(job, folder)
    assert int(info["Restarts"]) >= 1
    submitit_log = rank0.read_text() + (folder / f"{job}_0_log.err").read_text()  # its info, its warnings
    assert "Caught signal SIGUSR2" in submitit_log and "Calling checkpoint method" in submitit_log, submitit_log[-2000:]
    assert max(logged_losses(tmp_path / "tiny" / job)) == 20


def _processes_of_node(node: str, job: str) -> list[int]:
    """The job's tasks on `node` (by their SLURM environment) and the slurmstepd above each."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"SLURMD_NODENAME={node}".encode() in env and f"SLURM_JOB_ID={job}".encode() in env:
            pids += [int(proc.name), int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])]  # + parent
    return pids


class NodeLoss:
    """kill -9 of a node's slurmd and of a job's processes there; restore() starts the slurmd again."""

    def __init__(self):
        self.lost: list[str] = []

    def lose(self, node: str, job: str) -> None:
        pidfile = Path(os.environ["SLURM_CONF"]).parent / "pids" / f"slurmd.{node}.pid"
        victims = [int(pidfile.read_text()), *_processes_of_node(node, job)]
        assert len(victims) >= 3, f"the job's processes on {node} were not found"
        self.lost.append(node)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)

    def restore(self) -> None:
        while self.lost:
            subprocess.run(["slurmd", "-f", os.environ["SLURM_CONF"], "-N", self.lost.pop()], check=True, timeout=60)


@pytest.fixture
def node_loss():
    """A NodeLoss whose nodes are back at the end of the test, whatever happens."""
    loss = NodeLoss()
    yield loss
    loss.restore()


def test_node_loss_is_one_line_and_the_last_checkpoint_resumes(tiny_overrides, tmp_path, node_loss):
    """kill -9 of slurmd n2 and its job step mid-run: rank 0 ends at once with one line naming rank 1 (no
    hang, no traceback); SLURM requeues the job for the node failure, and once n2 is back the job resumes
    from its last checkpoint (train.save_every_steps) and finishes."""
    job, folder = submit(tmp_path, tiny_overrides, "train.max_steps=1200", "train.log_every=50",
                         "train.save_every_steps=100", "train.num_threads=1", "train.collective_timeout_minutes=0.25",
                         nodes=2)
    run_dir = tmp_path / "tiny" / job
    wait_for(lambda: logged_step(run_dir) >= 300, 120, "step 300", job, folder)
    node_loss.lose("n2", job)
    killed_after = logged_step(run_dir)
    rank0 = folder / f"{job}_0_log.err"
    line = wait_for(lambda: re.search(r"^train\.py: error: .*$", rank0.read_text(), re.M), 60,
                    "rank 0's one-line error", job, folder).group(0)
    # n1 and n2 share this host, so rank 0 sees rank 1's process gone ("died"); across hosts it sees the heartbeat
    # stop ("stopped answering"): either names rank 1 on one line
    assert re.search(r"rank 0: a collective operation failed( or timed out)?: rank\(s\) 1 (died|stopped answering)",
                     line), line
    assert "Traceback" not in rank0.read_text()
    wait_for(lambda: int(job_info(job)["Restarts"]) >= 1, 120, "SLURM to requeue the job of the lost node", job, folder)
    node_loss.restore()
    finished(job, folder)
    log = (run_dir / "train.log").read_text()
    resumed_at = int(re.findall(r"resumed at step (\d+)\)", log)[-1])
    assert resumed_at % 100 == 0 and killed_after - 100 <= resumed_at <= killed_after
    assert max(logged_losses(run_dir)) == 1200


def test_preprocessing_as_slurm_array_jobs_is_byte_identical_to_the_local_run(tiny_corpus, tmp_path):
    """preprocess --slurm-partition debug: each step's chunks as a real SLURM job array."""
    common = [sys.executable, "-m", "xlm_pkm.data.preprocess", "--input", str(tiny_corpus), "--bpe-codes", "200",
              "--valid-docs", "2", "--test-docs", "2", "--chunk-mb", "0.1", "--keep-intermediate"]
    for out, extra in (("local", ["--workers", "1"]), ("slurm", ["--slurm-partition", "debug", "--slurm-time", "10"])):
        proc = subprocess.run([*common, "--output", str(tmp_path / out), *extra], capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    arrays = {}  # array job id -> its tasks, of the jobs that wrote logs under tmp_path/slurm
    for line in scontrol("show", "job", "-o").splitlines():
        info = dict(re.findall(r"(\w+)=(\S*)", line))
        if "ArrayTaskId" in info and info["StdErr"].startswith(str(tmp_path / "slurm")):
            assert info["JobState"] == "COMPLETED", line
            arrays.setdefault(info["ArrayJobId"], []).append(info["ArrayTaskId"])
    assert len(arrays) >= 3 and max(map(len, arrays.values())) >= 2, arrays  # hash, scan, tokenize, ... in chunks
    outputs = sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*")
                     if p.is_file() and p.name not in ("meta.json", "preprocess.lock"))
    assert len(outputs) >= 8  # codes, vocab, shards, the kept .tok and .bpe files
    _, different, missing = filecmp.cmpfiles(tmp_path / "local", tmp_path / "slurm", outputs, shallow=False)
    assert (different, missing) == ([], [])
    meta = [json.loads((tmp_path / out / "meta.json").read_text()) for out in ("local", "slurm")]
    for m in meta:
        del m["seconds"]  # each step's duration
    assert meta[0] == meta[1]  # every output's size and hash, the plan, the counts


def test_reproduce_array_job_on_slurm(tiny_data_dir, tmp_path):
    """scripts/reproduce.sh --slurm: the jobs unpickle (they used to need __main__'s lru_cache) and finish."""
    tiny = ["model.dim=16", "model.n_heads=2", "model.max_len=16", "model.memory.n_keys=8", "model.memory.k_dim=16",
            "model.memory.heads=2", "model.memory.knn=4", "data.batch_size=4", "data.bptt=16", "train.max_steps=3",
            "train.eval_every=3", "train.eval_max_batches=2", "train.device=cpu", "train.num_threads=1"]
    cmd = [str(ROOT / "scripts" / "reproduce.sh"), "table3", "--scale", "tiny", "--dump", str(tmp_path / "runs"),
           "--data", str(tiny_data_dir), "--only", "table3_position1", "--test-max-batches", "4", "--set", *tiny,
           "--slurm", "--partition", "debug", "--gpus-per-node", "0", "--cpus-per-task", "1", "--time", "10",
           "--folder", str(tmp_path / "submitit" / "%j")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = re.search(r"table3_position1: job (\S+)", proc.stdout).group(1)
    test_json = tmp_path / "runs" / "table3_position1" / "tiny" / "test.json"
    wait_for(test_json.is_file, 180, "the run's test.json", job.split("_")[0], tmp_path / "submitit" / job)
