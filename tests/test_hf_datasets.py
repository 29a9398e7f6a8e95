"""Preprocessing a Hugging Face dataset (--hf-dataset, hf_source.py): streamed, and the very shards the same
documents make as JSONL files; a missing text field or a missing `datasets` is one line."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

datasets = pytest.importorskip("datasets")

from xlm_pkm.data import hf_source  # noqa: E402
from xlm_pkm.data.preprocess import main, preprocess  # noqa: E402

PROG = "python -m xlm_pkm.data.preprocess"
OPTIONS = dict(n_codes=100, seed=1)
FIELDS_OF_A_RUN = ("inputs", "plan", "seconds")  # where a dataset's run differs from the JSONL files' run


@pytest.fixture(scope="module")
def documents(tiny_corpus) -> list[str]:
    """300 documents of three paragraphs of the tiny corpus (~120 KB), one of them blank (skipped by both paths)."""
    paragraphs = [p for line in tiny_corpus.read_text(encoding="utf-8").splitlines()
                  for p in json.loads(line)["text"].split("\n\n") if p.strip()]
    docs = ["\n\n".join(paragraphs[3 * d: 3 * d + 3]) for d in range(300)]
    docs[7] = " \n "
    return docs


def halves(docs: list[str]) -> list[list[str]]:
    return [docs[:150], docs[150:]]


@pytest.fixture(scope="module")
def reference(documents, tmp_path_factory):
    """The documents as two JSONL files (part-0, part-1), preprocessed as today."""
    root = tmp_path_factory.mktemp("jsonl")
    files = []
    for i, part in enumerate(halves(documents)):
        files.append(root / f"part-{i}.jsonl")
        files[-1].write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(part)))
    preprocess([str(f) for f in files], root / "out", **OPTIONS)
    return root / "out"


def write_dataset(docs: list[str], fmt: str, folder) -> str:
    """`docs` as two files of `fmt` in `folder`; the glob naming them."""
    folder.mkdir()
    for i, part in enumerate(halves(docs)):
        ds = datasets.Dataset.from_dict({"id": list(range(len(part))), "text": part})
        if fmt == "parquet":
            ds.to_parquet(folder / f"part-{i}.parquet")
        elif fmt == "json":
            ds.to_json(folder / f"part-{i}.jsonl")  # JSON lines
        else:
            ds.save_to_disk(folder / f"part-{i}")  # its data-00000-of-00001.arrow
    return str(folder / {"parquet": "part-*.parquet", "json": "part-*.jsonl", "arrow": "part-*/*.arrow"}[fmt])


@pytest.fixture
def loads(monkeypatch):
    """The keyword arguments of every datasets.load_dataset call (in this process), each checked to return an
    IterableDataset; `loads.hub` (a folder of parquet files) stands for the hub dataset `someone/news`."""
    real, calls = datasets.load_dataset, []

    def load_dataset(path, name=None, **kwargs):
        calls.append(kwargs)
        if path == "someone/news":
            path, kwargs = "parquet", {**kwargs, "data_files": sorted(map(str, loads.hub.glob("*.parquet"))),
                                       "revision": None}
        ds = real(path, name, **kwargs)
        assert isinstance(ds, datasets.IterableDataset)
        return ds

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    loads.calls = calls
    return loads


def assert_same_output(out, reference, hf_dataset: dict) -> None:
    """Every shard, the codes and the vocab byte for byte, meta.json but for the inputs' record, the same split."""
    names = sorted(p.name for p in reference.iterdir() if p.suffix == ".bin" or p.name in ("codes", "vocab"))
    assert len([n for n in names if n.startswith("train.")]) == 2
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".bin" or p.name in ("codes", "vocab")) == names
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    ours, theirs = (json.loads((d / "meta.json").read_text()) for d in (out, reference))
    assert ours["options"].pop("hf_dataset") == hf_dataset
    del ours["files"]["plan.json"], theirs["files"]["plan.json"]
    assert {k: v for k, v in ours.items() if k not in FIELDS_OF_A_RUN} == \
        {k: v for k, v in theirs.items() if k not in FIELDS_OF_A_RUN}
    ours, theirs = (json.loads((d / "plan.json").read_text()) for d in (out, reference))
    assert [ours[k] for k in ("valid_docs", "test_docs", "chunk_mb")] == \
        [theirs[k] for k in ("valid_docs", "test_docs", "chunk_mb")]
    assert [{**s, "path": None} for s in ours["scans"]] == [{**s, "path": None} for s in theirs["scans"]]


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow"])
def test_local_dataset_files_make_the_shards_of_the_same_documents_as_jsonl(documents, reference, loads, tmp_path, fmt):
    """One input per file, in the glob's sorted order; every load streams. (The inputs travel to worker
    processes pickled: checked here without starting a pool, which takes seconds.)"""
    pattern = write_dataset(documents, fmt, tmp_path / "data")
    inputs = hf_source.dataset_inputs(fmt, [pattern])
    assert [i.file for i in inputs] == sorted(i.file for i in inputs) and len(inputs) == 2
    assert pickle.loads(pickle.dumps(inputs)) == inputs
    preprocess(inputs, tmp_path / "out", **OPTIONS)
    assert_same_output(tmp_path / "out", reference, {"dataset": fmt, "config": None, "split": "train",
                                                     "text_field": "text", "data_files": None})
    assert loads.calls and all(c["streaming"] is True for c in loads.calls)


