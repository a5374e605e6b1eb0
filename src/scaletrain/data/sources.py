"""Data sources: built-in sets and user formats, each giving a train and a held-out split.

Nothing here downloads anything: digits ships inside scikit-learn, the stdlib corpus is the interpreter's own
standard library, and .bin token files and arrays are the user's.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sysconfig
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from scaletrain.data.loader import Weighted
from scaletrain.errors import DataError, UserError

Task = Literal["classify", "lm"]


@dataclass
class Splits:
    """A train split, an optional held-out split, and what a model needs to know about them."""

    train: Dataset
    eval: Dataset | None
    task: Task
    info: dict[str, Any] = field(default_factory=dict)  # num_classes/input_shape, or vocab_size/seq_len
    collate_fn: Callable[[list[Any]], Any] | None = None  # a list of samples -> a batch (None: scaletrain's)
    worker_init_fn: Callable[[int], None] | None = None  # run in each DataLoader worker (a DataLoader's, to fit())


class TensorPairs(Dataset):
    """(inputs[i], targets[i]) from two tensors of equal length."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if len(inputs) != len(targets):
            raise UserError(f"data: inputs have {len(inputs)} rows but targets {len(targets)}; "
                            "fix: pass inputs and targets of the same length")
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream: sample i is tokens [i*T, i*T+T) -> [i*T+1, i*T+T+1).

    ``tokens`` is a 1-D tensor, or the path of a uint16 .bin file opened lazily as a memmap in every process
    (a memmap must not be pickled into DataLoader workers: pickling would copy the whole file).
    """

    def __init__(self, tokens: torch.Tensor | Path, seq_len: int, num_tokens: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.length = (num_tokens - 1) // seq_len
        self._memmap: np.memmap | None = None

    def __len__(self) -> int:
        return self.length

    def _stream(self) -> torch.Tensor | np.memmap:
        if isinstance(self.tokens, torch.Tensor):
            return self.tokens
        if self._memmap is None:
            self._memmap = np.memmap(self.tokens, dtype=np.uint16, mode="r")
        return self._memmap

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = self._stream()[start : start + self.seq_len + 1]
        chunk = torch.as_tensor(np.asarray(chunk, dtype=np.int64)) if not isinstance(chunk, torch.Tensor) \
            else chunk.long()
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_memmap": None}


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels (1797, 64) as 0..16 floats, labels (1797,)): the file scikit-learn bundles, read the way its
    load_digits reads it, without importing scikit-learn (whose import takes 2-3 s, scipy.stats included,
    in every process of a run). Falls back to load_digits where the file is not at its usual place."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without running its __init__
    where = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if where is None or not where.is_file():
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return x, y
    data = np.loadtxt(where, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def stratified_split(y: np.ndarray, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): ceil(fraction x n) held out, each class in proportion (the
    rounding shared out by largest remainder, so a class is off by less than one), drawn with a fixed seed."""
    n = len(y)
    n_out = math.ceil(fraction * n - 1e-9)
    classes, counts = np.unique(y, return_counts=True)
    exact = counts * n_out / n
    take = np.floor(exact).astype(int)
    take[np.argsort(-(exact - take), kind="stable")[: n_out - int(take.sum())]] += 1
    rng = np.random.default_rng(seed)
    out = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c, k in zip(classes, take)])
    held = np.zeros(n, dtype=bool)
    held[out] = True
    return np.flatnonzero(~held), np.sort(out)


def digits(val_fraction: float) -> Splits:
    """scikit-learn's 1,797 8x8 handwritten digits, pixels scaled to [0, 1], a fixed stratified split."""
    x, y = load_digits_arrays()
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    # The split is fixed (seed 0), not tied to run.seed: changing the seed keeps the test set.
    to, info = torch.from_numpy, {"num_classes": 10, "input_shape": (1, 8, 8)}
    if val_fraction == 0:  # none held out: no evaluation
        return Splits(TensorPairs(to(x), to(y)), None, "classify", info)
    train, held = stratified_split(y, val_fraction)
    return Splits(TensorPairs(to(x[train]), to(y[train])), TensorPairs(to(x[held]), to(y[held])), "classify", info)


