"""train.parallel=fsdp against ddp, and checkpoint.pt resumed on another number of processes.

Every run here is several gloo processes on the CPU: Trainers in processes started by conftest.spawn, and
train.py under torchrun or started by hand. Each compares with an independent reference: the same run in ddp
mode, the uninterrupted run, the checkpoint as it was saved.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, logged_losses, spawn, whole_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# the memory designs, each with what its values exercise: sparse rows all-gathered or sharded by column,
# dense replicated ones all-reduced outside FSDP, accumulation (FSDP's gradient sync on the last micro-batch
# only), clipping per group and over all of them (the sharded gradients' norms)
CONFIGS = {
    "pkm": ("optim.values_optimizer=lazy_adam", "model.memory.shard_values=true", "optim.clip_grad_norm=0.5"),
    "peer": ("model.memory.values=peer", "optim.values_optimizer=adam", "optim.accumulate=2"),
    "engram": ("model.engram.layers=[1]", "model.engram.table_size=53", "model.engram.ngram_dim=16",
               "model.engram.heads=2", "optim.values_optimizer=lazy_adam", "optim.clip_grad_norm=0.5",
               "optim.clip_scope=global"),
}
STEPS = 20


def whole(run_dir: Path) -> dict:
    """A run's checkpoint.pt read whole on this process (model and optimizer tensors)."""
    return whole_checkpoint(Path(run_dir) / "checkpoint.pt")


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """{group.index.name: tensor} of a checkpoint's optimizer states."""
    return {f"{group}.{i}.{k}": v for group, saved in state["optimizers"].items()
            for i, values in saved["state"].items() for k, v in values.items() if isinstance(v, torch.Tensor)}


def train_each(rank: int, world: int, folder: str) -> None:
    """Trains every run of folder/runs.json ({exp_id: overrides}) to its end, one after another."""
    from xlm_pkm.config import load_config
    from xlm_pkm.train.trainer import Trainer

    for overrides in json.loads((Path(folder) / "runs.json").read_text()).values():
        trainer = Trainer(load_config(None, overrides), test=False)
        try:
            trainer.train()
        finally:
            trainer.close()


def train_in_both_modes(tiny_overrides, folder: Path, world: int, configs: dict, **more: tuple[str, ...]) -> None:
    """Each config of `configs` trained STEPS steps on `world` processes in ddp and in fsdp mode (exp_id
    NAME-ddp, NAME-fsdp under folder), and each of `more` (exp_id: overrides)."""
    runs = {f"{name}-{parallel}": tiny_overrides(folder, *extra, f"train.parallel={parallel}",
                                                 f"train.exp_id={name}-{parallel}", f"train.max_steps={STEPS}")
            for name, extra in configs.items() for parallel in ("ddp", "fsdp")}
    runs |= {name: tiny_overrides(folder, *extra, f"train.exp_id={name}", f"train.max_steps={STEPS}")
             for name, extra in more.items()}
    (folder / "runs.json").write_text(json.dumps(runs))
    spawn(train_each, world, folder)


