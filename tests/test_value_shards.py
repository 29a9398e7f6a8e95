"""Memory values sharded across ranks (model.memory.shard_values): against the unsharded model.

The multi-process checks run W gloo processes on the CPU (torch.multiprocessing.spawn); each builds
the unsharded reference too, from the same seed, and compares in float32: outputs, losses, every
gradient, one optimizer step (clipped), the memory statistics, the fp16 skip decision, and the
sharded checkpoint files re-read for other world sizes. A value file missing, truncated or foreign stops
every rank with one line (on resume, also under torchrun, and in evaluation).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_VALUES, assert_two_processes_equal_one, spawn

from xlm_pkm.checkpoint import sharded_values
from xlm_pkm.config import Config
from xlm_pkm.launch.cli import evaluate_main
from xlm_pkm.model.memory import value_shards
from xlm_pkm.model.memory.pkm import MemoryConfig
from xlm_pkm.model.memory.value_shards import ValueShard, init_shard
from xlm_pkm.model.memory.value_stores import TableValues
from xlm_pkm.model.transformer import ModelConfig, TransformerLM
from xlm_pkm.optim.optimizers import OptimConfig, Optimizers, value_optimizer
from xlm_pkm.runtime.distributed import DistEnv, average_value_grads_
from xlm_pkm.train.step import optimizer_update
from xlm_pkm.utils.atomic import OutputError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n_slots, dim, world", [(100, 12, 4), (37, 3, 3), (5, 8, 2)])
def test_shard_init_is_the_columns_of_the_unsharded_init(monkeypatch, n_slots, dim, world):
    monkeypatch.setattr(value_shards, "INIT_CHUNK_ROWS", 16)  # several chunks and a long last one
    torch.manual_seed(0)
    full = TableValues(MemoryConfig(), dim, dim, n_slots).weight.detach()
    after = torch.rand(3)
    for rank in range(world):
        torch.manual_seed(0)
        shard = ValueShard(rank, world)
        weight = torch.empty(n_slots, shard.width(dim))
        init_shard(weight, dim, shard)
        assert torch.equal(weight, full[:, shard.columns(dim)])
        assert torch.equal(torch.rand(3), after)  # the random stream is consumed as by the whole table
    assert full.std().item() == pytest.approx(dim**-0.5, rel=0.2)


def tiny_config(shard: bool, values_optimizer: str, shared: bool = False) -> Config:
    """One memory at layer 2, or (shared) memories at layers 1 and 2 reading one value table."""
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_len=8,
                            mem_layers=[1, 2] if shared else [2])
    cfg.model.memory.share_values = shared
    cfg.model.memory.n_keys, cfg.model.memory.k_dim, cfg.model.memory.heads, cfg.model.memory.knn = 6, 8, 2, 4
    cfg.model.memory.query_norm = "layernorm"  # per token: BatchNorm's batch statistics are per rank
    cfg.model.memory.shard_values = shard
    # eps large enough that Adam does not turn float rounding of near-zero gradients into full steps
    cfg.optim = OptimConfig(values_optimizer=values_optimizer, clip_grad_norm=0.05, values_lr=0.1, lr=0.01,
                            eps=1e-3, values_eps=1e-3)
    return cfg


def build(cfg: Config) -> tuple[TransformerLM, Optimizers]:
    torch.manual_seed(0)
    model = TransformerLM(cfg.model)
    model.set_sparse_values(value_optimizer(cfg.optim).sparse)
    return model, Optimizers(model, cfg.optim)


def dense_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def check_against_reference(rank: int, world: int, folder: str) -> None:
    """Runs on each of `world` ranks: the sharded model against the unsharded one (dense values with
    AdamW, sparse with LazyAdam, a table shared by two memories), on 2·world sequences (this rank's two
    are rows [2·rank, 2·rank + 2) of the reference's batch)."""
    env, device, close = DistEnv(rank, rank, world), torch.device("cpu"), dict(rtol=1e-5, atol=1e-6)
    tokens = torch.randint(0, 50, (2 * world, 9), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    mine = slice(2 * rank, 2 * rank + 2)
    for values_optimizer, shared in (("adam", False), ("lazy_adam", False), ("lazy_adam", True)):
        ref, ref_opt = build(tiny_config(False, values_optimizer, shared))
        model, opt = build(tiny_config(True, values_optimizer, shared))
        (_, memory), (_, ref_memory) = model.memories()[0], ref.memories()[0]
        columns = memory.values.weight.value_shard.columns(16)
        assert memory.values.weight.value_shard == ValueShard(rank, world)
        assert memory.values.weight.shape == (36, 16 // world)
        assert torch.equal(memory.values.weight, ref_memory.values.weight[:, columns])
        assert model.param_counts() == ref.param_counts()  # sharded tables count whole

        # forward and backward: the reference on the whole batch, this rank on its rows, DDP's mean
        ref_nll = ref(x, targets=y)
        ref_nll.mean().backward()
        nll = model(x[mine], targets=y[mine])
        torch.testing.assert_close(nll, ref_nll[mine], **close)
        nll.mean().backward()
        for p in model.parameters():
            if not hasattr(p, "value_shard"):
                dist.all_reduce(p.grad)
                p.grad /= world
        average_value_grads_(list(model.memory_value_parameters()), env)
        assert memory.values.weight.grad.is_sparse == (values_optimizer == "lazy_adam")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            expected = dense_grad(q)[:, columns] if hasattr(p, "value_shard") else dense_grad(q)
            torch.testing.assert_close(dense_grad(p), expected, **close, msg=name)

        # one clipped step (the values' norm spans every rank's columns)
        norms, _, skipped = optimizer_update(opt, torch.amp.GradScaler("cpu", enabled=False), nll.mean())
        ref_norms, _, _ = optimizer_update(ref_opt, torch.amp.GradScaler("cpu", enabled=False), ref_nll.mean())
        assert not skipped and norms["values"] > 0.05  # clipping was active
        torch.testing.assert_close(norms["values"], ref_norms["values"], **close)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q[:, columns] if hasattr(p, "value_shard") else q, **close)

    # memory statistics: each rank's reads summed over ranks equal the reference's
    for m in (model, ref):
        m.eval()
        m.set_memory_stats(True)
    with torch.no_grad():
        model(x[mine])
        ref(x)
    for buffer in (memory.slot_stats.weights, memory.slot_stats.counts):
        dist.all_reduce(buffer)
    stats, ref_stats = memory.stats(), ref_memory.stats()
    assert stats == pytest.approx(ref_stats, rel=1e-6)  # the weights: float rounding of the stepped queries
    assert torch.equal(memory.slot_stats.counts, ref_memory.slot_stats.counts)  # the same slots read
    # the norms' (sum, count) pairs summed over ranks (this rank's columns and positions) give the whole's means
    ref_sums = ref_memory.norm_sums()
    for name, sums in memory.norm_sums().items():
        dist.all_reduce(sums)
        assert (sums[0] / sums[1]).item() == pytest.approx((ref_sums[name][0] / ref_sums[name][1]).item(), rel=1e-6)
    assert sorted(ref_sums) == ["out_norm", "value_abs_mean"]
    model.train()

    # fp16: an overflow in one rank's shard skips the step on every rank
    before = memory.values.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    loss = model(x[mine], targets=y[mine]).mean()
    scaler.scale(loss).backward()
    if rank == world - 1:
        memory.values.weight.grad = memory.values.weight.grad.coalesce() * float("inf")
    _, _, skipped = optimizer_update(opt, scaler, loss)
    assert skipped and torch.equal(memory.values.weight, before)

    # checkpoint files: saved by `world` ranks, read back for this rank, for one process and for 2
    record = {"step": 7, "config": {}, "model": model.state_dict(), "optimizers": opt.state_dict()}
    path = Path(folder) / "checkpoint.pt"
    main = sharded_values.save(record, path, model, env, device)
    if rank == 0:
        torch.save(main, path)
    dist.barrier()
    name = "blocks.1.sublayers.1.values.weight"
    assert name not in main["model"] and "values" not in main["optimizers"]
    own = sharded_values.attach(torch.load(path, weights_only=False), path, memory.values.weight.value_shard)
    assert torch.equal(own["model"][name], memory.values.weight)
    state = opt.state_dict()["values"]["state"][0]
    assert torch.equal(own["optimizers"]["values"]["state"][0]["exp_avg"], state["exp_avg"])
    whole = sharded_values.attach(torch.load(path, weights_only=False), path, None)
    gathered = [torch.empty_like(memory.values.weight) for _ in range(world)]
    dist.all_gather(gathered, memory.values.weight.detach())
    assert torch.equal(whole["model"][name], torch.cat(gathered, dim=1))
    for r in range(2):
        half = sharded_values.attach(torch.load(path, weights_only=False), path, ValueShard(r, 2))
        assert torch.equal(half["model"][name], torch.cat(gathered, dim=1)[:, r * 8: (r + 1) * 8])
        assert half["optimizers"]["values"]["state"][0]["step"] == state["step"]

    # a checkpoint of replicated values, loaded by a run that now shards them: each rank cuts its columns
    replicated = path.parent / "replicated.pt"
    if rank == 0:
        torch.save({"step": 7, "model": ref.state_dict(), "optimizers": ref_opt.state_dict()}, replicated)
    dist.barrier()
    cut = sharded_values.attach(torch.load(replicated, weights_only=False), replicated,
                                memory.values.weight.value_shard, sharded_values.sharded_names(model))
    assert torch.equal(cut["model"][name], ref_memory.values.weight[:, columns])
    ref_state = ref_opt.state_dict()["values"]["state"][0]
    assert torch.equal(cut["optimizers"]["values"]["state"][0]["exp_avg"], ref_state["exp_avg"][:, columns])
    model.load_state_dict(cut["model"])

    # one rank cannot write its file: every rank raises, so rank 0 writes no checkpoint.pt naming it
    def full_disk(obj, target):
        raise OutputError(f"{target}: no space left on device")

    writer = sharded_values.save_atomic
    if rank == world - 1:
        sharded_values.save_atomic = full_disk
    try:
        with pytest.raises(OutputError, match="no space left" if rank == world - 1 else "another rank"):
            sharded_values.save({**record, "step": 8}, path, model, env, device)
    finally:
        sharded_values.save_atomic = writer


def check_uneven_token_counts(rank: int, world: int) -> None:
    """sharded_read with another token count on each rank (rank r reads r + 1 tokens) against read_values
    on the whole table: output, the weights' gradient and this rank's columns of the table's gradient."""
    from xlm_pkm.model.memory.sharded_read import sharded_read
    from xlm_pkm.model.memory.value_read import read_values

    g = torch.Generator().manual_seed(2)
    table = torch.randn(30, 8, generator=g, dtype=torch.float64)
    counts = [r + 1 for r in range(world)]
    indices = torch.randint(0, 30, (sum(counts), 5), generator=g)
    weights = torch.rand(sum(counts), 5, generator=g, dtype=torch.float64)
    grad_out = torch.randn(sum(counts), 8, generator=g, dtype=torch.float64)
    mine, columns = slice(sum(counts[:rank]), sum(counts[: rank + 1])), ValueShard(rank, world).columns(8)
    for sparse in (False, True):
        ref_table, ref_weights = table.clone().requires_grad_(), weights.clone().requires_grad_()
        read_values(ref_table, indices, ref_weights, sparse).backward(grad_out)
        shard, own = table[:, columns].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        out = sharded_read(shard, indices[mine], own, sparse)
        out.backward(grad_out[mine])
        torch.testing.assert_close(out, read_values(table, indices, weights, False)[mine])
        torch.testing.assert_close(own.grad, ref_weights.grad[mine])
        torch.testing.assert_close(dense_grad(shard), dense_grad(ref_table)[:, columns])


def check_all(rank: int, world: int, folder: str) -> None:
    check_against_reference(rank, world, folder)
    check_uneven_token_counts(rank, world)


@pytest.mark.slow
def test_sharded_model_on_4_processes_equals_unsharded(tmp_path):
    spawn(check_all, 4, tmp_path)


def check_then_train(rank: int, world: int, folder: str) -> None:
    """check_all; the tiny run with sharded values to step 2, resumed to step 4 (train.py's
    way), its checkpoint evaluated on the W processes (each loads its columns); the tiny run with
    replicated dense values (DDP's all-reduce) to step 4; the sharded run resumed and loaded without the
    last rank's file of its tensors. All in one start-up of W processes."""
    import json

    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.config import load_config
    from xlm_pkm.train.evaluation import evaluate_checkpoint
    from xlm_pkm.train.trainer import Trainer

    check_all(rank, world, folder)
    overrides = json.loads((Path(folder) / "overrides.json").read_text())
    for steps, run in ((2, "sharded"), (4, "sharded"), (4, "replicated")):
        trainer = Trainer(load_config(None, [*overrides[run], f"train.max_steps={steps}"]), test=False)
        assert trainer.resumed == (steps == 4 and run == "sharded")
        trainer.train()
        trainer.close()
    result = evaluate_checkpoint(Path(folder) / "tiny" / "sharded" / "checkpoint.pt", "valid", batch_size=32,
                                 max_batches=2, env=DistEnv(rank, rank, world))
    if rank == 0:
        (Path(folder) / "evaluated.json").write_text(json.dumps(result))

    # the file the last rank wrote (its columns, and replicated tensors DCP gave it) missing: every rank stops with
    # the same line (none goes on into training, waiting for the others)
    damaged = Path(folder) / "missing" / "tiny" / "sharded"
    lost = damaged / "checkpoint.dcp" / "step4" / f"__{world - 1}_0.distcp"
    if rank == 0:
        shutil.copytree(Path(folder) / "tiny" / "sharded", damaged)
        lost.unlink()
    dist.barrier()
    unreadable = re.escape(f"{damaged}/checkpoint.pt: its tensors in {damaged}/checkpoint.dcp/step4 cannot be read (")
    missing = re.escape(f"No such file or directory: {lost}); restore the whole checkpoint.dcp/ folder of that "
                        f"checkpoint")
    with pytest.raises(ValueError, match=unreadable + r"rank \d: " + missing):
        Trainer(load_config(None, [*overrides["sharded"], f"train.dump_path={damaged.parents[1]}",
                                   "train.max_steps=6"]), test=False)
    with pytest.raises(ValueError, match=unreadable + missing):  # evaluate.py's load: each rank reads alone
        load_trained(damaged / "checkpoint.pt", env=DistEnv(rank, rank, world))


@pytest.mark.slow
def test_2_processes_sharded_and_replicated_equal_one_process(tiny_overrides, reference_run, tmp_path, capsys):
    """On 2 processes: the sharded model against the unsharded one, then training with sharded (LazyAdam,
    resumed) and replicated dense values (AdamW), each equal to one process with the same global batch.
    Then the sharded run, one value file truncated, resumed under torchrun and evaluated (truncated_shard)."""
    import json

    from xlm_pkm.train.evaluation import evaluate_checkpoint

    common = ("train.max_steps=4", "train.eval_every=2")
    runs = {"sharded": ("optim.values_optimizer=lazy_adam", "model.memory.shard_values=true"),
            "replicated": ("optim.values_optimizer=adam",)}
    overrides = {run: tiny_overrides(tmp_path, *common, *extra, "data.batch_size=4", f"train.exp_id={run}",
                                     "train.num_threads=1") for run, extra in runs.items()}
    (tmp_path / "overrides.json").write_text(json.dumps(overrides))
    spawn(check_then_train, 2, tmp_path)

    singles = {run: reference_run(*common, extra[0], "data.batch_size=8") for run, extra in runs.items()}
    for run, single in singles.items():
        assert_two_processes_equal_one(tmp_path / "tiny" / run, single)
    run = tmp_path / "tiny" / "sharded"
    assert sorted(f.name for f in (run / "checkpoint.dcp" / "step4").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                   "__1_0.distcp"]
    assert sorted(f.name for f in (run / "best.values").iterdir()) == ["step4.rank0-of-2.pt", "step4.rank1-of-2.pt"]
    sharded = evaluate_checkpoint(run / "checkpoint.pt", "valid", max_batches=2)  # one process: whole tables
    unsharded = evaluate_checkpoint(singles["sharded"].run_dir / "checkpoint.pt", "valid", max_batches=2)
    assert sharded["ppl"] == pytest.approx(unsharded["ppl"], rel=1e-3)
    assert sharded["memories"][0]["usage"] == pytest.approx(unsharded["memories"][0]["usage"], abs=0.5)
    on_two = json.loads((tmp_path / "evaluated.json").read_text())  # one process's 2 batches of 32, split in 2
    assert on_two["tokens"] == sharded["tokens"] and on_two["ppl"] == pytest.approx(sharded["ppl"], rel=1e-6)
    assert on_two["memories"][0] == pytest.approx(sharded["memories"][0], rel=1e-6)
    truncated_shard(run, overrides["sharded"], tmp_path / "truncated", capsys)


def truncated_shard(run: Path, overrides: list[str], dump: Path, capsys) -> None:
    """The 2-process sharded run `run` (step 4), copied with the file of tensors rank 1 wrote cut short:
    train.py resuming it under torchrun ends at once on both ranks, exit status 2, the same line on each rank's
    stderr, nothing written (never one rank alone, after the collective timeout, while the other trains on);
    evaluate.py on one process: one line."""
    copy = dump / "tiny" / run.name
    shutil.copytree(run, copy)
    shard = copy / "checkpoint.dcp" / "step4" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1024])  # every tensor of it cut short

    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    logs = dump / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--log-dir={logs}",
           "--redirects=3", str(ROOT / "train.py"), "--no-test", *overrides, f"train.dump_path={dump}",
           "train.max_steps=6", "train.collective_timeout_minutes=1"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=dump, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's own status when a rank fails
    err = {int(p.parent.name): p.read_text().strip().splitlines() for p in logs.rglob("stderr.log")}
    damaged = (re.escape(f"{copy}/checkpoint.pt: its tensors in {copy}/checkpoint.dcp/step4 cannot be read (")
               + r"(rank \d: )?\w+.*" + re.escape("); restore the whole checkpoint.dcp/ folder of that checkpoint"))
    assert sorted(err) == [0, 1] and all(len(lines) == 1 for lines in err.values()), err
    assert err[0] == err[1] and re.fullmatch("train.py: error: " + damaged, err[0][0]), err
    # each rank's status, from torchrun's report: 2, unless torchrun saw one rank's exit before the other's and
    # sent it SIGTERM (-15) as it was exiting too (its line written, so past the agreement)
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr, re.M)
    first = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr.split("Root Cause")[-1], re.M)
    assert first[:1] == ["2"] and len(codes) == 2 and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    assert elapsed < 45, elapsed  # start-up included (~6 s); a rank waiting out the 60 s timeout would not be
    assert files() == before  # nothing written or removed
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(copy / "checkpoint.pt"), "--split", "valid", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch("evaluate.py: error: " + damaged, err[0]), err


