"""A state tree as one safetensors file: the tensors as tensors, everything else as JSON in its header.

Optimizer, RNG and trainer state are nested dicts, lists and tuples of tensors, numbers, strings, booleans
and None. ``encode`` stores every tensor under a path-like key and keeps the structure as a JSON skeleton
in the file's metadata; ``decode`` rebuilds the tree. Nothing is pickled, so nothing can be unpickled: a
planted pickle payload is just bytes that fail to parse.

Skeleton: a tensor is ``{"t": key}``, a tuple ``{"tuple": [...]}``, a dict with non-string keys
``{"items": [[key, value], ...]}``, a dict with string keys ``{"dict": {...}}``; lists and scalars are
themselves. Floats round-trip exactly (JSON via repr), NaN and infinities included.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from scaletrain.errors import CheckpointError

SKELETON_KEY = "scaletrain.tree"


def _split(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        key = path or "root"
        tensors[key] = node.detach().contiguous()
        return {"t": key}
    if isinstance(node, tuple):
        return {"tuple": [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]
    if isinstance(node, dict):
        if all(isinstance(k, str) for k in node):
            return {"dict": {k: _split(v, f"{path}/{k}", tensors) for k, v in node.items()}}
        return {"items": [[k, _split(v, f"{path}/{k}", tensors)] for k, v in node.items()]}
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise TypeError(f"cannot store a {type(node).__name__} at {path or 'the root'} of a checkpoint tree")


def _join(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [_join(v, tensors, where) for v in node]
    if isinstance(node, dict):
        if set(node) == {"t"}:
            if node["t"] not in tensors:
                raise CheckpointError(where, f"the structure names a tensor {node['t']!r} the file does not hold",
                                      "the file is damaged: resume from another checkpoint")
            return tensors[node["t"]]
        if set(node) == {"tuple"}:
            return tuple(_join(v, tensors, where) for v in node["tuple"])
        if set(node) == {"dict"}:
            return {k: _join(v, tensors, where) for k, v in node["dict"].items()}
        if set(node) == {"items"}:
            return {k: _join(v, tensors, where) for k, v in node["items"]}
        raise CheckpointError(where, f"unknown node {sorted(node)} in the structure", "the file is damaged")
    return node


def split(tree: Any, metadata: dict[str, str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata): what ``safetensors.torch.save_file`` writes for this tree. The tensors are the
    tree's own (not copies)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(tree, "", tensors)
    return tensors, {**(metadata or {}), SKELETON_KEY: json.dumps(skeleton)}


def encode(tree: Any, metadata: dict[str, str] | None = None) -> bytes:
    """The tree as the bytes of one safetensors file (small trees; large ones go through ``split`` and
    ``safetensors.torch.save_file``, which streams to disk without holding the GIL)."""
    return safetensors.torch.save(*split(tree, metadata))


def read_header(data: bytes, where: str) -> dict[str, Any]:
    """The JSON header of a safetensors file (its tensor table and ``__metadata__``), checked for shape."""
    if len(data) < 8:
        raise CheckpointError(where, f"{len(data)} bytes is too short for a safetensors file", "the file is truncated")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise CheckpointError(where, f"its header claims {size} bytes but the file has {len(data) - 8} after it",
                              "the file is truncated or not a safetensors file")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(where, f"not a safetensors file (header is not JSON: {err})",
                              "the file was replaced or damaged") from None
    if not isinstance(header, dict):
        raise CheckpointError(where, "not a safetensors file (header is not a JSON object)", "the file was replaced")
    return header


def load_tensors(data: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) from the bytes of a safetensors file; a malformed file is a CheckpointError. The
    tensors come in name order: safetensors returns them in an order that differs from process to process."""
    header = read_header(data, where)
    try:
        loaded = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as err:
        raise CheckpointError(where, f"not a valid safetensors file ({err})", "the file was replaced or damaged") \
            from None
    meta = header.get("__metadata__") or {}
    return {name: loaded[name] for name in sorted(loaded)}, {str(k): str(v) for k, v in meta.items()}


def decode(data: bytes, where: str) -> tuple[Any, dict[str, str]]:
    """(tree, metadata) from bytes written by ``encode``."""
    tensors, meta = load_tensors(data, where)
    if SKELETON_KEY not in meta:
        raise CheckpointError(where, "a safetensors file without scaletrain's structure", "the file was replaced")
    try:
        skeleton = json.loads(meta.pop(SKELETON_KEY))
    except json.JSONDecodeError as err:
        raise CheckpointError(where, f"its structure is not JSON ({err})", "the file is damaged") from None
    return _join(skeleton, tensors, where), meta


def header_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(each tensor's shape by name, metadata) of a safetensors file, read from its header alone: no tensor is
    loaded, and a header that does not describe the file exactly is a CheckpointError."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
            meta = f.metadata() or {}
    except (safetensors.SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(path, f"not a valid safetensors file ({err})",
                              "the file was replaced or damaged") from None
    return shapes, {str(k): str(v) for k, v in meta.items()}


def outline(path: Path) -> Any:
    """The tree a file written by ``encode`` holds, a torch.Size in place of each tensor (header only)."""
    shapes, meta = header_shapes(path)
    if SKELETON_KEY not in meta:
        raise CheckpointError(path, "a safetensors file without scaletrain's structure",
                              "the file was replaced")
    try:
        skeleton = json.loads(meta[SKELETON_KEY])
    except json.JSONDecodeError as err:
        raise CheckpointError(path, f"its structure is not JSON ({err})", "the file is damaged") from None
    sizes = {name: torch.Size(shape) for name, shape in shapes.items()}  # never taken for a tuple value
    try:
        return _join(skeleton, sizes, str(path))  # type: ignore[arg-type]  # sizes stand in for the tensors
    except (TypeError, ValueError, AttributeError) as err:  # a skeleton of the wrong shape
        raise CheckpointError(path, f"its structure is malformed ({type(err).__name__}: {err})",
                              "the file is damaged") from None