def assert_fsdp_equals_ddp(folder: Path, name: str) -> None:
    """The fsdp run logged the ddp run's losses at every step, and ends with its weights and optimizer states."""
    ddp, fsdp = (folder / "tiny" / f"{name}-{parallel}" for parallel in ("ddp", "fsdp"))
    assert "(fsdp), precision" in (fsdp / "train.log").read_text()
    losses = logged_losses(ddp), logged_losses(fsdp)
    assert sorted(losses[0]) == sorted(losses[1]) == list(range(1, STEPS + 1))
    for step, loss in losses[0].items():
        assert math.isclose(losses[1][step], loss, rel_tol=1e-6), (name, step, losses[1][step], loss)
    states = whole(ddp), whole(fsdp)
    assert states[0]["model"].keys() == states[1]["model"].keys()
    for key, p in states[0]["model"].items():
        # the keys' part of attention's qkv bias gets a gradient that is zero but for float rounding (softmax
        # ignores it), which Adam turns into lr-sized steps: the two modes' reductions round differently
        atol = 1e-3 if key.endswith("qkv.bias") else 1e-6
        torch.testing.assert_close(states[1]["model"][key], p, rtol=1e-5, atol=atol, msg=f"{name}: {key}")
    adam = optimizer_tensors(states[0]), optimizer_tensors(states[1])
    assert adam[0].keys() == adam[1].keys() and adam[0]
    for key, t in adam[0].items():
        torch.testing.assert_close(adam[1][key], t, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


@pytest.mark.slow
def test_fsdp_equals_ddp_for_pkm_peer_and_engram_on_2_processes(tiny_overrides, tmp_path):
    """Also the PKM config in fsdp with bf16 (FSDP's mixed precision: blocks in bf16, the memory in float32):
    its losses track the float32 ones, not equal to them."""
    train_in_both_modes(tiny_overrides, tmp_path, 2, CONFIGS,
                        bf16=(*CONFIGS["pkm"], "train.parallel=fsdp", "train.precision=bf16"))
    for name in CONFIGS:
        assert_fsdp_equals_ddp(tmp_path, name)
    fp32, bf16 = logged_losses(tmp_path / "tiny" / "pkm-fsdp"), logged_losses(tmp_path / "tiny" / "bf16")
    assert sorted(bf16) == sorted(fp32) and bf16 != fp32
    for step, loss in fp32.items():
        assert math.isclose(bf16[step], loss, rel_tol=0.02), (step, bf16[step], loss)


@pytest.mark.slow
def test_fsdp_equals_ddp_on_4_processes(tiny_overrides, tmp_path):
    train_in_both_modes(tiny_overrides, tmp_path, 4, {"pkm": CONFIGS["pkm"]})
    assert_fsdp_equals_ddp(tmp_path, "pkm")


def torchrun(world: int, overrides: list[str], cwd: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "train.py"), "--no-test", *overrides]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def resume_and_save(rank: int, world: int, folder: str) -> None:
    """Resumes the run of folder/resume.json's overrides, whose train.max_steps is its checkpoint's step, and
    saves it again at once."""
    from xlm_pkm.config import load_config
    from xlm_pkm.train.trainer import Trainer

    trainer = Trainer(load_config(None, json.loads((Path(folder) / "resume.json").read_text())), test=False)
    try:
        assert trainer.resumed
        trainer.save_checkpoint()
    finally:
        trainer.close()


def assert_tensors_equal(saved: dict, loaded: dict) -> None:
    """Every model weight and optimizer state of `loaded` equals `saved`'s, bit for bit."""
    assert saved["model"].keys() == loaded["model"].keys()
    for key, t in saved["model"].items():
        assert torch.equal(loaded["model"][key], t), key
    saved, loaded = optimizer_tensors(saved), optimizer_tensors(loaded)
    assert saved.keys() == loaded.keys() and saved
    for key, t in saved.items():
        assert torch.equal(loaded[key], t), key


