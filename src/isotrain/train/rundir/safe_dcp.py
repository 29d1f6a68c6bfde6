"""Reading `torch.distributed.checkpoint` shards without running code from them.

DCP's `FileSystemReader` reads `.metadata` with plain `pickle.load`, and its default planner
loads every non-tensor item (optimizer hyperparameters) with `torch.load(weights_only=False)`:
a planted pickle would run. Here the metadata goes through an unpickler that knows only the
checkpoint's own classes, every storage path it names must be a file of the snapshot's
checksummed manifest, and non-tensor items are loaded with `weights_only=True`. The files
themselves are verified against the manifest (sha256) before any of this reads them.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from isotrain.train.rundir.integrity import SnapshotError, one_line

__all__ = ["SafeLoadPlanner", "SafeReader", "read_metadata"]

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    *(
        (_DCP, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a layout by name, from a fixed table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes a DCP `.metadata` file consists of (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in checkpoint metadata")


def read_metadata(shards: Path, files: set[str]) -> Metadata:
    """The DCP metadata of `shards`, read safely; every storage path must be one of `files`
    (names of the shard directory's checksummed files)."""
    try:
        md = _MetadataUnpickler(io.BytesIO((shards / METADATA).read_bytes())).load()
    except Exception as e:  # a damaged or hostile file can fail in any way: all mean "bad"
        raise SnapshotError(f"{shards}: unsafe or damaged {METADATA} ({one_line(e)})") from None
    storage = getattr(md, "storage_data", None)
    if (
        not isinstance(md, Metadata)
        or not isinstance(storage, dict)
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_meta, (StorageMeta, type(None)))
    ):
        raise SnapshotError(f"{shards}: {METADATA} is not checkpoint metadata")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if rel not in files or rel == METADATA:
            raise SnapshotError(f"{shards}: {METADATA} names {rel!r}, not a shard of this snapshot")
        if not (isinstance(offset, int) and isinstance(length, int) and min(offset, length) >= 0):
            raise SnapshotError(f"{shards}: {METADATA} holds an invalid offset or length")
        if getattr(info, "transform_descriptors", None):
            raise SnapshotError(f"{shards}: {METADATA} asks for storage transforms; none are used")
    return md


class SafeReader(FileSystemReader):
    """A `FileSystemReader` that returns metadata already read by `read_metadata`."""

    def __init__(self, shards: Path, metadata: Metadata) -> None:
        super().__init__(shards)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The verified metadata (never rank-local files: isotrain does not write them)."""
        if kwargs.get("rank") is not None:
            raise SnapshotError("rank-local checkpoint metadata is not supported")
        storage_meta = self._metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        self._metadata.storage_meta = storage_meta
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` with non-tensor items loaded as plain data (`weights_only=True`)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Decode safely, then hand DCP a re-encoding of the decoded (plain) object."""
        obj = torch.load(value, weights_only=True)
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
