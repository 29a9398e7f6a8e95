"""Session fixtures shared by the test files: the fastBPE CLI and a tiny preprocessed corpus."""

from __future__ import annotations

import contextlib
import io
import lzma
import math
import os
import random
from itertools import islice
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels are checked under Triton's interpreter (read when Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests never reach the Hugging Face hub (transformers, datasets, lm-eval read local folders and files).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from xlm_pkm.data.fastbpe import find_fastbpe
from xlm_pkm.data.preprocess import preprocess

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample" / "python-docs.jsonl.xz"
TINY_DOCS = 40


def pytest_addoption(parser):
    parser.addoption("--shuffle", type=int, metavar="SEED",
                     help="run the tests in an order shuffled with SEED: no test may depend on the order")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shuffle") is not None:
        random.Random(config.getoption("--shuffle")).shuffle(items)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Every test leaves torch's thread count as it found it (train.num_threads, and accelerate's set-up under
    peft or lm-eval, change it for the whole process): float reductions, hence the bit-exact comparisons of
    later tests in the same worker, depend on it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def fastbpe_bin() -> str:
    """Path of fastBPE's command-line tool (the Makefile builds it before the tests)."""
    return find_fastbpe()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The first 40 documents of the bundled corpus (0.4 MB) as JSONL."""
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with lzma.open(SAMPLE, "rt", encoding="utf-8") as f:
        path.write_text("".join(islice(f, TINY_DOCS)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_corpus, tmp_path_factory) -> Path:
    """A processed data directory: 500 BPE codes, 4 valid and 4 test documents (>= 8k tokens each),
    two train shards, intermediate .tok/.bpe files kept. Built once per session (~2 s)."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    preprocess([str(tiny_corpus)], out, n_codes=500, valid_docs=4, test_docs=4, seed=1, chunk_mb=0.25,
               keep_intermediate=True)
    return out


