"""Data sources: digits, the stdlib corpus, nanoGPT-style .bin memmaps and in-memory tensors/arrays."""

from __future__ import annotations

import pickle
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from scaletrain.data import TensorPairs, TokenWindows, in_memory
from scaletrain.data.sources import digits, stdlib_files, stdlib_split, stdlib_text, token_bin
from scaletrain.errors import DataError, UserError

# --- digits ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digit_splits():
    return digits(0.2)


def stack(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs), torch.stack(ys)


def test_digits_sizes_shapes_and_range(digit_splits) -> None:
    s = digit_splits
    assert (len(s.train), len(s.eval)) == (1437, 360)
    assert s.task == "classify" and s.info == {"num_classes": 10, "input_shape": (1, 8, 8)}
    for ds in (s.train, s.eval):
        x, y = stack(ds)
        assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
        assert x.min().item() == 0.0 and x.max().item() == 1.0  # pixels 0..16 scaled by 1/16


def test_digits_split_is_stratified_complete_and_fixed(digit_splits) -> None:
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    per_class = Counter(y_all.tolist())
    assert sum(per_class.values()) == 1797
    _, y_eval = stack(digit_splits.eval)
    held = Counter(y_eval.tolist())
    for c in range(10):
        assert abs(held[c] - 0.2 * per_class[c]) < 1, c  # each class held out in proportion, within one
    # train + eval is the whole set (as a multiset of (pixels, label) rows), nothing lost or repeated.
    rows = sorted(tuple(np.round(x.flatten().numpy() * 16).astype(int).tolist()) + (int(y),)
                  for ds in (digit_splits.train, digit_splits.eval) for x, y in (ds[i] for i in range(len(ds))))
    assert rows == sorted(tuple(x.astype(int).tolist()) + (int(y),) for x, y in zip(x_all, y_all))
    again = digits(0.2)
    assert torch.equal(stack(again.eval)[0], stack(digit_splits.eval)[0])
    assert torch.equal(stack(again.train)[1], stack(digit_splits.train)[1])


def test_digits_are_read_as_scikit_learn_reads_them_without_importing_it() -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from scaletrain.data.sources import load_digits_arrays

    x, y = load_digits_arrays()
    x_ref, y_ref = load_digits(return_X_y=True)
    assert np.array_equal(x, x_ref) and np.array_equal(y, y_ref) and y.dtype == y_ref.dtype
    code = ("import sys; from scaletrain.data.sources import digits; digits(0.2); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # its import costs 2-3 s in every process of a run


# --- stdlib text -----------------------------------------------------------------------------------------

SEQ = 64


@pytest.fixture(scope="module")
def stdlib_splits():
    return stdlib_text(SEQ)


def stream_len(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files) + len(files) - 1  # bytes, files joined by b"\n"


def test_stdlib_split_is_deterministic_disjoint_and_excludes_site_packages() -> None:
    train, val = stdlib_split()
    assert train and val
    assert (train, val) == stdlib_split()
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(stdlib_files())
    root = Path(sysconfig.get_paths()["stdlib"])
    for p in train + val:
        assert p.suffix == ".py" and p.is_relative_to(root)
        assert not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts), p
    assert 0.05 < len(val) / len(train + val) < 0.15  # crc32 % 10: about one file in ten


def test_stdlib_text_windows(stdlib_splits) -> None:
    s = stdlib_splits
    train_files, val_files = stdlib_split()
    assert len(s.train) == (stream_len(train_files) - 1) // SEQ > 0
    assert len(s.eval) == (stream_len(val_files) - 1) // SEQ > 0
    assert s.task == "lm" and s.info == {"vocab_size": 256, "seq_len": SEQ}
    head = b"\n".join(p.read_bytes() for p in train_files[:50])[: 2 * SEQ + 1]
    x0, y0 = s.train[0]
    x1, y1 = s.train[1]
    assert x0.shape == y0.shape == (SEQ,) and x0.dtype == y0.dtype == torch.int64
    assert x0.tolist() == list(head[:SEQ]) and y0.tolist() == list(head[1 : SEQ + 1])
    assert x1.tolist() == list(head[SEQ : 2 * SEQ])  # non-overlapping windows of one stream
    assert y1.tolist() == list(head[SEQ + 1 : 2 * SEQ + 1])
    assert torch.equal(x0[1:], y0[:-1]) and y0[-1] == x1[0]
    last_x, last_y = s.eval[len(s.eval) - 1]
    assert torch.equal(last_x[1:], last_y[:-1]) and last_x.shape == (SEQ,)
    assert int(x0.max()) < 256


# --- token .bin memmaps ----------------------------------------------------------------------------------

