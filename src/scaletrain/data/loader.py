"""Sharded, resumable data loading.

Training order follows ``torch.utils.data.DistributedSampler`` exactly: each epoch draws one permutation of
the whole data set from ``seed + epoch`` (so it does not depend on the world size), and rank r takes
positions r, r + W, r + 2W, ... of it. Consecutive ``batch_size`` of those form the rank's micro-batches, so
micro-step k of all ranks together covers permutation positions [k*b*W, (k+1)*b*W).

Tail rule (training): an epoch runs only whole optimizer steps. The last ``len % (b * W * accum)`` positions
of each epoch's permutation are dropped; since the permutation changes every epoch, so do the dropped samples.
Eval shards are never padded nor dropped: rank r evaluates samples r, r + W, ... once each (fit()'s held-out
split); a loader of a session's loop read inside session.evaluating() gives every sample once too, in as many
batches on every rank (ShardedLoader.whole_pass).

The loader's position is a *global sample cursor* (permutation positions consumed this epoch), which is what
makes a resumed run exact, also at another world size: the resumed ranks continue at position ``cursor``
(rank r at cursor + r, cursor + r + W', ...), so no position is seen twice or skipped. When the step size
``b * W * accum`` changed, the rest of that epoch, positions [cursor, size), is cut into whole steps of the new
size and the tail rule drops what is left over; later epochs follow the plain rule again.

Weighted sampling (a ``Weighted`` data set: what a DataLoader's WeightedRandomSampler asked for): each epoch's
order is ``num_samples`` indices drawn by the weights (torch.multinomial, as the sampler draws them) from the
same ``seed + epoch`` instead of a permutation; positions, ranks, the cursor and resume are as above.
"""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from scaletrain.batch import collate, map_tensors
from scaletrain.errors import UserError


def epoch_permutation(size: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The order of one epoch: DistributedSampler's (torch.randperm seeded with seed + epoch)."""
    if not shuffle:
        return torch.arange(size)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g)


class Weighted(Dataset):
    """``dataset`` whose training epochs draw ``num_samples`` samples by ``weights`` (one per sample), with or
    without replacement: torch's WeightedRandomSampler, sharded over ranks and resumed exactly (ShardedLoader).
    fit() and session.loader() make one of a DataLoader reading a WeightedRandomSampler; pass one directly as
    ``fit(model, Weighted(dataset, weights))``. Its samples are the data set's: held out (data.val_fraction)
    and evaluated as they are, each once; only training draws by weight."""

    def __init__(self, dataset: Any, weights: Any, num_samples: int | None = None, replacement: bool = True) -> None:
        self.dataset = dataset
        self.weights = torch.as_tensor(weights, dtype=torch.double).flatten()
        n = len(dataset)
        self.num_samples = n if num_samples is None else int(num_samples)
        self.replacement = bool(replacement)
        positive = int((self.weights > 0).sum())
        checks = [(len(self.weights) != n, f"{len(self.weights)} weights for {n} samples"),
                  (not bool(torch.isfinite(self.weights).all() and (self.weights >= 0).all()),
                   "a negative or non-finite weight"),
                  (not positive, "no positive weight"),
                  (self.num_samples < 1, f"num_samples = {self.num_samples}"),
                  (not self.replacement and self.num_samples > positive,
                   f"{self.num_samples} samples drawn without replacement from {positive} of positive weight")]
        problem = next((said for failed, said in checks if failed), "")
        if problem:
            raise UserError(f"data: weighted sampling with {problem}; expected one finite weight >= 0 per sample, "
                            "some positive, and num_samples >= 1 (at most the samples of positive weight without "
                            "replacement); fix: WeightedRandomSampler(weights, num_samples) with one weight per "
                            "sample of the dataset")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def part(self, indices: list[int]) -> Weighted:
        """The samples at ``indices`` with their weights, drawing as many per epoch in proportion."""
        kept = max(1, round(self.num_samples * len(indices) / len(self)))
        if not self.replacement:
            kept = min(kept, int((self.weights[indices] > 0).sum()))
        return Weighted(torch.utils.data.Subset(self.dataset, indices), self.weights[indices], kept, self.replacement)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """One epoch's indices, drawn by weight from ``seed + epoch``."""
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.multinomial(self.weights, self.num_samples, self.replacement, generator=g)