@pytest.fixture(scope="session")
def tiny_base(tiny_corpus, tmp_path_factory) -> Path:
    """A pretrained model's folder as transformers writes it, made here: a random Llama (2 layers of width 32,
    64 positions, 20 embedding rows more than the tokenizer's tokens) and its tokenizer, a byte-level BPE of 300
    tokens learnt on the tiny corpus, <|endoftext|> its end of text (as GPT-2's, SmolLM2's)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("base") / "tiny-llama"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer) + 20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_base_data(tiny_corpus, tiny_base, tmp_path_factory) -> Path:
    """The tiny corpus preprocessed with the tiny base's tokenizer (python -m xlm_pkm.data.preprocess --tokenizer):
    4 valid and 4 test documents, two train shards."""
    out = tmp_path_factory.mktemp("data") / "tiny-base"
    preprocess([str(tiny_corpus)], out, valid_docs=4, test_docs=4, seed=1, chunk_mb=0.25, tokenizer=str(tiny_base))
    return out


@pytest.fixture
def small_filesystem(tmp_path):
    """mount(size_kb, name="small") -> Path: a real filesystem of `size_kb` KB (a tmpfs mounted at
    tmp_path/name, unmounted at teardown) that fills for real: writes fail with ENOSPC, as on a full
    disk. Skips with a one-line reason where mounting is not allowed (not root, or a container without
    CAP_SYS_ADMIN)."""
    import subprocess

    mounted = []

    def mount(size_kb: int, name: str = "small") -> Path:
        path = tmp_path / name
        path.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=755", "tmpfs", str(path)],
                                  capture_output=True, text=True)
            refused = done.returncode and (done.stderr.splitlines() or [f"exit status {done.returncode}"])[0]
        except OSError as e:  # no mount command
            refused = str(e)
        if refused:  # e.g. "mount: PATH: permission denied."
            reason = refused.replace(f" {path}:", "").strip().rstrip(".")
            pytest.skip(f"cannot mount a tmpfs here ({reason}): the full-disk tests need root or CAP_SYS_ADMIN")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):  # lazily if a file is still open there
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


# ---- tiny training runs -------------------------------------------------------------------------
# One thread in every tiny run: a float reduction's rounding depends on the thread count, and a cached reference
# run may have been trained under a fixture that set another (test_generate.py's one_thread); the tiny model only
# loses to contention with a second thread anyway.
TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_len=16", "model.mem_layers=[2]",
    "model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
    "model.memory.query_norm=layernorm",
    "data.batch_size=4", "data.eval_batch_size=32", "data.bptt=16",
    "optim.lr=3e-3", "optim.warmup_steps=5", "optim.values_lr=1e-2",
    "train.device=cpu", "train.log_every=1", "train.eval_every=1000", "train.eval_max_batches=4",
    "train.max_steps=8", "train.exp_name=tiny", "train.num_threads=1",
]


@pytest.fixture(scope="session")
def tiny_overrides(tiny_data_dir):
    """overrides(dump, *extra): the tiny model on the tiny corpus, run directories under `dump`."""
    return lambda dump, *extra: [f"data.path={tiny_data_dir}", f"train.dump_path={dump}", *TINY, *extra]


@pytest.fixture(scope="session")
def tiny_trainer(tiny_overrides):
    """trainer(dump, *extra, test=True): a Trainer of the tiny config (not trained yet)."""
    from xlm_pkm.config import load_config
    from xlm_pkm.train.trainer import Trainer

    return lambda dump, *extra, test=True: Trainer(load_config(None, tiny_overrides(dump, *extra)), test=test)


@pytest.fixture(scope="session")
def tiny_run(tiny_trainer):
    """run(dump, *extra): trains a tiny run to its end; returns the closed Trainer."""

    def run(dump, *extra):
        trainer = tiny_trainer(dump, *extra)
        try:
            trainer.train()
        finally:
            trainer.close()
        return trainer

    return run


@pytest.fixture(scope="session")
def reference_run(tiny_run, tmp_path_factory):
    """reference(*extra): an uninterrupted tiny run, trained once per session for each set of overrides
    and shared by every resume and stop test that compares against it. Its console lines are dropped: they
    would land in the capsys of whichever test happens to ask first (its train.log keeps them)."""
    dump, cache = tmp_path_factory.mktemp("reference"), {}

    def reference(*extra):
        if extra not in cache:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cache[extra] = tiny_run(dump, f"train.exp_id=ref{len(cache)}", *extra)
        return cache[extra]

    return reference


@pytest.fixture(scope="session")
def finetune_source(tiny_run, tiny_data_dir, tmp_path_factory):
    """(best.pt of a trained tiny model, its background for sparse memory finetuning): 40 documents of 24
    tokens (2 rows of 12) of its train split."""
    from xlm_pkm.finetune.slot_counts import main as slot_counts_main

    dump = tmp_path_factory.mktemp("finetune_source")
    best = tiny_run(dump, "train.exp_id=src").run_dir / "best.pt"
    background = dump / "slot_counts.pt"
    assert slot_counts_main([str(best), "--data", str(tiny_data_dir), "--doc-tokens", "24", "--documents", "40",
                             "--out", str(background)]) == 0
    return best, background


TINY_VALUES = "blocks.1.sublayers.1.values.weight"  # the tiny model's value table (its memory at layer 2)


def train_recording_steps(trainer, monkeypatch, record) -> list:
    """Trains `trainer` to its end and closes it; returns, per step, record(lookups, moved, out): the step's
    memory lookups [(scores, indices (B * T, heads, knn))], the rows of TINY_VALUES it moved (sorted), its output."""
    from xlm_pkm.model.memory.pkm import ProductKeyMemory
    from xlm_pkm.train.trainer import Trainer

    table = dict(trainer.model.named_parameters())[TINY_VALUES]
    lookups, steps, lookup, step = [], [], ProductKeyMemory.lookup, Trainer.train_step
    monkeypatch.setattr(ProductKeyMemory, "lookup", lambda self, x: lookups.append(lookup(self, x)) or lookups[-1])

    def recorded_step(self, batches):
        lookups.clear()
        before = table.detach().clone()
        out = step(self, batches)
        moved = (table.detach() != before).any(dim=1).nonzero().flatten().tolist()
        steps.append(record(lookups, sorted(moved), out))
        return out

    monkeypatch.setattr(Trainer, "train_step", recorded_step)
    try:
        trainer.train()
    finally:
        trainer.close()
    return steps


def brute_force_top_slots(reads: list[int], doc_freq, documents: int, t: int) -> list[int]:
    """Sparse memory finetuning's selection written out in plain Python (the reference of the tests): the t
    slots of highest tf * idf among those read with a score above 0, ties to the lower slot; sorted."""
    total = sum(reads)
    scores = {slot: c / total * math.log((documents + 1) / (int(doc_freq[slot]) + 1))
              for slot, c in enumerate(reads) if c}
    return sorted(sorted((slot for slot in scores if scores[slot] > 0), key=lambda slot: (-scores[slot], slot))[:t])


def read_events(run_dir: Path, event: str = "train") -> list[dict]:
    """The `event` lines of a run's metrics.jsonl, in file order."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def logged_losses(run_dir: Path) -> dict[int, float]:
    """{step: logged train loss} of a run; fails if a step is logged twice."""
    events = read_events(run_dir)
    steps = [e["step"] for e in events]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {e["step"]: e["loss"] for e in events}


