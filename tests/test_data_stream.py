"""TokenStream: contiguity, shuffled blocks, rank disjointness, determinism, exact resume, evaluation pass."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import spawn

from xlm_pkm.data.shard import read_shard, shard_paths
from xlm_pkm.data.stream import TokenStream


def split_tokens(data_dir, split):
    return np.concatenate([read_shard(p).tokens for p in shard_paths(data_dir, split)]).astype(np.int64)


def test_blocks_are_contiguous_text(tiny_data_dir):
    tokens = split_tokens(tiny_data_dir, "train")
    stream = TokenStream(tiny_data_dir, "train", batch_size=4, bptt=16, seed=0)
    assert stream.total == len(tokens) and stream.dictionary.bos == 0
    for x, y in islice(stream, 3):
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, target in zip(x.numpy(), y.numpy()):
            start = int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(tokens, 16).__eq__(row).all(1))[0])
            assert tokens[start + 1: start + 17].tolist() == target.tolist()


def in_order_blocks(tokens, offset, n_streams, rank, batch_size, bptt):
    """Reference: the full (batch, bptt + 1) blocks of an epoch read in order, as lists of rows."""
    stream_len = (len(tokens) - offset - 1) // n_streams
    first = [offset + (rank * batch_size + b) * stream_len for b in range(batch_size)]
    return [[tokens[s + t: s + t + bptt + 1].tolist() for s in first]
            for t in range(0, stream_len // bptt * bptt, bptt)]


def test_train_epochs_read_every_block_once_in_a_seeded_shuffled_order(tiny_data_dir):
    tokens = split_tokens(tiny_data_dir, "train")
    orders = []
    for rank in range(2):
        stream = TokenStream(tiny_data_dir, "train", batch_size=2, bptt=16, rank=rank, world_size=2, seed=3)
        expected = [in_order_blocks(tokens, stream._offset(epoch), 4, rank, 2, 16) for epoch in range(1 + rank)]
        batches = iter(stream)
        for blocks in expected:
            read = [torch.cat([x, y[:, -1:]], 1).tolist() for x, y in islice(batches, len(blocks))]
            assert sorted(read) == sorted(blocks)
            orders.append([blocks.index(block) for block in read])
    assert orders[0] == orders[1] != sorted(orders[0])  # ranks share the order, which is not the file order
    assert orders[2] != orders[1]  # epochs differ


def test_eval_pass_predicts_every_token_once_and_ranks_are_disjoint(tiny_data_dir):
    tokens = split_tokens(tiny_data_dir, "valid")
    predicted = []
    for rank in range(2):
        stream = TokenStream(tiny_data_dir, "valid", batch_size=3, bptt=32, rank=rank, world_size=2, train=False)
        ys = [y for _, y in stream]
        assert all(y.shape[1] == 32 for y in ys[:-1]) and 1 <= ys[-1].shape[1] <= 32
        rows = torch.cat(ys, dim=1)
        assert rows.shape[1] * 3 == stream.n_tokens
        predicted += [r.numpy() for r in rows]
        rank_stream = TokenStream(tiny_data_dir, "valid", 3, 32, rank, 2, train=False)
        assert sum(y.shape[1] for _, y in rank_stream) * 3 == stream.n_tokens
    n = sum(len(r) for r in predicted)
    assert len(tokens) - 1 - n < 6  # at most world_size * batch_size - 1 tokens dropped
    assert np.concatenate(predicted).tolist() == tokens[1: n + 1].tolist()


def test_an_eval_pass_cut_short_then_rewound_reads_from_the_first_batch(tiny_data_dir):
    """evaluate() rewinds the stream it is given: the trainer's valid stream, cut by eval_max_batches, is reused."""
    stream = TokenStream(tiny_data_dir, "valid", batch_size=3, bptt=32, train=False)
    whole = [y for _, y in stream]
    assert len(list(islice(stream, 2))) == 2  # a pass cut short: the stream stays mid-pass
    stream.rewind()
    again = [y for _, y in stream]
    assert len(again) == len(whole) and all(torch.equal(a, b) for a, b in zip(again, whole))


def cut_rows(data_dir, world: int, batch_size: int = 3, bptt: int = 16, max_batches: int = 4) -> list[list[int]]:
    """The targets an evaluation pass cut to `max_batches` reads on `world` processes, per row of one process's
    batches: row b is the concatenation, rank after rank, of what each rank's row b predicted; and each rank's
    number of batches."""
    rows, lengths = [[] for _ in range(batch_size)], set()
    for rank in range(world):
        stream = TokenStream(data_dir, "valid", batch_size, bptt, rank, world, train=False)
        stream.rewind(max_batches)
        ys = [y for _, y in stream]
        lengths.add(len(ys))
        for b, row in enumerate(torch.cat(ys, dim=1).tolist()):
            rows[b] += row
    assert len(lengths) == 1  # every rank reads as many batches (FSDP's and sharded values' collectives)
    return rows


