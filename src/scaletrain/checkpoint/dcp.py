"""Sharded checkpoints through Distributed Checkpoint (DCP), loaded without trusting pickle.

FSDP runs save the model and the optimizer's per-parameter state as DCP shards: every rank writes its own
part in parallel into the staging directory of the commit protocol (checkpoint/commit.py), and DCP can
load them at any other world size (it reshards). The optimizer's param groups, which are not tensors, go
into a separate safetensors/JSON tree, so the shards hold tensors only. Buffers are not sharded: ``model.*``
holds rank 0's, and the buffers that differ between ranks (FSDP does not synchronize BatchNorm statistics)
are saved by every other rank under ``rank_buffers.R.*`` (train/checkpointing.py).

DCP keeps its index (``.metadata``) as a pickle, and reads non-tensor items with
``torch.load(weights_only=False)``: a tampered checkpoint would run code. Here the index is read by an
unpickler that only builds DCP's own metadata classes, ``torch.Size`` and dtypes, and byte items are read
with ``weights_only=True``. Loading also happens only after rank 0 verified every file against the
manifest.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from scaletrain.errors import CheckpointError

DCP_DIR = "dcp"

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's index and nothing else: any other global is refused before it is looked up."""

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(self.where, f"its DCP index refers to {module}.{name}, which no checkpoint index "
                              "holds (a planted payload?); nothing was executed",
                              "do not load this checkpoint; resume from another one")


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by _IndexUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _IndexUnpickler(f, str(path)).load()
        except CheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ImportError, TypeError, ValueError,
                IndexError, KeyError) as err:  # the ways a damaged pickle fails
            raise CheckpointError(path, f"unreadable DCP index ({type(err).__name__}: {err})",
                                  "resume from another checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(path, f"a {type(metadata).__name__}, not a DCP index", "resume from another one")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """Byte items (non-tensor values) are read with weights_only=True: data, never code."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(read_item.dest_index.fqn, f"a non-tensor item that is not plain data ({err})",
                                  "do not load this checkpoint") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def rank_errors(err: BaseException) -> list[BaseException]:
    """Each rank's own error inside DCP's CheckpointException (which holds every rank's, with its traceback,
    and is a BaseException); any other error alone."""
    found = []
    for failure in getattr(err, "failures", {}).values() or [err]:
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            failure = failure[0]  # torch's (exception, stack summary) pair
        found.append(getattr(failure, "exception", failure))
    return found


def first_failure(err: BaseException) -> BaseException:
    """The first rank's own error (rank_errors)."""
    return rank_errors(err)[0]


def said(err: BaseException) -> str:
    """``Type: first line`` of an error, for a one-line message."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def _split_by_parts(value: Any) -> bool:
    """A DTensor split part by part over a "tp" axis (parallel/tensor.py's FusedColwise: GPT's fused q, k, v).
    A rank's rows are then several blocks of the whole tensor, while DCP addresses a shard as one block: it
    would save them as one and find it overlapping the others'."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(value, DTensor) or "tp" not in (value.device_mesh.mesh_dim_names or ()):
        return False
    return isinstance(value.placements[value.device_mesh.mesh_dim_names.index("tp")], _StridedShard)


def addressable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (nested dicts) with each DTensor DCP cannot address (_split_by_parts) gathered whole
    (Replicate): saved once, loaded at any layout. The cost: those tensors' all-gather at every save and load
    (GPT's qkv matrices: a quarter of its block parameters and their optimizer state)."""
    from torch.distributed.tensor import Replicate

    def one(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        if _split_by_parts(value):
            return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
        return value

    return one(state)


def placed_like(loaded: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """After a load into ``addressable(like)``: each gathered tensor split again as its counterpart in ``like``."""
    def one(value: Any, want: Any) -> Any:
        if isinstance(value, dict):
            return {k: one(v, want.get(k) if isinstance(want, dict) else None) for k, v in value.items()}
        if _split_by_parts(want):
            return value.redistribute(placements=want.placements)
        return value

    return one(loaded, like)


def save(state: dict[str, Any], directory: Path, process_group: Any = None) -> None:
    """Every rank writes its shards of ``state`` (tensors, DTensors) into directory (a shared path). A plain
    tensor that every rank holds under the same key (a buffer) is written once, by the lowest rank holding
    it, so that it is rank 0's copy, not whichever rank DCP's load balancing would pick."""
    dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), process_group=process_group)


def load(state: dict[str, Any], directory: Path, process_group: Any = None, *, no_dist: bool = False) -> None:
    """Fill ``state``'s tensors in place from the shards (resharding to this world size). Without a process
    group (one process) it reads everything itself."""
    no_dist = no_dist or not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist says so already
        dcp.load(state, storage_reader=SafeReader(str(directory)), planner=SafePlanner(),
                 process_group=process_group, no_dist=no_dist)


def read_index(directory: Path) -> Metadata:
    return SafeReader(str(directory)).read_metadata()


def full_tensors(directory: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor whose key starts with prefix, consolidated in this one process (for export)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_index(directory)
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in index.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(directory, f"holds no tensors under {prefix!r}", "point at a model checkpoint")
    nested: dict[str, Any] = {}
    for key, tensor in state.items():
        nested.setdefault(prefix.rstrip("."), {})[key[len(prefix):]] = tensor
    load(nested, directory, no_dist=True)
    return nested[prefix.rstrip(".")]