@pytest.mark.slow
def test_sharded_best_on_one_process_is_kept_whole_when_a_shard_cannot_be_written(tiny_run, tiny_trainer,
                                                                                       tmp_path, monkeypatch):
    run = tiny_run(tmp_path, "model.memory.shard_values=true", "train.max_steps=2", "train.exp_id=one").run_dir
    files = sorted(p.name for p in (run / "best.values").iterdir())
    assert files == ["step2.rank0-of-1.pt"]  # one process holds the one shard: the whole table
    before = (run / "best.pt").read_bytes()

    def full_disk(obj, target):
        raise OutputError(f"{target}: no space left on device")

    trainer = tiny_trainer(tmp_path, "model.memory.shard_values=true", "train.max_steps=3", "train.exp_id=one")
    try:
        trainer.train_step(iter(trainer.train_stream))
        monkeypatch.setattr(sharded_values, "save_atomic", full_disk)
        with pytest.raises(OutputError, match="step3.rank0-of-1.pt: no space left"):
            trainer.save_best()
    finally:
        trainer.close()
    assert (run / "best.pt").read_bytes() == before  # still names the step-2 files, which are there
    assert sorted(p.name for p in (run / "best.values").iterdir()) == files

    shard = run / "best.values" / files[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="value shard .*step2.rank0-of-1.pt is missing"):
        sharded_values.attach(torch.load(run / "best.pt", weights_only=False), run / "best.pt", None)
    shard.write_bytes(b"")
    with pytest.raises(ValueError, match=r"value shard .*step2.rank0-of-1.pt is truncated or damaged \(\w+: "):
        sharded_values.attach(torch.load(run / "best.pt", weights_only=False), run / "best.pt", None)
    torch.save(torch.zeros(3), shard)
    with pytest.raises(ValueError, match="step2.rank0-of-1.pt is a torch file, but not a value shard"):
        sharded_values.attach(torch.load(run / "best.pt", weights_only=False), run / "best.pt", None)


