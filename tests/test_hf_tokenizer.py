"""The pure-Python BPE (xlm_pkm/data/bpe_apply.py) against fastBPE itself (binding and command-line tool), and the
transformers tokenizer (xlm_pkm/inference/hf_tokenizer.py), built directly and loaded by AutoTokenizer from a
folder laid out as an export writes it, against TextCodec and the shards preprocessing wrote; on lines of the
bundled corpus and on text its codes never saw."""

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xlm_pkm.data.bpe_apply import BPE
from xlm_pkm.data.corpus import Reader, document_lines
from xlm_pkm.data.fastbpe import bpe_applier
from xlm_pkm.data.moses import tokenize_line
from xlm_pkm.data.shard import read_shard
from xlm_pkm.data.text_codec import TextCodec

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample" / "python-docs.jsonl.xz"
SAMPLE_DATA = REPO / "data" / "processed" / "sample"  # `make data`: 8,000 codes
HELD_OUT = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
UNSEEN = "\n".join([  # a document: unicode, numbers, long words, odd spaces, special tokens and '@@' as text
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文, العربية, emoji 🙂🚀 ok.",
    "Numbers 1234567890 3.14159 -42 1e-10 0x7fff_ffff 2024-05-17 12:30:45 ±5% ½ ∑ ∞.",
    "Long words: pneumonoultramicroscopicsilicovolcanoconiosis supercalifragilisticexpialidocious",
    "https://example.com/a/very/long/path?query=value&other=1#anchor sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
    "Quotes “curly” ‘single’ «guillemets» — dashes – and… ellipses; tabs\tinside   and  spaces;  ",
    "a@@b @@ x@@ </s> <s> <unk> <pad>", "", "   \r", "Windows line\r", "last line, without an end"])
TOKENIZER_CONFIG = {"auto_map": {"AutoTokenizer": ["tokenization_xlm_pkm.XlmPkmTokenizer", None]},
                    "tokenizer_class": "XlmPkmTokenizer"}
FOLDER_CODE = {"tokenization_xlm_pkm.py": "inference/hf_tokenizer.py",
               **{f"{name}.py": f"data/{name}.py" for name in ("moses", "dictionary", "bpe_apply", "corpus")}}
ABSOLUTE_IMPORT = re.compile(r"^from xlm_pkm\.(?:\w+\.)*(\w+) import ", re.M)


@pytest.fixture(scope="module")
def data_dir(request) -> Path:
    """The bundled sample's processed folder when `make data` built it, else the tiny one of the fixtures."""
    if all((SAMPLE_DATA / name).is_file() for name in ("codes", "vocab", "plan.json", "valid.000.bin")):
        return SAMPLE_DATA
    return request.getfixturevalue("tiny_data_dir")


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(Reader(SAMPLE))


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    """~2,500 lines of the corpus as documents of 10 lines, then the held-out texts: the README, each docs/*.md
    page and UNSEEN (unicode, numbers, long words, special tokens and '@@' as text)."""
    lines = random.Random(0).sample([line for doc in corpus for line in document_lines(doc)], 2500)
    documents = ["\n".join(lines[i: i + 10]) for i in range(0, len(lines), 10)]
    return documents + [path.read_text(encoding="utf-8") for path in HELD_OUT] + [UNSEEN]


@pytest.fixture(scope="module")
def tokenized(texts) -> list[str]:
    """The Moses-tokenized lines of `texts` (~4,000), as fastBPE reads them."""
    return [tok for tok in (tokenize_line(line) for text in texts for line in document_lines(text)) if tok]


@pytest.fixture(scope="module")
def vocabs(data_dir, tmp_path_factory) -> dict:
    """The vocab limits: the folder's (as preprocessing and TextCodec use it), a thinned one (every third word
    left out: most merges undone), none."""
    thinned = tmp_path_factory.mktemp("vocab") / "thinned"
    lines = (data_dir / "vocab").read_text(encoding="utf-8").splitlines(keepends=True)
    thinned.write_text("".join(line for i, line in enumerate(lines) if i % 3 != 2), encoding="utf-8")
    return {"vocab": data_dir / "vocab", "thinned": thinned, "none": None}


def fast_applybpe(fastbpe_bin: str, lines: list[str], codes: Path, vocab: Path | None, tmp: Path) -> list[str]:
    """`fast applybpe OUT IN CODES [VOCAB]` on the lines, their words separated by single spaces (the tool keeps
    the input's spaces where the binding joins the words by one: Moses leaves a trailing space at times)."""
    words = (" ".join(word for word in line.split(" ") if word) for line in lines)
    (tmp / "in").write_text("".join(line + "\n" for line in words), encoding="utf-8")
    args = [fastbpe_bin, "applybpe", str(tmp / "out"), str(tmp / "in"), str(codes)] + ([str(vocab)] if vocab else [])
    subprocess.run(args, check=True, capture_output=True)
    return (tmp / "out").read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("limit", ["vocab", "thinned", "none"])
def test_bpe_apply_gives_fastbpe_s_output(limit, data_dir, tokenized, vocabs, fastbpe_bin, tmp_path):
    codes, vocab = data_dir / "codes", vocabs[limit]
    ours = BPE(codes, vocab).apply(tokenized)
    assert ours == bpe_applier(codes, vocab).apply(tokenized)
    assert ours == fast_applybpe(fastbpe_bin, tokenized, codes, vocab, tmp_path)
    if limit == "thinned":  # the limit is exercised: merges are undone in most lines
        assert sum(a != b for a, b in zip(ours, BPE(codes).apply(tokenized))) > len(tokenized) / 2


