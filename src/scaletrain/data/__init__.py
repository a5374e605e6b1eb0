"""Data sources and the sharded, resumable loader."""

from __future__ import annotations

from scaletrain.config import DataConfig, ModelConfig
from scaletrain.data.loader import (
    ShardedLoader,
    ShardedSampler,
    StreamLoader,
    Weighted,
    epoch_permutation,
    eval_indices,
    eval_loader,
    train_size,
)
from scaletrain.data.sources import (
    Splits,
    TensorPairs,
    TokenWindows,
    digits,
    in_memory,
    stdlib_text,
    token_bin,
)
from scaletrain.errors import ConfigError

__all__ = ["ShardedLoader", "ShardedSampler", "Splits", "StreamLoader", "TensorPairs", "TokenWindows", "Weighted",
           "build_splits", "epoch_permutation", "eval_indices", "eval_loader", "in_memory", "train_size"]


def build_splits(data: DataConfig, model: ModelConfig) -> Splits:
    """The built-in sources by name; source=memory needs the data passed to fit()."""
    if data.source == "digits":
        return digits(data.val_fraction)
    if data.source == "stdlib":
        return stdlib_text(data.seq_len)
    if data.source == "bin":
        return token_bin(data.path, data.seq_len, model.vocab_size)
    raise ConfigError("data.source", data.source, "digits, stdlib or bin from the command line (memory is for "
                      "tensors passed to scaletrain.fit)", "--data.source=digits")