# ---- model.memory.shard_values=auto (issue 62.21) ---------------------------------------------------------------
@pytest.mark.parametrize("extra, world, shard", [
    (["train.parallel=fsdp"], 2, True),
    (["train.parallel=fsdp"], 1, False),  # one process: nothing to shard over
    (["train.parallel=fsdp"], 3, False),  # the width 32 does not divide by 3
    (["train.parallel=ddp"], 2, False),  # as before
    (["train.parallel=fsdp", "model.memory.values=peer"], 2, False),  # PEER's tables are not sharded
    (["train.parallel=fsdp", "model.memory.read_backward=one_pass"], 2, False),
    (["train.parallel=fsdp", "model.memory.shard_values=false"], 2, False),  # explicit: kept
    (["train.parallel=ddp", "model.memory.shard_values=true"], 2, True),
])
def test_shard_values_auto_shards_the_values_under_fsdp_where_the_width_divides(extra, world, shard):
    from xlm_pkm.config import load_config
    from xlm_pkm.train.build import resolved_config

    cfg = load_config(None, ["model.dim=32", "model.n_heads=2", "model.mem_layers=[1]", *extra])
    assert resolved_config(cfg, 50, "x", world).model.memory.shard_values is shard


def test_shard_values_takes_auto_true_or_false_only():
    from xlm_pkm.config import load_config
    from xlm_pkm.errors import ConfigError

    assert load_config(None, []).model.memory.shard_values == "auto"
    assert load_config(None, ["model.memory.shard_values=true"]).model.memory.shard_values is True
    for bad in ("1", "yes please", "[true]"):
        with pytest.raises(ConfigError, match=r"^model.memory.shard_values: expected one of auto \| true \| false, "
                                              r"got "):
            load_config(None, [f"model.memory.shard_values={bad}"])