@pytest.fixture(scope="session")
def train_losses():
    """losses(run_dir) -> {step: logged train loss}; fails if a step is logged twice."""
    return logged_losses


def whole_checkpoint(path) -> dict:
    """A run checkpoint read whole on this process: checkpoint.pt's tensors from its folder (Distributed
    Checkpoint), best.pt's (or an earlier checkpoint.pt's) value shard files gathered."""
    from xlm_pkm.checkpoint import dcp_tensors, files, sharded_values

    state = files.load(path)
    if dcp_tensors.KEY in state:
        return dcp_tensors.read_whole(state, Path(path))
    return sharded_values.attach(state, Path(path), None)


def assert_two_processes_equal_one(run_dir: Path, single) -> None:
    """The 4-step run in run_dir, trained on 2 processes, logged the losses of `single` (a finished 1-process
    Trainer with the same global batch) and ends with its weights (sharded values gathered whole)."""
    two, one = logged_losses(run_dir), logged_losses(single.run_dir)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert math.isclose(two[step], one[step], rel_tol=1e-5), (step, two[step], one[step])
    state = whole_checkpoint(Path(run_dir) / "checkpoint.pt")
    assert [rank["data"]["world_size"] for rank in state["train_state"]] == [2, 2]
    for name, p in single.model.state_dict().items():  # Adam magnifies float rounding of tiny gradients
        torch.testing.assert_close(state["model"][name], p, rtol=1e-3, atol=1e-3)


@pytest.fixture
def signal_at_step(monkeypatch):
    """signal_at_step(step, signum=SIGUSR2): every Trainer sends itself `signum` during step `step`, as
    SLURM's time-limit warning (or scancel, or a preemption) would."""
    import signal

    from xlm_pkm.train.trainer import Trainer

    step_once = Trainer.train_step

    def arm(step: int, signum: int = signal.SIGUSR2) -> None:
        def step_then_signal(self, batches):
            out = step_once(self, batches)
            if self.step == step:
                os.kill(os.getpid(), signum)
            return out

        monkeypatch.setattr(Trainer, "train_step", step_then_signal)

    return arm


def run_rank(rank: int, world: int, port: int, folder: str, check) -> None:
    """Rank `rank` of a `world`-process gloo group on the CPU, running check(rank, world, folder) (spawn)."""
    from xlm_pkm.runtime.distributed import init_distributed, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"), timeout_minutes=1.0)
    failed = True
    try:
        check(rank, world, folder)
        failed = False
    finally:
        shutdown(failed)  # after a failure no barrier: spawn then stops the other ranks


def spawn(check, world: int, folder) -> None:
    """Runs check(rank, world, folder) on `world` processes, forked from a server that imported torch and
    check's module once (a fresh interpreter per rank costs ~3 s of imports each on 2 cores)."""
    import torch.multiprocessing as mp

    from xlm_pkm.runtime.distributed import free_port

    mp.set_forkserver_preload(["torch", "xlm_pkm.model.memory.sharded_read", check.__module__])
    mp.start_processes(run_rank, args=(world, free_port(), str(folder), check), nprocs=world,
                       start_method="forkserver")