@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_eval_pass_cut_to_n_batches_reads_one_process_tokens_on_any_number_of_processes(tiny_data_dir, world):
    """train.eval_max_batches (evaluate's max_batches) counts one process's batches: on one process the tokens of
    an uncut pass's first 4 batches; on W processes those same tokens, split across the ranks, each reading about
    4 / W batches (W = 3: 64 tokens per row do not split in 3, 63 of them are read)."""
    uncut = TokenStream(tiny_data_dir, "valid", batch_size=3, bptt=16, train=False)
    first = torch.cat([y for _, y in islice(uncut, 4)], dim=1).tolist()  # (3, 64): the reference
    assert cut_rows(tiny_data_dir, 1) == first
    rows = cut_rows(tiny_data_dir, world)
    kept = 64 // world * world
    assert rows == [row[:kept] for row in first]
    stream = TokenStream(tiny_data_dir, "valid", batch_size=3, bptt=16, rank=0, world_size=world, train=False)
    stream.rewind(4)
    assert len(stream) == -(-64 // world // 16) and stream.n_tokens == 3 * (64 // world)
    stream.rewind()  # whole again
    assert stream.n_tokens == 3 * ((stream.total - 1) // (3 * world))


def evaluate_cut(rank: int, world: int, folder: str) -> None:
    """evaluate() of the tiny model (folder/overrides.json) on the valid split, cut to 4 batches, on this rank;
    rank 0 writes the result to folder/evaluated{world}.json."""
    from xlm_pkm.config import load_config
    from xlm_pkm.runtime.distributed import DistEnv
    from xlm_pkm.train.build import build_model, build_stream
    from xlm_pkm.train.evaluation import evaluate

    cfg = load_config(None, json.loads((Path(folder) / "overrides.json").read_text()))
    env = DistEnv(rank, rank, world)
    stream = build_stream(cfg, "valid", env)
    model = build_model(cfg, torch.device("cpu"))  # from train.seed: the same weights on every rank
    result = evaluate(model, stream, torch.device("cpu"), max_batches=cfg.train.eval_max_batches, env=env)
    if rank == 0:
        (Path(folder) / f"evaluated{world}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_validation_cut_to_n_batches_reads_the_same_tokens_on_1_and_2_processes(tiny_data_dir, tiny_overrides,
                                                                                tmp_path):
    """Issue 62.10: the tiny model's validation (train.eval_max_batches=4, data.eval_batch_size=32) on 1 and on 2
    gloo processes reads the same tokens and gives the same perplexity and memory usage (each 16-token block is
    read whole on either: the model carries nothing from one block to the next)."""
    vocab = len(TokenStream(tiny_data_dir, "valid", 1, 1, train=False).dictionary)
    (tmp_path / "overrides.json").write_text(json.dumps(tiny_overrides(tmp_path, f"model.vocab_size={vocab}")))
    evaluate_cut(0, 1, str(tmp_path))
    spawn(evaluate_cut, 2, tmp_path)
    one, two = (json.loads((tmp_path / f"evaluated{world}.json").read_text()) for world in (1, 2))
    assert one["tokens"] == two["tokens"] == 4 * 32 * 16 and one["words"] == two["words"]
    assert two["ppl"] == pytest.approx(one["ppl"], rel=1e-5)
    assert two["memories"][0]["usage"] == pytest.approx(one["memories"][0]["usage"], rel=1e-6)


@pytest.mark.slow
def test_a_resume_whose_evaluation_batch_changed_says_validation_reads_other_tokens(tiny_run, tiny_trainer, tmp_path):
    """data.eval_batch_size=0 follows data.batch_size, which a resume on another number of processes changes (here
    eval_batch_size given on resume: the same change on one process): the cut validation then reads other tokens
    than best.pt's perplexity was measured on, and the log says how to keep them."""
    tiny_run(tmp_path, "train.exp_id=r", "data.eval_batch_size=0", "train.max_steps=2")
    trainer = tiny_trainer(tmp_path, "train.exp_id=r", "data.eval_batch_size=8", "train.max_steps=4")
    trainer.close()
    assert trainer.resumed
    line = ("train.eval_max_batches=4: validation now reads one process's first 4 batches of 8 rows, not of 4 as "
            "before the resume: other tokens than those of best.pt's perplexity; resume with data.eval_batch_size=4 "
            "to keep them")
    assert line in (trainer.run_dir / "train.log").read_text()


def test_train_is_deterministic_for_a_seed_and_epochs_differ(tiny_data_dir):
    def take(seed, n):
        return [x for x, _ in islice(TokenStream(tiny_data_dir, "train", 2, 32, seed=seed), n)]

    a, b = take(0, 5), take(0, 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    stream = TokenStream(tiny_data_dir, "train", 2, 32, seed=0)
    first_epoch = list(islice(iter(stream), len(stream)))
    second = next(iter(stream))[0]
    assert stream.state_dict()["epoch"] == 1
    assert not torch.equal(second, first_epoch[0][0]) or stream._offset(0) == stream._offset(1)
    assert any(stream._offset(e) != stream._offset(0) for e in range(1, 5))


@pytest.mark.parametrize("train", [True, False])
def test_resume_is_exact(tiny_data_dir, train):
    kwargs = dict(batch_size=2, bptt=16, rank=1, world_size=2, seed=5, train=train)
    reference = TokenStream(tiny_data_dir, "train", **kwargs)
    n = len(reference) + 7 if train else len(reference)
    expected = list(islice(reference, n))
    for cut in (0, 3, len(reference) - 1):
        stream = TokenStream(tiny_data_dir, "train", **kwargs)
        list(islice(stream, cut))
        state = stream.state_dict()
        assert all(type(v) is int for v in state.values())
        resumed = TokenStream(tiny_data_dir, "train", **kwargs)
        resumed.load_state_dict(state)
        for (x, y), (ex, ey) in zip(resumed, expected[cut:]):
            assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="batch_size"):
        TokenStream(tiny_data_dir, "train", **{**kwargs, "batch_size": 3}).load_state_dict(state)


def test_too_small_split_is_refused(tiny_data_dir):
    with pytest.raises(ValueError, match="too few"):
        TokenStream(tiny_data_dir, "test", batch_size=4000, bptt=32)


def test_unshuffled_training_streams_continue_from_one_batch_to_the_next(tiny_data_dir):
    """shuffle=False (models that carry a cache across batches): row b of batch k + 1 continues row b of
    batch k within an epoch."""
    stream = TokenStream(tiny_data_dir, "train", batch_size=3, bptt=16, seed=2, shuffle=False)
    batches = list(islice(stream, len(stream)))
    for (_, y0), (x1, _) in zip(batches, batches[1:]):
        assert torch.equal(y0[:, -1], x1[:, 0])
    shuffled = list(islice(TokenStream(tiny_data_dir, "train", batch_size=3, bptt=16, seed=2), len(stream)))
    assert sorted(map(lambda b: b[0].sum().item(), shuffled)) == sorted(map(lambda b: b[0].sum().item(), batches))


def test_a_position_saved_by_2_ranks_resumes_on_1_and_4_reading_each_token_once(tiny_data_dir):
    """Saved by 2 ranks x 4 streams after 5 steps, resumed by 1 x 8 and 4 x 2 (the same 8 streams): every step
    after the cut reads, over all ranks in rank order, the rows of the uninterrupted run's step, into the next
    epoch: no token is skipped or read twice, since the uninterrupted run reads every block of an epoch once
    (test_train_epochs_read_every_block_once_in_a_seeded_shuffled_order). Another count of streams is refused."""
    def rows(world: int, batch_size: int, state: dict | None, steps: int) -> list[torch.Tensor]:
        """Each step's (8, 17) rows of every rank (x and the last target), ranks in order."""
        streams = [TokenStream(tiny_data_dir, "train", batch_size, 16, rank, world, seed=4) for rank in range(world)]
        for stream in streams:
            if state is not None:
                stream.load_state_dict(state)
        steps_read = zip(*(islice(stream, steps) for stream in streams))
        return [torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in ranks]) for ranks in steps_read]

    saved = TokenStream(tiny_data_dir, "train", 4, 16, 0, 2, seed=4)
    epoch, cut = len(saved), 5
    list(islice(saved, cut))
    state = saved.state_dict()
    uninterrupted = rows(2, 4, None, epoch + 3)
    for world, batch_size in ((1, 8), (4, 2)):
        resumed = rows(world, batch_size, state, epoch - cut + 3)
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[cut:], strict=True))
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) x data.batch_size=4 = 8 streams, resumed by 4 x 4: "
                                         r".* resume with data.batch_size=2$"):
        TokenStream(tiny_data_dir, "train", 4, 16, 0, 4, seed=4).load_state_dict(state)
