"""Hugging Face `datasets` corpora as preprocessing inputs, always streamed (streaming=True): never loaded whole.

    --hf-dataset parquet|json|arrow|csv|text --hf-data-files PATTERN [...]   local files, one input per file,
        identified by its content as a text or JSONL input is;
    --hf-dataset OWNER/NAME [--hf-config C] [--hf-data-files P ...]          a hub dataset (online), one input
        per shard (data file) at the revision current when resolved, identified by name, revision and shard.

`load_dataset(path, config, data_files=..., split=..., revision=..., streaming=True)` reads each input; its
documents are the non-blank strings of the text field (`--text-field`, default `text`) in dataset order, null
values skipped, exactly as corpus.Reader yields a JSONL file's `text` values: the same documents make the same
shards. `datasets` is imported only when a dataset is read.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from typing import Iterator

from .corpus import CorpusError, replace_surrogates

LOCAL_BUILDERS = ("arrow", "csv", "json", "parquet", "text")  # datasets' builders of local data files
NEEDS_DATASETS = "--hf-dataset needs the datasets package: pip install 'xlm-pkm[hf]'"


def import_datasets():
    """The datasets module; a one-line CorpusError when it is not installed."""
    try:
        import datasets
    except ImportError:
        raise CorpusError(NEEDS_DATASETS) from None
    return datasets


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0] or type(error).__name__


@dataclass(frozen=True)
class DatasetInput:
    """One input of a dataset: a local data `file`, or shard `shard` of `num_shards` of a hub dataset."""
    dataset: str  # a builder of LOCAL_BUILDERS, or a hub name
    config: str | None
    split: str
    text_field: str
    file: str | None = None
    data_files: tuple[str, ...] | None = None  # hub: patterns in the dataset's repository
    revision: str | None = None
    shard: int = 0
    num_shards: int = 1

    def __str__(self) -> str:
        if self.file:
            return self.file
        return f"{self.dataset}@{self.revision} {self.split} shard {self.shard + 1}/{self.num_shards}"

    def load(self):
        """The input as a datasets.IterableDataset."""
        datasets = import_datasets()
        data_files = [self.file] if self.file else list(self.data_files or ()) or None
        try:
            ds = datasets.load_dataset(self.dataset, self.config, data_files=data_files, split=self.split,
                                       revision=self.revision, streaming=True)
        except Exception as e:  # noqa: BLE001 - bad files, splits, names; network errors of whichever HTTP library
            raise CorpusError(f"cannot load {self}: {_first_line(e)}") from None
        return ds.shard(self.num_shards, self.shard) if self.num_shards > 1 else ds


def _missing_field(source: DatasetInput, fields) -> CorpusError:
    return CorpusError(f"{source} has no field '{source.text_field}' (its fields: {', '.join(fields)}): "
                       "name the text with --text-field")


class DatasetReader:
    """Iterate over the documents (str) of a DatasetInput, counting lone surrogates replaced (as corpus.Reader)."""

    def __init__(self, source: DatasetInput):
        self.source = source
        self.replaced = 0

    def _rows(self) -> Iterator[dict]:
        ds = self.source.load()
        if ds.features is not None and self.source.text_field not in ds.features:
            raise _missing_field(self.source, ds.features)
        rows = iter(ds)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - as in DatasetInput.load: a damaged file, a broken connection
                raise CorpusError(f"cannot read {self.source}: {_first_line(e)}") from None
            yield row

    def __iter__(self) -> Iterator[str]:
        field = self.source.text_field
        for n, row in enumerate(self._rows(), 1):
            if field not in row:
                raise _missing_field(self.source, row)
            text = row[field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise CorpusError(f"{self.source}, row {n}: '{field}' is not a string ({type(text).__name__}): "
                                  "name the text with --text-field")
            text, replaced = replace_surrogates(text)
            self.replaced += replaced
            if text.strip():
                yield text


def _local_files(builder: str, patterns: list[str] | None) -> list[str]:
    """The files matching `patterns` (in order, each pattern's sorted; `**` recursive), each once."""
    if not patterns:
        raise CorpusError(f"--hf-dataset {builder} reads local files: give them with --hf-data-files FILE|PATTERN ...")
    files: list[str] = []
    for pattern in patterns:
        found = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not found:
            raise CorpusError(f"--hf-data-files {pattern}: no such file")
        files += [f for f in found if f not in files]
    return files


def _hub_revision(name: str) -> str:
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name).sha
    except Exception as e:  # noqa: BLE001 - not found, offline: the HTTP library's errors, which vary
        raise CorpusError(f"cannot find {name} on the Hugging Face hub ({_first_line(e)}): check the name and the "
                          "connection, or give local files: --hf-dataset parquet --hf-data-files FILE ...") from None


def dataset_inputs(dataset: str, data_files: list[str] | None = None, split: str = "train", text_field: str = "text",
                   config: str | None = None) -> list[DatasetInput]:
    """The inputs of a dataset, as load_dataset(dataset, config, data_files=..., split=..., streaming=True) reads
    it: one per local file (`dataset` a builder of LOCAL_BUILDERS), else one per shard of the hub dataset."""
    import_datasets()
    if dataset in LOCAL_BUILDERS:
        return [DatasetInput(dataset, config, split, text_field, file=f) for f in _local_files(dataset, data_files)]
    whole = DatasetInput(dataset, config, split, text_field, data_files=tuple(data_files) if data_files else None,
                         revision=_hub_revision(dataset))
    n = whole.load().num_shards
    return [replace(whole, shard=i, num_shards=n) for i in range(n)]


def dataset_options(inputs: list) -> dict | None:
    """What a plan records of the dataset that `inputs` come from (its files or shards are the inputs); None
    for files alone."""
    source = next((s for s in inputs if isinstance(s, DatasetInput)), None)
    if source is None:
        return None
    hub_files = list(source.data_files) if source.data_files else None  # local files are the inputs themselves
    return {"dataset": source.dataset, "config": source.config, "split": source.split,
            "text_field": source.text_field, "data_files": hub_files}