def test_bpe_apply_on_edge_cases_as_the_binding(tmp_path):
    """Spaces (repeated, leading, trailing), empty lines, NUL inside words, two codes merging into one string (the
    later one is undone: the binding, built without assertions, keeps it; the command-line tool aborts)."""
    (tmp_path / "codes").write_text("a b 9\nab c 8\nb c 7\na bc 6\nc</w> a 5\nb c</w> 4\n", encoding="utf-8")
    (tmp_path / "vocab").write_text("a@@ 3\nb 2\nbc 1\n", encoding="utf-8")
    lines = ["abc bca abcx", "  abc   a  ", "", " ", "a\0bc \0q ab\0c abc\0", "bcbc abcabc cab ca é"]
    for vocab in (tmp_path / "vocab", None):
        assert BPE(tmp_path / "codes", vocab).apply(lines) == bpe_applier(tmp_path / "codes", vocab).apply(lines)


def export_tokenizer(data_dir: Path, folder: Path) -> Path:
    """A folder as the export writes it: vocab, codes, the tokenizer's module and those it imports, flat, with
    `from xlm_pkm.a.b import X` as `from .b import X`, and tokenizer_config.json."""
    folder.mkdir()
    for name in ("vocab", "codes"):
        shutil.copyfile(data_dir / name, folder / name)
    for name, module in FOLDER_CODE.items():
        code = ABSOLUTE_IMPORT.sub(r"from .\1 import ", (REPO / "xlm_pkm" / module).read_text(encoding="utf-8"))
        assert not re.search(r"^\s*(from|import) xlm_pkm\b", code, re.M), name
        (folder / name).write_text(code, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokenizers(data_dir, tmp_path_factory) -> dict:
    """The tokenizer built from the package, and loaded by AutoTokenizer from an exported folder's code."""
    transformers = pytest.importorskip("transformers")
    from xlm_pkm.inference.hf_tokenizer import XlmPkmTokenizer

    folder = export_tokenizer(data_dir, tmp_path_factory.mktemp("export") / "tokenizer")
    auto = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(auto).__name__ == "XlmPkmTokenizer" and type(auto).__module__.startswith("transformers_modules.")
    return {"package": XlmPkmTokenizer(vocab_file=str(data_dir / "vocab"), codes_file=str(data_dir / "codes")),
            "folder": auto}


@pytest.fixture(scope="module")
def encoded(data_dir, texts) -> list[list[int]]:
    """TextCodec's ids of each text."""
    codec = TextCodec(data_dir)
    return [codec.encode(text) for text in texts]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["package", "folder"])
def test_the_tokenizer_encodes_as_text_codec(source, tokenizers, texts, encoded):
    tokenizer = tokenizers[source]
    assert [tokenizer(text)["input_ids"] for text in texts] == encoded
    assert tokenizer(texts[:8])["input_ids"] == encoded[:8]
    assert tokenizer(texts[0], add_special_tokens=False)["input_ids"] == encoded[0][1:]
    assert tokenizer(texts[0], texts[1])["input_ids"] == encoded[0] + encoded[1]  # two documents
    assert tokenizer("")["input_ids"] == [0]
    batch = tokenizer(texts[:3], padding=True)
    longest = max(len(ids) for ids in encoded[:3])
    assert batch["input_ids"][0] == encoded[0] + [tokenizer.pad_token_id] * (longest - len(encoded[0]))
    specials = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id
    assert specials == (0, 1, 2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["package", "folder"])
def test_the_tokenizer_decodes_as_text_codec(source, tokenizers, data_dir, encoded):
    tokenizer, codec = tokenizers[source], TextCodec(data_dir)
    for ids in encoded:
        assert tokenizer.decode(ids) == codec.decode(ids)
    mixed = encoded[0][:30] + [1, 2, 2, 3] + encoded[1][:20] + [1, 0] + encoded[2][:9] + [1]
    assert tokenizer.decode(mixed) == codec.decode(mixed)  # <pad> dropped, <s> a blank line, a final </s>
    assert tokenizer.decode(mixed, skip_special_tokens=True) == codec.decode([i for i in mixed if i not in (0, 2, 3)])


@pytest.mark.slow
def test_the_tokenizer_gives_the_ids_preprocessing_wrote(tokenizers, data_dir, corpus):
    """The first valid documents (BPE limited to the vocabulary) and train documents (BPE without limit) of the
    folder's shards: each the tokenizer's ids of the raw document, then the </s> that ends its last line."""
    plan = json.loads((data_dir / "plan.json").read_text())
    documents = corpus if data_dir == SAMPLE_DATA else list(Reader(plan["inputs"][0][0]))
    held_out = set(plan["valid_docs"]) | set(plan["test_docs"])
    train = [i for i in range(len(documents)) if i not in held_out]
    for split, indices in (("valid", plan["valid_docs"][:8]), ("train", train[:8])):
        shard = read_shard(data_dir / f"{split}.000.bin")
        starts = [*shard.doc_starts.tolist(), len(shard.tokens)]
        written = [shard.tokens[a:b].tolist() for a, b in zip(starts, starts[1:])][: len(indices)]
        assert [tokenizers["package"](documents[i])["input_ids"] + [1] for i in indices] == written, split


def test_a_saved_tokenizer_loads_back(tokenizers, texts, encoded, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers["folder"].save_pretrained(tmp_path / "saved")
    saved = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"vocab", "codes", "tokenizer_config.json", *FOLDER_CODE} <= saved
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert [again(text)["input_ids"] for text in texts[-3:]] == encoded[-3:]