def train_then_resume_by_default(rank: int, world: int, folder: str) -> None:
    """folder/runs.json: a fsdp run trained with shard_values=false (the old default), then resumed with the
    default (auto: sharded here), and a new fsdp run with the default: the resumed run holds its columns of the
    saved whole table and of its Adam moments."""
    import json

    from conftest import whole_checkpoint

    from xlm_pkm.config import load_config
    from xlm_pkm.train.trainer import Trainer

    runs = json.loads((Path(folder) / "runs.json").read_text())
    for name in ("old", "new"):
        trainer = Trainer(load_config(None, runs[name]), test=False)
        trainer.train()
        trainer.close()
    saved = whole_checkpoint(Path(folder) / "tiny" / "old" / "checkpoint.pt")
    trainer = Trainer(load_config(None, runs["resumed"]), test=False)
    try:
        assert trainer.resumed and trainer.cfg.model.memory.shard_values is True
        table = dict(trainer.model.named_parameters())[TINY_VALUES]
        columns = table.value_shard.columns(table.shape[1] * world)
        assert torch.equal(table.detach(), saved["model"][TINY_VALUES][:, columns])
        (group,) = [g for g in trainer.optimizers.groups if any(p is table for p in g.params)]
        moments = trainer.optimizers.state_dict()[group.name]["state"]
        index = [i for i, p in enumerate(group.params) if p is table][0]
        whole = saved["optimizers"][group.name]["state"][index]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[index][key], whole[key][:, columns]), key
    finally:
        trainer.close()