def stdlib_files() -> list[Path]:
    """The interpreter's own standard-library .py files, site-packages excluded, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        found += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return found


def stdlib_split(val_every: int = 10) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files): a file is held out when crc32(its path under the stdlib root) % val_every
    == 0, so the split is the same on every run and machine with the same Python, whatever the install prefix."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[Path]] = {False: [], True: []}
    for path in stdlib_files():
        parts[zlib.crc32(str(path.relative_to(root)).encode()) % val_every == 0].append(path)
    return parts[False], parts[True]


def stdlib_text(seq_len: int, val_every: int = 10) -> Splits:
    """Bytes of the standard library's source (vocab 256), files joined by a newline; the held-out files are
    those of stdlib_split."""
    train_files, val_files = stdlib_split(val_every)
    if not train_files or not val_files:
        raise DataError(Path(sysconfig.get_paths()["stdlib"]), "found no standard-library .py files to train on",
                        "use a Python installation that ships its standard library sources")

    def stream(files: list[Path]) -> TokenWindows:
        data = torch.frombuffer(bytearray(b"\n".join(p.read_bytes() for p in files)), dtype=torch.uint8)
        return TokenWindows(data, seq_len, len(data))

    return Splits(stream(train_files), stream(val_files), "lm", {"vocab_size": 256, "seq_len": seq_len})


def _check_bin(path: Path, seq_len: int) -> int:
    """Number of uint16 tokens in a .bin file, or a DataError naming what is wrong."""
    if not path.is_file():
        raise DataError(path, "not found", "point --data.path at a directory with train.bin and val.bin")
    size = path.stat().st_size  # bytes
    if size % 2:
        raise DataError(path, f"size {size} bytes is odd, so it is not a uint16 token array",
                        "write tokens with np.array(ids, dtype=np.uint16).tofile(path)")
    if size // 2 < seq_len + 1:
        raise DataError(path, f"holds {size // 2} tokens, fewer than data.seq_len + 1 = {seq_len + 1}",
                        "use a larger file or a smaller --data.seq_len")
    return size // 2


def max_token(path: Path, chunk: int = 1 << 26) -> int:
    """The largest token id in a .bin file (reads it once, in chunks)."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    return int(max(data[i : i + chunk].max() for i in range(0, len(data), chunk)))


def token_bin(directory: str, seq_len: int, vocab_size: int = 0) -> Splits:
    """nanoGPT's layout: DIR/train.bin and DIR/val.bin, flat uint16 token ids. vocab_size 0 scans the files."""
    root = Path(directory)
    if not root.is_dir():
        raise DataError(root, "not a directory", "point --data.path at a directory with train.bin and val.bin")
    files = {name: root / f"{name}.bin" for name in ("train", "val")}
    counts = {name: _check_bin(p, seq_len) for name, p in files.items()}
    if vocab_size == 0:
        vocab_size = max(max_token(p) for p in files.values()) + 1
    windows = {name: TokenWindows(files[name], seq_len, counts[name]) for name in files}
    return Splits(windows["train"], windows["val"], "lm", {"vocab_size": vocab_size, "seq_len": seq_len})