class ShardedSampler(Sampler[int]):
    """This rank's indices for permutation positions [cursor, end) of the current epoch.

    ``usable`` is where a whole epoch ends under the tail rule; ``end`` is where the current one ends, which
    differs only for an epoch resumed with another step size (see the module docstring).
    """

    def __init__(self, size: int, *, rank: int, world: int, seed: int, shuffle: bool, usable: int,
                 weighted: Weighted | None = None) -> None:
        assert usable % world == 0 and usable <= size
        self.size, self.rank, self.world = size, rank, world
        self.weighted = weighted  # draws each epoch's order by weight (size = its num_samples)
        self.seed, self.shuffle, self.usable = seed, shuffle, usable
        self.epoch = 0
        self.cursor = 0  # global permutation positions already consumed this epoch
        self.end = usable  # global permutation positions this epoch runs to (exclusive)

    def order(self, epoch: int) -> torch.Tensor:
        """The data set's indices at the ``size`` positions of ``epoch``."""
        if self.weighted is not None:
            return self.weighted.order(self.seed, epoch)
        return epoch_permutation(self.size, self.seed, epoch, self.shuffle)

    def __iter__(self) -> Iterator[int]:
        perm = self.order(self.epoch)
        return iter(perm[self.cursor + self.rank : self.end : self.world].tolist())

    def __len__(self) -> int:
        return len(range(self.cursor + self.rank, self.end, self.world))


