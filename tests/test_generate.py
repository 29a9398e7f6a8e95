"""Generation: the key/value cache against full forwards, the decoders, sampling sets, the text codec, the CLI."""

import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from sacremoses import MosesDetokenizer

from xlm_pkm.data.bytes import preprocess_bytes
from xlm_pkm.data.moses import tokenize_line
from xlm_pkm.data.text_codec import ByteCodec, TextCodec, WordCodec, data_unit, text_codec
from xlm_pkm.data.words import preprocess_words
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling, allowed_probs, sample
from xlm_pkm.launch.cli import generate_main
from xlm_pkm.model.adaptive_span import SpanConfig
from xlm_pkm.model.memory.engram import EngramConfig
from xlm_pkm.model.memory.pkm import MemoryConfig
from xlm_pkm.model.memory.ultramem import ExpandedConfig, TuckerConfig
from xlm_pkm.model.transformer import ModelConfig, TransformerLM

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name -> model config overrides
    "memory_batchnorm": dict(n_memories=1, memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4)),
    "memory_add_prenorm": dict(n_memories=1, mem_mode="add", pre_norm=True,
                               memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4, query_norm="layernorm")),
    "shared_values": dict(mem_layers=[1, 3], memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4,
                                                                 share_values=True)),
    "peer": dict(n_memories=1, memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4, values="peer", share_keys=True)),
    "ultramem": dict(n_memories=1, memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4, key_type="tucker",
                                                       tucker=TuckerConfig(cores=2), values="expanded",
                                                       expanded=ExpandedConfig(expansion=2), score="identity")),
    "no_memory": dict(n_memories=0),
    "engram": dict(n_memories=1, memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4),
                   engram=EngramConfig(layers=[1, 3], heads=2, table_size=50, ngram_dim=8)),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models decode one token at a time: a second thread only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(name: str) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=40, dim=32, n_layers=4, n_heads=4, max_len=24, **MODELS[name]))
    with torch.no_grad():  # BatchNorm running statistics away from their initial values
        for _, memory in model.memories():
            if hasattr(memory.query_norm, "running_mean"):
                memory.query_norm.running_mean.normal_()
                memory.query_norm.running_var.uniform_(0.5, 2.0)
        for _, engram in model.engrams():  # its convolution starts at zero: made to reach back
            engram.conv.normal_()
    return model.eval()


@pytest.mark.parametrize("name", MODELS)
def test_cached_forward_equals_full_forward(name):
    model = tiny_model(name)
    tokens = torch.randint(0, 40, (3, 20))
    full = model(tokens)  # (3, 20, 40)
    cache = model.new_cache()
    chunks = [model(tokens[:, :5], cache=cache)]  # a prompt, then one token at a time, then a chunk of 3
    chunks += [model(tokens[:, t:t + 1], cache=cache) for t in range(5, 17)]
    chunks.append(model(tokens[:, 17:], cache=cache))
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sequence length 25 exceeds model.max_len=24"):
        model(tokens[:, :5], cache=cache)


@pytest.mark.parametrize("name", ["memory_batchnorm", "no_memory", "engram"])
@pytest.mark.parametrize("sampling", [Sampling(greedy=True), Sampling(temperature=1.5, top_k=20, top_p=0.95)])
def test_cached_and_uncached_decoders_give_the_same_tokens(name, sampling):
    model = tiny_model(name)
    kw = dict(max_tokens=40, sampling=sampling, seed=3, num_samples=3, window=12)  # the window restarts 6 times
    cached = generate(model, [0, 5, 6], use_cache=True, **kw)
    assert cached == generate(model, [0, 5, 6], use_cache=False, **kw)
    assert [len(s) for s in cached] == [40] * 3


def test_greedy_is_the_argmax_of_a_full_forward():
    model = tiny_model("memory_batchnorm")
    tokens = [0, 7]
    for _ in range(6):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    assert generate(model, [0, 7], max_tokens=6, sampling=Sampling(greedy=True)) == [tokens[2:]]