@pytest.mark.slow
def test_fsdp_shards_the_values_by_default_and_resumes_a_run_saved_replicated(tiny_overrides, tmp_path):
    """Under fsdp on 2 processes the tiny PKM's 32-wide table is sharded by default (the log says so and why); a run
    saved with shard_values=false (the default before) resumes with the default: each rank loads its columns of
    the saved table and of its Adam moments."""
    import json

    common = ["train.parallel=fsdp", "optim.values_optimizer=adam", "train.max_steps=2"]
    runs = {"old": tiny_overrides(tmp_path, *common, "model.memory.shard_values=false", "train.exp_id=old"),
            "new": tiny_overrides(tmp_path, *common, "train.exp_id=new"),
            "resumed": tiny_overrides(tmp_path, *common, "train.exp_id=old")}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    spawn(train_then_resume_by_default, 2, tmp_path)
    log = (tmp_path / "tiny" / "new" / "train.log").read_text()
    assert ("model.memory.shard_values=auto: true (train.parallel=fsdp on 2 processes, the value width 32 divides "
            "by 2): each rank holds 1/2 of every value table's columns and of their optimizer state; set it true or "
            "false to choose") in log
    before, after = (tmp_path / "tiny" / "old" / "train.log").read_text().split("resumed at step")
    assert "shard_values=auto" not in before and "model.memory.shard_values=auto: true" in after
