"""Distributed Checkpoint's folders (checkpoint.dcp/step*/) read as data, never as code.

torch reads a folder's `.metadata` with plain pickle.load and its non-tensor entries with
torch.load(weights_only=False): a downloaded run directory would run its author's code on resume or on
evaluate.py. Here `.metadata` is unpickled with an allow-list of Distributed Checkpoint's own records (plain
dataclasses and enums, torch's dtypes and sizes, a path), and a non-tensor entry with weights_only=True:

    dcp.load(tensors, checkpoint_id=folder, storage_reader=DataOnlyReader(folder), planner=DataOnlyPlanner())

Anything else is refused in one line naming the file and what it names (safe_load.UnsafeFileError).
Imported only where a folder is read (torch.distributed.checkpoint takes about a second to import).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from xlm_pkm.checkpoint.safe_load import refused

# What Distributed Checkpoint's .metadata may name: its own records (dataclasses, enums), torch's dtypes and
# sizes, a path (its checkpoint_id). Each only holds values; none runs anything when built.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise refused(self.path, f"{module}.{name}")


class DataOnlyReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with an allow-list (see the module's docstring)."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads a non-tensor entry with weights_only=True (torch's reads it as any pickle)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise refused(read_item.dest_index.fqn, "an object torch's safe loader refuses") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