def test_generation_is_deterministic_with_a_seed_and_stops():
    model = tiny_model("memory_batchnorm")
    runs = [generate(model, [0], max_tokens=30, seed=seed, num_samples=2) for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0][0] != runs[0][1]
    stop = runs[0][0][10]
    stopped = generate(model, [0], max_tokens=30, seed=1, num_samples=2, stop=stop)
    assert stopped == [s[:s.index(stop)] if stop in s else s for s in runs[0]]


PROBS = torch.tensor([0.05, 0.30, 0.02, 0.40, 0.20, 0.03])


@pytest.mark.parametrize("sampling, allowed", [
    (Sampling(), {0, 1, 2, 3, 4, 5}),
    (Sampling(top_k=2), {1, 3}),
    (Sampling(top_k=3), {1, 3, 4}),
    (Sampling(top_p=0.5), {1, 3}),  # 0.40 < 0.5, 0.40 + 0.30 reaches it
    (Sampling(top_p=0.75), {1, 3, 4}),
    (Sampling(top_p=0.1), {3}),
    (Sampling(top_k=4, top_p=0.8), {1, 3, 4}),  # top-4 renormalised: 0.42, 0.32, 0.21, 0.05
    (Sampling(temperature=0.5, top_p=0.6), {3, 1}),  # sharper: 0.52, 0.29, ...
])
def test_sampling_draws_only_inside_the_top_k_top_p_set(sampling, allowed):
    logits = PROBS.log().repeat(20000, 1)  # (20000, 6)
    drawn = sample(logits, sampling, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == allowed
    expected = (PROBS ** (1 / sampling.temperature)) * torch.tensor([i in allowed for i in range(6)])
    expected = expected / expected.sum()
    torch.testing.assert_close(allowed_probs(logits[:1], sampling)[0].float(), expected)
    frequencies = torch.bincount(drawn, minlength=6) / drawn.numel()
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)