def test_hub_dataset_shards_make_the_shards_of_the_same_documents_as_jsonl(documents, reference, loads, tmp_path,
                                                                           monkeypatch):
    """A hub dataset of two parquet files (served from a folder here) is two inputs, one per shard, named by
    the revision resolved; a re-run of the same command finds the directory complete."""
    write_dataset(documents, "parquet", tmp_path / "hub")
    loads.hub = tmp_path / "hub"
    monkeypatch.setattr(hf_source, "_hub_revision", lambda name: "0123abcd")
    inputs = hf_source.dataset_inputs("someone/news")
    assert [str(i) for i in inputs] == [f"someone/news@0123abcd train shard {i}/2" for i in (1, 2)]
    preprocess(inputs, tmp_path / "out", **OPTIONS)
    assert_same_output(tmp_path / "out", reference, {"dataset": "someone/news", "config": None, "split": "train",
                                                     "text_field": "text", "data_files": None})
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["inputs"] == [str(i) for i in inputs]
    assert meta["plan"]["inputs"] == [[str(i), None, "0123abcd"] for i in inputs]
    assert loads.calls and all(c["streaming"] is True and c["split"] == "train" for c in loads.calls)
    assert set(preprocess(hf_source.dataset_inputs("someone/news"), tmp_path / "out", **OPTIONS)) == {"scan"}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_a_missing_text_field_is_one_line_naming_the_fields(documents, tmp_path, capsys, fmt):
    """Parquet says its fields before the first row, JSON lines in its first row."""
    pattern = write_dataset(documents[:4], fmt, tmp_path / "data")
    capsys.readouterr()
    assert main(["--hf-dataset", fmt, "--hf-data-files", pattern, "--text-field", "body", "--output",
                 str(tmp_path / "out"), "--workers", "1", "--bpe-codes", "10"]) == 2
    err = capsys.readouterr().err
    first = sorted((tmp_path / "data").glob("part-0.*"))[0]
    assert error_lines(err) == [
        f"{PROG}: error: {first} has no field 'body' (its fields: id, text): name the text with --text-field"]
    assert "Traceback" not in err


def test_without_datasets_the_option_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ImportError
    assert main(["--hf-dataset", "vblagoje/cc_news", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"{PROG}: error: --hf-dataset needs the datasets package: "
                                       "pip install 'xlm-pkm[hf]'\n")


def test_datasets_is_imported_only_for_a_dataset():
    code = "import sys, xlm_pkm.data.preprocess; print('datasets' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