@pytest.mark.slow
def test_a_run_saved_on_2_processes_resumes_on_1_and_on_4(tiny_overrides, tiny_trainer, tiny_run, tmp_path):
    """fsdp with sparse values sharded by column: 4 steps on 2 processes (train.py under torchrun), resumed on 1
    (data.batch_size 4 -> 8) and on 4 (4 -> 2: the same 8 streams). Loaded there, the weights and optimizer
    states are the saved ones exactly (saved again at once and compared); trained on to step 8, each logs the
    uninterrupted 2-process run's losses and ends with its weights, to float rounding (reductions over other
    ranks; no dropout in the tiny model), at its data position."""
    extra = [*CONFIGS["pkm"], "train.parallel=fsdp", "train.eval_every=4"]
    torchrun(2, tiny_overrides(tmp_path, *extra, "train.exp_id=full", "train.max_steps=8"), tmp_path)
    torchrun(2, tiny_overrides(tmp_path, *extra, "train.exp_id=cut", "train.max_steps=4"), tmp_path)
    runs = tmp_path / "tiny"
    cut = whole(runs / "cut")
    for name in ("one", "four"):
        shutil.copytree(runs / "cut", runs / name)

    one = tiny_trainer(tmp_path, *extra, "train.exp_id=one", "train.max_steps=4", "data.batch_size=8", test=False)
    assert one.resumed
    loaded = {"model": one.model.state_dict(), "optimizers": one.optimizers.state_dict()}
    one.close()
    assert_tensors_equal(cut, loaded)
    tiny_run(tmp_path, *extra, "train.exp_id=one", "train.max_steps=8", "data.batch_size=8")

    four = [*extra, "train.exp_id=four", "data.batch_size=2"]
    (tmp_path / "resume.json").write_text(json.dumps(tiny_overrides(tmp_path, *four, "train.max_steps=4")))
    spawn(resume_and_save, 4, tmp_path)
    assert_tensors_equal(cut, whole(runs / "four"))
    (tmp_path / "runs.json").write_text(json.dumps({"four": tiny_overrides(tmp_path, *four, "train.max_steps=8")}))
    spawn(train_each, 4, tmp_path)

    full, full_losses = whole(runs / "full"), logged_losses(runs / "full")
    for name, world in (("one", 1), ("four", 4)):
        losses = logged_losses(runs / name)
        assert sorted(losses) == list(range(1, 9))
        for step in range(5, 9):
            assert math.isclose(losses[step], full_losses[step], rel_tol=1e-5), (name, step)
        resumed = whole(runs / name)
        for key, p in full["model"].items():
            atol = 1e-3 if key.endswith("qkv.bias") else 1e-5  # as in assert_fsdp_equals_ddp
            torch.testing.assert_close(resumed["model"][key], p, rtol=1e-4, atol=atol, msg=f"{name}: {key}")
        positions = [rank["data"] for rank in resumed["train_state"]]
        assert len(positions) == world and all(p["world_size"] * p["batch_size"] == 8 for p in positions)
        assert {(p["epoch"], p["step"]) for p in positions} == {(d["epoch"], d["step"]) for d in
                                                               (r["data"] for r in full["train_state"])}


def test_per_rank_states_saved_by_2_ranks_are_resharded_for_4():
    """The counters and data position as saved; the log window's mean loss kept (the logged loss is the sum
    over ranks over W x steps); each stream's cache row to the rank that now reads that stream; the random
    states seeded anew per rank, the same for the same (seed, step, rank)."""
    from xlm_pkm.train.state import resharded_states

    caches = [torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4) + 100 * r for r in range(2)]  # (B, C, D)
    saved = [{"step": 7, "best_ppl": 9.5, "log_steps": 3, "log_loss_sum": loss, "data": {"epoch": 1, "step": 7},
              "stream_cache": [cache, None], "rng": {"torch": None}} for loss, cache in zip((6.0, 9.0), caches)]
    assert resharded_states(saved, 2, seed=0) is saved
    four = resharded_states(saved, 4, seed=0)
    assert len(four) == 4 and all(r["step"] == 7 and r["data"] == {"epoch": 1, "step": 7} for r in four)
    assert sum(r["log_loss_sum"] for r in four) / (4 * 3) == (6.0 + 9.0) / (2 * 3)
    streams = torch.cat(caches)  # (4, C, D): stream s is row s, read by rank s now
    assert all(torch.equal(r["stream_cache"][0], streams[i: i + 1]) and r["stream_cache"][1] is None
               for i, r in enumerate(four))
    assert len({tuple(r["rng"]["seed"]) for r in four}) == 4
    assert [r["rng"] for r in resharded_states(saved, 4, seed=0)] == [r["rng"] for r in four]


# ---- the model built on the meta device, each rank's shards drawn (issue 62.19) ----------------------------------
MODEL = [o for o in TINY if o.startswith(("model.", "data.", "optim."))] + ["model.vocab_size=65", "train.device=cpu",
                                                                               "train.parallel=fsdp"]
BUILDS = {  # each with what its build exercises
    "pkm": ("model.memory.query_norm=batchnorm",),  # sharded values (auto), BatchNorm's buffers; 65 rows: padded
    "engram_bf16": ("model.engram.layers=[1]", "model.engram.table_size=53", "model.engram.ngram_dim=16",
                    "model.engram.heads=2", "train.precision=bf16"),  # hash buffers, Engram tables, float32 units
    "shared_values": ("model.mem_layers=[1,2]", "model.memory.share_values=true", "model.pre_norm=true",
                      "model.memory.gated=true"),  # one table for two blocks, kept out; the final norm
    "peer": ("model.memory.values=peer",),  # whole expert tables
    "all_attention": ("model.family=all_attention", "model.sublayers=[all_attention]", "model.persistent_vectors=4",
                      "model.span.max_span=16", "data.shuffle_blocks=false"),  # relative positions shared by blocks
}