def test_bad_sampling_settings_are_rejected():
    for bad in (dict(temperature=0), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1"):
            Sampling(**bad)


def test_decoded_text_equals_the_moses_detokenised_original(tiny_data_dir):
    lines = ["The `print()` function writes (by default) to sys.stdout; see \"Input and Output\".",
             "Strings can be concatenated with the + operator, e.g. 'py' + 'thon' == 'python'.",
             "It's 3.14 -- roughly."]
    codec = TextCodec(tiny_data_dir)
    ids = codec.encode("\n\n".join(lines) + "\n")  # blank lines dropped, as the preprocessing does
    assert ids[0] == codec.dictionary.bos and ids.count(codec.dictionary.eos) == 2
    assert codec.dictionary.unk not in ids
    detokenizer = MosesDetokenizer(lang="en")
    expected = [detokenizer.detokenize(tokenize_line(line).split(), unescape=False) for line in lines]
    assert codec.decode(ids) == "\n".join(expected)
    assert codec.decode(ids + [codec.dictionary.eos, codec.dictionary.bos] + ids[1:4]) == \
        "\n".join(expected) + "\n\n" + codec.decode(ids[:4])


def test_byte_and_word_codecs_round_trip(tmp_path):
    """Text -> ids -> text through the vocabularies of xlm_pkm.data.bytes and .words, with the documents'
    layout (<s> first, </s> between lines, the last line open) and the out-of-vocabulary cases."""
    text = "naïve café\n\nthe café is naïve"
    (tmp_path / "text.txt").write_text((text + "\n") * 50)
    preprocess_bytes(tmp_path / "text.txt", tmp_path / "bytes", mode="fractions", held_out_fraction=0.1)
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text(text + "\n")
    preprocess_words({s: tmp_path / f"{s}.txt" for s in ("train", "valid", "test")}, tmp_path / "words")
    for folder, kind, tokens in [("bytes", ByteCodec, len(text.encode()) - 2), ("words", WordCodec, 6)]:
        codec = text_codec(tmp_path / folder, data_unit(tmp_path / folder))
        d = codec.dictionary
        ids = codec.encode(text)
        assert isinstance(codec, kind) and ids[0] == d.bos and ids.count(d.eos) == 2 and d.unk not in ids
        assert len(ids) == 1 + tokens + 2 and codec.decode(ids) == text
        assert codec.decode(ids + [d.bos] + ids[1:3]) == text + "\n\n" + codec.decode(ids[:3])
    assert text_codec(tmp_path / "words", "word").decode(text_codec(tmp_path / "words", "word").encode("the dog")) == \
        "the <unk>"
    byte_codec = text_codec(tmp_path / "bytes", "byte")
    assert byte_codec.decode(byte_codec.encode("€")) == "\ufffd" * 3  # bytes absent from train: <unk> each


def test_all_attention_cached_and_uncached_decoders_give_the_same_tokens():
    """The stream cache of all-attention layers is the decoder's context: a new one at each window restart."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, family="all_attention",
                                      sublayers=["all_attention"], persistent_vectors=4,
                                      span=SpanConfig(max_span=16, adaptive=True, ramp=4))).eval()
    with torch.no_grad():
        for span in model.spans():
            span.z.fill_(0.5)
    kw = dict(max_tokens=30, sampling=Sampling(greedy=True), num_samples=2, window=10)
    assert generate(model, [0, 5, 6], use_cache=True, **kw) == generate(model, [0, 5, 6], use_cache=False, **kw)


@pytest.mark.slow
def test_generate_command_prints_samples_and_fails_in_one_line(reference_run, tmp_path, capsys):
    best = reference_run().best_path
    capsys.readouterr()  # the training run's log
    args = ["--checkpoint", str(best), "--max-tokens", "12", "--num-samples", "2", "--top-k", "20", "--seed", "4",
            "--device", "cpu", "the function"]
    assert generate_main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sample 1\nthe function") and "# sample 2\nthe function" in out
    assert generate_main(args + ["--no-cache"]) == 0 and capsys.readouterr().out == out
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the function\n")
    assert generate_main(args[:-1] + ["--prompt-file", str(prompt)]) == 0 and capsys.readouterr().out == out
    for bad, message in [(["--top-p", "0"], "sampling needs temperature > 0"),
                         (["--checkpoint", str(tmp_path / "none.pt")], "none.pt does not exist"),
                         (["--data", str(tmp_path)], "vocab file not found"),
                         (["--prompt-file", str(tmp_path / "missing.txt")], "cannot read prompt file")]:
        assert generate_main(args[:-1] + bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("generate.py: error: ") and message in err and err.count("\n") == 1, err


def test_prompt_from_stdin_and_stop_at_line_end(reference_run, monkeypatch, capsys):
    best = reference_run().best_path
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("import the module"))
    assert generate_main(["--checkpoint", str(best), "--max-tokens", "30", "--greedy", "--prompt-file", "-",
                          "--stop-at-eol"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import the module") and out.count("\n") == 1


@pytest.mark.slow
def test_generation_speed_benchmark_writes_both_decoders(tmp_path, monkeypatch):
    out = tmp_path / "generation.json"
    monkeypatch.setattr(sys, "argv", ["generation_speed.py", "--device", "cpu", "--seq", "8", "--min-time", "0.01",
                                      "--rounds", "1", "--vocab", "50", "--out", str(out), "--override", "model.dim=16",
                                      "model.n_heads=2", "model.memory.k_dim=8", "model.memory.knn=4"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the benchmark puts its folder first
    runpy.run_path(str(ROOT / "benchmarks" / "generation_speed.py"), run_name="__main__")
    result = json.loads(out.read_text())
    assert result["settings"]["vocab"] == 50 and result["machine"]["device"] == "cpu"
    assert [(r["model"], r["memories"]) for r in result["rows"]] == [("memory", 1), ("no memory", 0)]
    for row in result["rows"]:
        assert row["cached_tokens_per_s"] > 0 and row["uncached_tokens_per_s"] > 0
        assert row["cached_over_uncached"] == round(row["cached_tokens_per_s"] / row["uncached_tokens_per_s"], 3)