def _mixed(*words: int) -> int:
    """A well-mixed 64-bit seed of these integers (SplitMix64's finalizer over each in turn)."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class SeededSamples(Dataset):
    """``dataset`` read in DataLoader workers, each sample drawn with the global RNGs of its worker (torch's,
    Python's, NumPy's: what a random crop, a flip or the user's noise draws from) seeded from (seed, epoch, index)
    just before. Left to the workers' own seeding (each worker seeded once as its iterator starts, samples dealt
    round-robin), a sample's augmentation depended on which worker drew it and how much it had drawn before: a
    run resumed mid-epoch (a new iterator) augmented every later sample otherwise than the run that never
    stopped, and verify-resume said the data differed. Keys are (epoch, index) from ``Keyed``; a plain index
    (an evaluation's whole pass) is seeded as epoch -1."""

    def __init__(self, dataset: Any, seed: int) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "seed", seed)
        inner = dataset  # the data set given: fit()'s training split is a Subset of it
        while isinstance(inner, torch.utils.data.Subset):  # a Subset's __getitems__ reads its data set's way
            inner = inner.dataset
        object.__setattr__(self, "own", inner)
        if callable(getattr(inner, "__getitems__", None)):  # a batched fetch of its own (Hugging Face datasets)
            object.__setattr__(self, "__getitems__", self._batch)  # the DataLoader's fetcher looks on the instance

    # In a worker, get_worker_info().dataset is this wrapper: a worker_init_fn that opens a file for the data set
    # (info.dataset.h5 = h5py.File(...)) or reads its attributes reaches the data set given, past fit()'s Subset.
    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "own") or name.startswith("__"):  # not set yet (unpickled in a spawned
            raise AttributeError(name)  # worker); a Subset's __getitems__ would take (epoch, index) keys
        return getattr(self.own, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.own, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    @staticmethod
    def _seed(*words: int) -> None:
        mixed = _mixed(*words)
        torch.manual_seed(mixed)
        random.seed(mixed)
        np.random.seed([mixed & 0xFFFFFFFF, mixed >> 32])

    @staticmethod
    def _pair(key: int | tuple[int, int]) -> tuple[int, int]:
        """(epoch, index) of a key: an evaluation's plain index is epoch -1."""
        return key if isinstance(key, tuple) else (-1, key)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        epoch, index = self._pair(key)
        self._seed(self.seed, epoch, index)
        return self.dataset[index]

    def _batch(self, keys: list[int | tuple[int, int]]) -> Any:
        """A batch through the data set's own batched fetch, kept (one Arrow slice, not a read per sample), the
        RNGs seeded once from its first key and size: the same batch of the same epoch draws alike, so a resume
        at the same batch size is exact (a sample's draws then depend on its batch, not on it alone)."""
        pairs = [self._pair(key) for key in keys]
        self._seed(self.seed, *pairs[0], len(pairs))
        return self.dataset.__getitems__([index for _, index in pairs])


def _read_by(dataset: Any, seed: int, num_workers: int) -> Any:
    """What a DataLoader of ``num_workers`` reads: in workers SeededSamples, in this process the data set."""
    return SeededSamples(dataset, seed) if num_workers > 0 else dataset


class Keyed(Sampler[tuple[int, int]]):
    """A ShardedSampler's indices as (epoch, index) keys for SeededSamples."""

    def __init__(self, sampler: ShardedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def stop_workers(loader: DataLoader | None) -> None:
    """Shut a DataLoader's persistent workers down now, while its queues are whole (a later iteration starts new
    ones). Left to the garbage collector (a finished fit()'s loaders sit in reference cycles), the shutdown ran
    after the queues were finalized, so no worker heard it and each waited out torch's 5 s join before it was
    terminated: the next gc.collect() after a fit() with data.num_workers=2 took 20 s."""
    running = getattr(loader, "_iterator", None)
    if running is not None and callable(getattr(running, "_shutdown_workers", None)):
        running._shutdown_workers()
        loader._iterator = None  # type: ignore[union-attr]


def collect_before_fork(loader: DataLoader) -> None:
    """Collect this process's garbage before a DataLoader forks its workers (once: they persist). A forked
    worker inherits every unreachable object still waiting for the cycle collector, and when its own collector
    runs it finalizes them there: one that owns a thread or a socket (a dropped TCPStore, a process group)
    crashes the worker (segfault or abort, "DataLoader worker exited unexpectedly"). Collected here, they are
    finalized once, in the process that made them."""
    if loader.num_workers > 0 and getattr(loader, "_iterator", None) is None:
        gc.collect()


class ShardedLoader:
    """Training batches for one rank, epoch after epoch, with a state_dict of plain ints: epoch, cursor, the
    current epoch's end, and the data set size and step size it was saved with (to resume at another world).

    One optimizer step consumes ``batch_size * world * accum`` permutation positions; ``steps_per_epoch`` of
    them fit in an epoch (the tail rule above).
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world: int, accum: int, seed: int,
                 shuffle: bool = True, num_workers: int = 0, pin_memory: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        self.samples = len(dataset)  # type: ignore[arg-type]
        size = train_size(dataset) or 0  # positions of an epoch: a weighted set's draws
        self.size = size
        self.accum = accum
        self.step_samples = batch_size * world * accum
        self.steps_per_epoch = size // self.step_samples
        assert self.steps_per_epoch >= 1, "validated by the trainer before building the loader"
        self.micro_samples = batch_size * world
        self.batch_size = batch_size
        self.seed = seed
        self.sampler = ShardedSampler(size, rank=rank, world=world, seed=seed, shuffle=shuffle,
                                      usable=self.steps_per_epoch * self.step_samples,
                                      weighted=dataset if isinstance(dataset, Weighted) else None)
        # The loader's own generator: starting an epoch's iterator draws worker seeds from it, never from the
        # global RNG, so resuming mid-epoch (a new iterator) leaves dropout and everything else unchanged.
        self.generator = torch.Generator()
        # In workers, each sample's random draws are a function of the run's seed, its epoch and its index (not of
        # the worker that drew it, nor of when): a resume mid-epoch augments as the straight run does. In this
        # process they come from the global RNGs, which checkpoints hold.
        keyed = num_workers > 0
        self.loader = DataLoader(_read_by(dataset, seed, num_workers), batch_size=batch_size,
                                 sampler=Keyed(self.sampler) if keyed else self.sampler, drop_last=True,
                                 num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn or collate,
                                 persistent_workers=num_workers > 0, generator=self.generator,
                                 worker_init_fn=worker_init_fn)
        self.track_indices = False  # set to make last_indices available (verify-resume's traces)
        self.last_indices: list[int] = []
        self._whole: DataLoader | None = None  # whole_pass()'s loader, made once (its workers kept)
        self._whole_batches: list[list[int]] | None = None  # its batches, which never change

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def epochs_done(self) -> float:
        """Epochs run, the current one's part included: whole epochs and the share of this one's positions
        consumed (a resume at another step size cuts the rest of its epoch into other steps: sampler.end)."""
        s = self.sampler
        return s.epoch + s.cursor / s.end if s.end else float(s.epoch)

    def __iter__(self) -> Iterator[Any]:
        """Micro-batches forever; the cursor counts a batch as consumed once it is handed out."""
        s = self.sampler
        collect_before_fork(self.loader)
        while True:
            self.generator.manual_seed(self.seed * 1_000_003 + s.epoch)
            perm = s.order(s.epoch) if self.track_indices else None
            for batch in self.loader:
                if perm is not None:
                    self.last_indices = perm[s.cursor + s.rank : s.cursor + self.micro_samples : s.world].tolist()
                s.cursor += self.micro_samples
                yield batch
            s.epoch += 1
            s.cursor = 0
            s.end = s.usable

    def epoch_batches(self) -> Iterator[Any]:
        """The rest of the current epoch's micro-batches, then the next epoch begins (the cursor counts a
        batch as consumed once it is handed out, as __iter__ does): one pass for a loop written as
        ``for epoch in ...: for batch in loader: ...``."""
        s = self.sampler
        remaining = (s.end - s.cursor) // self.micro_samples
        if remaining:
            batches = iter(self)
            for _ in range(remaining):
                yield next(batches)
        s.epoch += 1
        s.cursor = 0
        s.end = s.usable

    def stop_workers(self) -> None:
        """Its loaders' worker processes, shut down (stop_workers)."""
        stop_workers(self.loader)
        stop_workers(self._whole)

    def whole_pass(self) -> Iterator[Any]:
        """Every sample of the data set once over the ranks, this rank's share in whole_pass_batches()' batches:
        an evaluation pass (session.evaluating()), which neither drops the tail nor moves the training position.
        Its own generator, so it draws nothing from the global RNG; its workers stay for the next pass."""
        if self._whole is None:
            own = self.loader
            self._whole = DataLoader(own.dataset, batch_sampler=self.whole_pass_batches(),
                                     num_workers=own.num_workers, pin_memory=own.pin_memory,
                                     collate_fn=own.collate_fn, persistent_workers=own.num_workers > 0,
                                     worker_init_fn=own.worker_init_fn,
                                     generator=torch.Generator().manual_seed(self.seed))
            collect_before_fork(self._whole)
        return iter(self._whole)

    def whole_pass_batches(self) -> list[list[int]]:
        """This rank's batches of a whole pass: the first epoch's order (the data set's own without shuffle) cut
        into k = ceil(size / (batch_size x world)) chunks as even as can be, rank r taking positions r, r + W, ...
        of each. Every rank gets k batches of at most batch_size (a collective forward, FSDP's, runs as often on
        each), together every sample once, none padded; the last batches are smaller rather than dropped. Only
        a data set of fewer than world samples per chunk leaves a rank a batch short (an empty one is skipped)."""
        if self._whole_batches is not None:
            return self._whole_batches
        s, size = self.sampler, self.samples  # every sample once: a weighted set's too, unweighted
        order = epoch_permutation(size, s.seed, 0, s.shuffle).tolist()
        chunks = -(-size // self.micro_samples)
        even, extra = divmod(size, chunks)
        batches, start = [], 0
        for i in range(chunks):
            end = start + even + (i < extra)
            mine = order[start + s.rank : end : s.world]
            if mine:
                batches.append(mine)
            start = end
        self._whole_batches = batches
        return batches

    def state_dict(self) -> dict[str, int]:
        s = self.sampler
        return {"epoch": s.epoch, "cursor": s.cursor, "end": s.end, "size": self.size,
                "step_samples": self.step_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was saved, at this loader's world size, batch size and accumulation."""
        size = int(state.get("size", self.size))
        if size != self.size:
            raise UserError(f"data: the checkpoint's loader state is for a training set of {size} samples, "
                            f"but this one has {self.size}; fix: resume with the same training data, or start "
                            "a new run directory")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        assert 0 <= cursor <= self.size, f"loader cursor {cursor} outside [0, {self.size}]"
        end = int(state.get("end", -1))
        same_steps = int(state.get("step_samples", -1)) == self.step_samples
        if not (same_steps and cursor <= end <= self.size and (end - cursor) % self.micro_samples == 0):
            # Another step size (or an older state): cut the rest of the epoch into whole steps of this one.
            end = cursor + (self.size - cursor) // self.step_samples * self.step_samples
        self.sampler.epoch, self.sampler.cursor, self.sampler.end = epoch, cursor, end


def eval_indices(size: int, *, batch_size: int, world: int, max_batches: int = 0) -> list[int]:
    """The held-out samples one evaluation covers, before sharding: all of them, or with ``max_batches`` > 0
    at most max_batches x batch_size x world, spread evenly over the split (sample floor(i x size / n)), so a
    bounded evaluation still sees every part of it (a text corpus's held-out files come in order)."""
    n = min(size, max_batches * batch_size * world) if max_batches else size
    return list(range(size)) if n == size else [i * size // n for i in range(n)]


def eval_loader(dataset: Dataset, *, batch_size: int, rank: int, world: int, num_workers: int = 0,
                pin_memory: bool = False, max_batches: int = 0,
                collate_fn: Callable[[list[Any]], Any] | None = None,
                worker_init_fn: Callable[[int], None] | None = None, seed: int = 0) -> DataLoader:
    """Rank r evaluates samples r, r + W, ... of eval_indices: every one exactly once across ranks, none
    padded. Its own generator: an evaluation draws nothing from the global RNG, so evaluating (or not) between
    two steps leaves training, and a resume, exactly as they were. Its worker processes, when it has any, stay
    for the next evaluation (started once, not at every one), each sample's draws seeded from ``seed`` and its
    index (SeededSamples: the same at every evaluation), the worker_init_fn reaching the data set given."""
    chosen = eval_indices(len(dataset), batch_size=batch_size, world=world,  # type: ignore[arg-type]
                          max_batches=max_batches)
    loader = DataLoader(_read_by(dataset, seed, num_workers), batch_size=batch_size,
                        sampler=chosen[rank::world], num_workers=num_workers, pin_memory=pin_memory,
                        collate_fn=collate_fn or collate, persistent_workers=num_workers > 0,
                        generator=torch.Generator().manual_seed(0), worker_init_fn=worker_init_fn)
    collect_before_fork(loader)  # made at the first evaluation, which iterates it at once
    return loader


def train_size(dataset: Any) -> int | None:
    """The samples of a training set, None for a stream (an IterableDataset: its length is unknown)."""
    if isinstance(dataset, Weighted):
        return dataset.num_samples  # an epoch is the samples it draws
    return None if isinstance(dataset, IterableDataset) else len(dataset)


class StreamLoader:
    """Training batches for one rank from a stream (an IterableDataset: no len(), no [i]), with
    ShardedLoader's interface and its mapping of positions to ranks.

    Each pass over the stream (an epoch) is read in the stream's own order, one optimizer step's items at a time
    (``batch_size x world x accum``): micro-step k covers the pass's positions [k b W, (k + 1) b W) and rank r
    takes positions r, r + W, ... of them, as ShardedLoader does with a permutation. A step the stream cannot
    fill ends the pass (the tail rule), on every rank alike with no collective, because every rank reads every
    item and keeps its own (what Hugging Face's split_dataset_by_node does for a stream that is not sharded
    into files: W times the reading, none of it decoded twice by one rank). A dataset with ``set_epoch`` (a
    shuffled datasets.IterableDataset) is told each pass's number before it starts; the order is the
    stream's: scaletrain cannot shuffle what it cannot index.

    The state is the pass and its global position (items consumed), so a resume, at this or another world size
    or batch, reads the pass again from its start, skips what was consumed, and continues with the next unseen
    item: exact for a stream that gives the same items in the same order each time it is iterated.
    Batches are made in this process (data.num_workers does not apply: workers would each read the stream).
    """

    steps_per_epoch = 0  # unknown: a stream's length is found only by reading it to the end

    def __init__(self, dataset: Any, *, batch_size: int, rank: int, world: int, accum: int,
                 pin_memory: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.collate = collate_fn or collate
        self.accum, self.pin_memory = accum, pin_memory
        self.micro_samples = batch_size * world
        self.step_samples = self.micro_samples * accum
        self.epoch, self.cursor = 0, 0  # the pass, and the items of it consumed (all ranks together)
        self.track_indices = False  # set to make last_indices available (verify-resume's traces)
        self.last_indices: list[int] = []
        self._items: Iterator[Any] | None = None  # the current pass, read up to the cursor and the pending step
        self._pending: list[Any] = []  # this rank's micro-batches of the step read, not yet handed out

    def _open_pass(self) -> Iterator[Any]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        items = iter(self.dataset)
        skipped = sum(1 for _ in itertools.islice(items, self.cursor))  # a resume: skip what was consumed
        if skipped < self.cursor:
            raise UserError(f"data: the training stream ended after {skipped} items of the {self.cursor} the "
                            "checkpoint had consumed in this pass; fix: resume with the same stream (in the same "
                            "order), or start a new run directory")
        return items

    def _next_step(self) -> bool:
        """Read the next step's items of the pass into this rank's micro-batches; False at the pass's end."""
        if self._items is None:
            self._items = self._open_pass()
        chunk = list(itertools.islice(self._items, self.step_samples))
        if len(chunk) < self.step_samples:  # the tail rule: only whole steps
            self._items = None
            return False
        for m in range(self.accum):
            mine = chunk[m * self.micro_samples + self.rank:(m + 1) * self.micro_samples:self.world]
            batch = self.collate(mine)
            # in pinned memory, the copy to the GPU is asynchronous (as a DataLoader's pin_memory=True gives)
            self._pending.append(map_tensors(batch, torch.Tensor.pin_memory) if self.pin_memory else batch)
        return True

    def _next_batch(self) -> Any | None:
        """This rank's next micro-batch of the pass, None at its end (then the next pass begins)."""
        if not self._pending and not self._next_step():
            self.epoch, self.cursor = self.epoch + 1, 0
            return None
        if self.track_indices:
            start = self.cursor + self.rank
            self.last_indices = list(range(start, self.cursor + self.micro_samples, self.world))
        self.cursor += self.micro_samples
        return self._pending.pop(0)

    def __iter__(self) -> Iterator[Any]:
        """Micro-batches forever, pass after pass."""
        empty = 0
        while True:
            batch = self._next_batch()
            if batch is not None:
                empty = 0
                yield batch
                continue
            empty += 1
            if empty > 1:
                raise UserError(f"data: the training stream has fewer than {self.step_samples} items (one step: "
                                f"batch_size x world x accumulation); fix: a smaller --data.batch_size or more data")

    def epoch_batches(self) -> Iterator[Any]:
        """The rest of the current pass's micro-batches; then the next pass begins."""
        while (batch := self._next_batch()) is not None:
            yield batch

    def whole_pass(self, *, pad: bool = False) -> Iterator[Any]:
        """Every item of the stream once over the ranks, in batches of at most batch_size: an evaluation pass
        (session.evaluating()), read from the stream's start (told pass 0 if it has set_epoch), which neither drops
        the tail nor moves this loader's position. Each chunk of batch_size x world items gives rank r positions
        r, r + W, ...; a chunk is read ahead, so that at the stream's end the last full chunk and the tail are
        split into two even ones: every rank gets as many batches (a collective forward, FSDP's, runs as often on
        each), the last two about half full, rather than the tail going to some ranks only. Only a batch size of
        1, or a stream shorter than one chunk, can leave a rank a batch short: an empty one is skipped, or with
        ``pad`` given as None (so that every rank gets as many items)."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(0)
        items, chunk = iter(self.dataset), self.micro_samples
        ahead = list(itertools.islice(items, chunk))
        while ahead:
            after = list(itertools.islice(items, chunk))
            if 0 < len(after) < chunk:  # the tail: it and the chunk before, halved
                both = ahead + after
                half = -(-len(both) // 2)
                parts, after = [both[:half], both[half:]], []
            else:
                parts = [ahead]
            for part in parts:
                if mine := part[self.rank::self.world]:
                    batch = self.collate(mine)
                    yield map_tensors(batch, torch.Tensor.pin_memory) if self.pin_memory else batch
                elif pad:
                    yield None
            ahead = after

    def state_dict(self) -> dict[str, int]:
        # Saved between steps: the micro-batches of a step read ahead are all handed out by then.
        return {"epoch": self.epoch, "cursor": self.cursor, "step_samples": self.step_samples, "stream": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was saved, at this loader's world size, batch size and accumulation."""
        if "stream" not in state:
            raise UserError("data: the checkpoint's loader read a data set by index, this run a stream; fix: "
                            "resume with the same training data, or start a new run directory")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._items, self._pending = None, []