T = 16


def write_bins(root: Path, train: np.ndarray, val: np.ndarray) -> None:
    root.mkdir(parents=True, exist_ok=True)
    train.astype(np.uint16).tofile(root / "train.bin")
    val.astype(np.uint16).tofile(root / "val.bin")


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50_000, size=10_001).astype(np.uint16)
    train[123] = 60_000  # above int16's range: must come back as 60000, not negative
    val = rng.integers(0, 1_000, size=333).astype(np.uint16)
    val[7] = 61_234  # the largest id is in val.bin, so the scan must read both files
    write_bins(tmp_path / "corpus", train, val)
    return tmp_path / "corpus", train, val


def test_token_bin_windows_and_vocab(corpus) -> None:
    root, train, val = corpus
    s = token_bin(str(root), T)
    assert s.task == "lm" and s.info == {"vocab_size": 61_235, "seq_len": T}
    assert (len(s.train), len(s.eval)) == ((10_001 - 1) // T, (333 - 1) // T) == (625, 20)
    for ds, tokens in ((s.train, train), (s.eval, val)):
        for i in (0, 1, 7, len(ds) - 1):
            x, y = ds[i]
            assert x.dtype == torch.int64 and x.shape == y.shape == (T,)
            assert x.tolist() == tokens[i * T : i * T + T].astype(int).tolist()
            assert y.tolist() == tokens[i * T + 1 : i * T + T + 1].astype(int).tolist()
    assert 60_000 in s.train[123 // T][0].tolist()
    assert token_bin(str(root), T, vocab_size=70_000).info["vocab_size"] == 70_000  # given: not scanned


def check_data_error(exc: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(exc.value)
    assert isinstance(exc.value, UserError) and exc.value.path == path
    assert msg.startswith(str(path)) and "fix:" in msg and "\n" not in msg


def test_token_bin_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        token_bin(str(tmp_path / "nope"), T)
    check_data_error(exc, tmp_path / "nope")
    assert "not a directory" in str(exc.value)


@pytest.mark.parametrize("missing", ["train", "val"])
def test_token_bin_missing_file(corpus, missing: str) -> None:
    root, _, _ = corpus
    (root / f"{missing}.bin").unlink()
    with pytest.raises(DataError) as exc:
        token_bin(str(root), T)
    check_data_error(exc, root / f"{missing}.bin")
    assert "not found" in str(exc.value)


def test_token_bin_odd_byte_size(corpus) -> None:
    root, _, _ = corpus
    with open(root / "val.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError) as exc:
        token_bin(str(root), T)
    check_data_error(exc, root / "val.bin")
    assert "size 667 bytes is odd" in str(exc.value)


def test_token_bin_too_few_tokens(tmp_path: Path) -> None:
    root = tmp_path / "tiny"
    write_bins(root, np.arange(100), np.arange(T))  # val holds T tokens: one short of a window
    with pytest.raises(DataError) as exc:
        token_bin(str(root), T)
    check_data_error(exc, root / "val.bin")
    assert f"holds {T} tokens, fewer than data.seq_len + 1 = {T + 1}" in str(exc.value)
    write_bins(root, np.arange(100), np.arange(T + 1))
    assert len(token_bin(str(root), T).eval) == 1


def test_memmap_windows_pickle_small_and_load_in_worker_processes(corpus) -> None:
    root, train, _ = corpus
    ds = token_bin(str(root), T).train
    assert isinstance(ds, TokenWindows)
    _ = ds[3]  # opens the memmap in this process
    blob = pickle.dumps(ds)
    assert len(blob) < 1_000 < (root / "train.bin").stat().st_size // 10  # the path travels, not the tokens
    copy = pickle.loads(blob)
    assert all(torch.equal(a, b) for a, b in zip(copy[5], ds[5]))
    # spawn, not fork: the workers get the data set by pickle, as on macOS and Windows
    loader = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert sum(len(x) for x, _ in batches) == len(ds) == 625
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert torch.equal(x.flatten(), torch.from_numpy(train[: 625 * T].astype(np.int64)))
    assert torch.equal(y.flatten(), torch.from_numpy(train[1 : 625 * T + 1].astype(np.int64)))


# --- in-memory tensors and arrays ------------------------------------------------------------------------


def test_in_memory_tensors_with_eval() -> None:
    x, y = torch.randn(10, 3), torch.arange(10)
    xv, yv = torch.randn(4, 3), torch.arange(4)
    s = in_memory((x, y), (xv, yv))
    assert (len(s.train), len(s.eval), s.task) == (10, 4, "classify")
    assert torch.equal(s.train[7][0], x[7]) and s.train[7][1].item() == 7
    assert torch.equal(s.eval[3][0], xv[3])


def test_in_memory_numpy_arrays() -> None:
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    y = np.arange(12) % 3
    s = in_memory((x, y), [x[:5], y[:5]], task="classify")
    assert (len(s.train), len(s.eval)) == (12, 5)
    xi, yi = s.train[11]
    assert isinstance(xi, torch.Tensor) and xi.tolist() == [22.0, 23.0] and yi.item() == 2


def test_in_memory_dataset_is_used_as_is() -> None:
    ds = TensorDataset(torch.arange(6.0))
    assert in_memory(ds, ds).train is ds


def test_a_list_of_samples_or_any_map_style_dataset_is_used_as_is() -> None:
    samples = [{"input_ids": torch.arange(4), "labels": torch.arange(4)} for _ in range(3)]

    class Rows:  # a Hugging Face datasets.Dataset's shape: len() and [i], not a torch Dataset
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> tuple:
            return torch.tensor([float(i)]), i

    rows = Rows()
    s = in_memory(samples, rows)
    assert s.train is samples and s.eval is rows
    pair = [torch.zeros(4, 2), torch.zeros(4)]  # a list of two arrays stays (inputs, targets), as before
    assert len(in_memory(pair, pair).train) == 4


def test_mismatched_lengths_is_a_one_line_user_error() -> None:
    with pytest.raises(UserError) as exc:
        in_memory((torch.zeros(10, 2), np.zeros(9)))
    msg = str(exc.value)
    assert "\n" not in msg and "10 rows but targets 9" in msg and "fix:" in msg
    with pytest.raises(UserError, match="3 rows but targets 2"):
        TensorPairs(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize("bad, what", [
    ([1, 2, 3], "train is a list of int"),
    ([], "train has no samples"),
    (type("Table", (), {"__len__": lambda self: 3, "__getitem__": lambda self, k: {"a": [1, 2, 3]}[k]})(),
     "train is a Table whose [0] is not a sample (KeyError: 0)"),
    (torch.zeros(()), "train is a tensor of shape (), which has no rows to be samples"),
    ("data.csv", "train is a str"),
    (([1, 2], [3, 4]), "train inputs is a list"),
    ((torch.zeros(2), {"y": 1}), "train targets is a dict"),
])
def test_wrong_types_are_user_errors(bad, what: str) -> None:
    with pytest.raises(UserError) as exc:
        in_memory(bad)
    assert what in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(UserError, match="eval"):
        in_memory((torch.zeros(2), torch.zeros(2)), eval_data=42)


def test_a_val_fraction_of_0_holds_nothing_out() -> None:
    """A model whose eval-mode output its loss cannot take (torchvision's detection models) trains on all its data
    without evaluation: data.val_fraction's range was (0, 1), so 20% was always held out and evaluated."""
    s = in_memory((torch.arange(10), torch.arange(10)), val_fraction=0)
    assert s.eval is None and len(s.train) == 10
    whole = digits(0)
    assert whole.eval is None and len(whole.train) == 1797
    from scaletrain.config import load
    from scaletrain.errors import ConfigError

    assert load(cli_overrides={"data.val_fraction": "0"}).data.val_fraction == 0
    with pytest.raises(ConfigError, match="data.val_fraction = 1"):
        load(cli_overrides={"data.val_fraction": "1"})


def held_out(n: int, fraction: float) -> tuple[list[int], list[int]]:
    s = in_memory((torch.arange(n), torch.arange(n)), val_fraction=fraction)
    return [int(s.train[i][0]) for i in range(len(s.train))], [int(s.eval[i][0]) for i in range(len(s.eval))]


@pytest.mark.parametrize("n, fraction, n_val", [(100, 0.2, 20), (101, 0.2, 21), (100, 0.29, 29), (100, 0.07, 7),
                                                (1797, 0.2, 360), (3, 0.1, 1)])
def test_held_out_split_sizes_disjoint_and_fixed(n: int, fraction: float, n_val: int) -> None:
    torch.manual_seed(123)
    train, val = held_out(n, fraction)
    assert (len(train), len(val)) == (n - n_val, n_val)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(n))
    torch.manual_seed(456)  # the global seed plays no part
    assert held_out(n, fraction) == (train, val)


def test_held_out_split_matches_digits_rule() -> None:
    """1,797 samples at 0.2 hold out 360, as scikit-learn's split of digits does."""
    assert len(held_out(1797, 0.2)[1]) == 360


def test_nothing_left_to_train_on_is_a_user_error() -> None:
    with pytest.raises(UserError, match="1 training sample"):
        in_memory((torch.zeros(1), torch.zeros(1)))