def built_both_ways(rank: int, world: int, folder: str) -> None:
    """Each config of BUILDS built by build_model with FSDP's units on the meta device (its shards drawn), and
    whole as before: every FSDP parameter gathered, every table and buffer, equals the whole build's bit for bit,
    with its marks. Then folder/peak.json's model: the peak resident memory that each build adds (VmHWM over
    VmRSS before it), on this rank."""
    from xlm_pkm.config import load_config
    from xlm_pkm.runtime.distributed import DistEnv
    from xlm_pkm.runtime.fsdp import fully_shard_model
    from xlm_pkm.train.build import build_model, resolved_config

    env, cpu = DistEnv(rank, rank, world), torch.device("cpu")

    def shard(model):
        fully_shard_model(model, env, cpu, cfg.train.precision, True)

    for name, extra in BUILDS.items():
        cfg = resolved_config(load_config(None, [*MODEL, *extra]), 65, "x", world)
        sharded, whole = build_model(cfg, cpu, world_size=world, shard=shard), build_model(cfg, cpu)
        assert sharded.cfg.memory.shard_values is (name != "peer")  # auto: sharded where it can be
        tensors = dict(whole.named_parameters()) | dict(whole.named_buffers())
        mine = dict(sharded.named_parameters()) | dict(sharded.named_buffers())
        assert mine.keys() == tensors.keys(), name
        for key, t in tensors.items():
            p = mine[key]
            assert torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, t), f"{name}: {key}"
            assert {k: v for k, v in vars(p).items() if not k.startswith("_")} == vars(t), f"{name}: {key}"
        assert not any(hasattr(p, "full_tensor") for p in sharded.memory_value_parameters())  # left out of FSDP
    peak = json.loads((Path(folder) / "peak.json").read_text())
    cfg = resolved_config(load_config(None, [*MODEL, *peak["overrides"]]), 65, "x", world)
    live_memory_only()
    peaks = {}
    for way in ("sharded", "whole"):
        gc.collect()
        before = status_bytes("VmRSS")
        reset_peak()
        model = build_model(cfg, cpu, world_size=world, shard=shard if way == "sharded" else None)
        if way == "whole":  # as before: the whole model, then its FSDP units
            shard(model)
        peaks[way] = status_bytes("VmHWM") - before
        del model
    (Path(folder) / f"peak{rank}.json").write_text(json.dumps(peaks))


def status_bytes(key: str) -> int:
    """A line of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def live_memory_only() -> None:
    """glibc's malloc from now on maps every block of 64 KiB or more on its own and returns it when freed (its
    thresholds fixed: mallopt), so that the resident memory is what is in use, not also what was freed earlier and
    kept for reuse (which varies with when Python's garbage collector ran)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@pytest.mark.slow
def test_fsdp_builds_each_ranks_shards_on_the_meta_device_with_the_whole_builds_weights(tmp_path):
    """On 2 gloo processes, build_model under fsdp builds the model on the meta device, makes its FSDP units and
    draws each rank's shards (runtime/fsdp.build_sharded): the weights of the whole build bit for bit, for PKM, Engram
    (bf16), shared values, PEER and the all-attention family. A 32-layer model of width 256 (96 MiB of dense
    weights): the whole build adds them whole to a rank's peak resident memory (95 MiB here); the sharded one their
    half, one block (3 MiB) and the embeddings (54 MiB), with malloc returning what is freed (live_memory_only)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak resident memory is reset through /proc/self/clear_refs (Linux)")
    big = ["model.dim=256", "model.n_layers=32", "model.n_heads=4", "model.mem_layers=[16]"]
    (tmp_path / "peak.json").write_text(json.dumps({"overrides": big}))
    spawn(built_both_ways, 2, tmp_path)
    dense = 4 * 32 * (12 * 256**2 + 13 * 256)  # bytes: the blocks' attention and FFN weights and biases, norms
    for rank in range(2):
        peaks = json.loads((tmp_path / f"peak{rank}.json").read_text())
        assert peaks["whole"] > 0.85 * dense, peaks
        assert peaks["sharded"] < 0.65 * peaks["whole"], peaks