def _as_tensor(a: Any, what: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    raise UserError(f"data: {what} is a {type(a).__name__}; fix: pass a torch.Tensor or a numpy array")


def in_memory(train: Any, eval_data: Any = None, val_fraction: float = 0.2, task: Task = "classify",
              collate_fn: Callable[[list[Any]], Any] | None = None) -> Splits:
    """A torch Dataset, any other map-style dataset a DataLoader takes (a list of samples, a Hugging Face
    datasets.Dataset: len() and [i]), or (inputs, targets) as tensors or numpy arrays; for training also a
    stream (an IterableDataset, data/loader.py StreamLoader). Without eval data a fixed val_fraction of the
    training data is held out: ceil(n x val_fraction) samples, at least 1, chosen by a permutation seeded with
    0 (the same on every run and rank, whatever run.seed is); a stream's is not, nor any with val_fraction 0
    (no evaluation then). Held-out data may be a stream too.
    ``collate_fn``: how the loaders make a batch of samples (a padding collator), as a DataLoader's."""
    arrays = (torch.Tensor, np.ndarray)

    def as_dataset(d: Any, what: str) -> Dataset:
        if isinstance(d, IterableDataset):  # a stream: read in its order by StreamLoader (training: with
            return d  # train.max_steps; held out: a whole pass from its start at each evaluation)
        if isinstance(d, Dataset):
            return d
        # A tuple of two is (inputs, targets); so is a list of two arrays (a list of two samples is not).
        if (isinstance(d, tuple) and len(d) == 2) or (isinstance(d, list) and len(d) == 2
                                                      and all(isinstance(a, arrays) for a in d)):
            return TensorPairs(_as_tensor(d[0], f"{what} inputs"), _as_tensor(d[1], f"{what} targets"))
        if isinstance(d, arrays):  # its rows are the samples, unlabelled (a model computing its own loss: a VAE's)
            rows = _as_tensor(d, what)
            if rows.dim() == 0 or len(rows) == 0:
                raise UserError(f"data: {what} is a tensor of shape {tuple(rows.shape)}, which has no rows to be "
                                "samples; fix: pass (inputs, targets), or a tensor of one sample per row")
            return rows  # type: ignore[return-value]
        if hasattr(d, "__len__") and hasattr(d, "__getitem__") and not isinstance(d, (str, bytes, dict)):
            if len(d) == 0:
                raise UserError(f"data: {what} has no samples; fix: pass a dataset with at least one sample")
            try:
                first = d[0]
            except (KeyError, IndexError, TypeError) as err:  # a table's [0] is a column: a pandas DataFrame
                raise UserError(f"data: {what} is a {type(d).__name__} whose [0] is not a sample ({type(err).__name__}"
                                f": {err}); fix: pass (inputs, targets) as arrays (a DataFrame's "
                                "df[columns].to_numpy() and df[target].to_numpy()) or a Dataset") from None
            if not isinstance(first, (*arrays, tuple, list, Mapping)):
                raise UserError(f"data: {what} is a {type(d).__name__} of {type(first).__name__}; fix: samples are "
                                "tensors, tuples (inputs..., target) or dicts; or pass (inputs, targets)")
            return d  # map-style, as a DataLoader takes it
        raise UserError(f"data: {what} is a {type(d).__name__}; fix: pass a torch Dataset, a list of samples, "
                        "or (inputs, targets)")

    if collate_fn is not None and not callable(collate_fn):
        raise UserError(f"collate_fn: a {type(collate_fn).__name__} is not callable; fix: pass a function of a list "
                        "of samples, as a DataLoader takes (transformers' DataCollatorWithPadding(tokenizer))")
    train_ds = as_dataset(train, "train")
    if eval_data is not None:
        return Splits(train_ds, as_dataset(eval_data, "eval"), task, collate_fn=collate_fn)
    if isinstance(train_ds, IterableDataset) or val_fraction == 0:  # nothing to hold out, or none asked
        return Splits(train_ds, None, task, collate_fn=collate_fn)
    n = len(train_ds)  # type: ignore[arg-type]
    # ceil, as scikit-learn does for digits; rounding first keeps 100 x 0.07 = 7.000000000000001 at 7.
    n_val = max(1, math.ceil(round(n * val_fraction, 6)))
    if n - n_val < 1:
        raise UserError(f"data: {n} training sample(s) leave none to train on after holding out "
                        f"data.val_fraction = {val_fraction}; fix: pass eval_data, or more training data")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    subset = torch.utils.data.Subset
    if isinstance(train_ds, Weighted):  # trained by weight, held out as they are: each sample once
        return Splits(train_ds.part(perm[n_val:]), subset(train_ds.dataset, perm[:n_val]), task, collate_fn=collate_fn)
    return Splits(subset(train_ds, perm[n_val:]), subset(train_ds, perm[:n_val]), task, collate_fn=collate_fn)
