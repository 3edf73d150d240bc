"""Training data: the data section's token store (``train.store.open_store``: plan -> find or
build -> open), read lazily through grain.

The train split is a ``grain.MapDataset`` over window indices (``seq_len + 1`` tokens each):
seeded global shuffle as a lazy index permutation (a new one each epoch), repeat, batch, then a
map that reads the batch's windows from the memory-mapped shards, only the rows this process's
devices hold (in a multi-host run each process reads only its own rows). grain runs that map in
a few threads ahead of the loop, so random reads of cold pages overlap. Memory and start-up do
not grow with the corpus. The iterator's state is a few integers, checkpointed with the train
state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import grain
import numpy as np

from train import store as token_store
from train.config import DataSection
from train.errors import UserError

READ_THREADS = 8  # batches read concurrently ahead of the loop
PREFETCH_BATCHES = 16  # batches held ready (bounded memory: 16 x batch x window x 4 bytes)


def window_batches(n_windows: int, batch_size: int, seed: int):
    """A grain ``MapDataset`` of ``(batch_size,)`` int64 window indices: a seeded permutation
    per epoch (lazy), repeating forever."""
    ds = grain.MapDataset.range(n_windows).shuffle(seed=seed).repeat()
    return ds.batch(batch_size, drop_remainder=True)


@dataclass(frozen=True)
class ReadRows:
    """Maps a batch of window indices to the token windows of ``rows`` of it (all when None)."""

    stream: token_store.TokenStream
    window: int
    rows: np.ndarray | None = None

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return self.stream.windows(indices if self.rows is None else indices[self.rows], self.window)


@dataclass
class Data:
    store: token_store.TokenStore
    window: int  # seq_len + 1

    @property
    def vocab_size(self) -> int:
        return self.store.tokenizer["vocab_size"]

    def n_windows(self, split: str) -> int:
        return self.store.splits[split].tokens // self.window

    def train_iterator(self, batch_size: int, seed: int, rows: np.ndarray | None = None):
        """Train batches, ``(batch_size, window)`` int32, or only ``rows`` of each (a grain
        iterator with ``get_state``/``set_state``; the same indices on every process)."""
        ds = window_batches(self.n_windows("train"), batch_size, seed)
        ds = ds.map(ReadRows(self.store.splits["train"], self.window, rows))
        options = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=PREFETCH_BATCHES)
        return iter(ds.to_iter_dataset(read_options=options))

    def train_indices(self, batch_size: int, seed: int):
        """The window indices of the batches ``train_iterator`` yields, in the same order."""
        return iter(window_batches(self.n_windows("train"), batch_size, seed))

    def read_train(self, indices: np.ndarray) -> np.ndarray:
        """The token windows of ``indices``: ``(len(indices), window)`` int32."""
        return self.store.splits["train"].windows(indices, self.window)

    def val_batches(self, batch_size: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """What evaluation reads: the first ``n`` batches of the validation windows, each window
        once. Each batch is ``(windows (batch_size, window) int32, weights (batch_size,) float32)``;
        when the split has fewer than ``n * batch_size`` windows there are fewer batches, the last
        filled up with windows of weight 0 (every batch keeps the shape the step is compiled for)."""
        count = min(n * batch_size, self.n_windows("validation"))
        batches = -(-count // batch_size)
        idx = np.arange(batches * batch_size)
        rows = self.store.splits["validation"].windows(idx % count, self.window)
        weights = (idx < count).astype(np.float32)
        return [
            (rows[i * batch_size : (i + 1) * batch_size], weights[i * batch_size : (i + 1) * batch_size])
            for i in range(batches)
        ]

    def identity(self) -> str:
        """The store's content: a hash of its tokenizer's identity (not its file's name) and its
        shards' (both splits, in order). Equal for a store built again from the same inputs,
        wherever it and its tokenizer lie; a resume that finds another refuses (the restored
        iterator would index other windows)."""
        return self._hash(token_store.tokenizer_key(self.store.tokenizer))

    def identities(self) -> tuple[str, str]:
        """``identity()``, and the hash checkpoints made before it left out the tokenizer's name
        (those resume too)."""
        return self.identity(), self._hash(self.store.manifest["tokenizer"])

    def _hash(self, tokenizer: dict) -> str:
        m = self.store.manifest
        shards = {s: [sh["sha256"] for sh in m["splits"][s]["shards"]] for s in token_store.SPLITS}
        content = {"tokenizer": tokenizer, "shards": shards}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def summary(self) -> dict:
        m = self.store.manifest
        validation = [sh["sha256"] for sh in m["splits"]["validation"]["shards"]]
        return {
            "store": str(self.store.directory),
            "tokenizer": m["tokenizer"],
            # what evaluation reads: runs compare only when this is equal
            "validation_sha256": hashlib.sha256(json.dumps(validation).encode()).hexdigest(),
            "documents": {s: m["splits"][s]["documents"] for s in token_store.SPLITS},
            "tokens": {s: m["splits"][s]["tokens"] for s in token_store.SPLITS},
            "skipped": m["skipped"],
        }


def build_data(cfg: DataSection, seq_len: int, quiet: bool = False) -> Data:
    """The data of a data section: its token store, found or built, in windows of ``seq_len + 1``
    tokens; a split shorter than one window is refused."""
    data = Data(token_store.open_store(cfg, quiet), seq_len + 1)
    skipped = token_store.skipped_records(data.store.manifest)
    for split, hint in (
        ("train", "add documents (data.paths, data.max_documents) or lower train.seq_len"),
        (
            "validation",
            "give it more documents (data.validation_fraction, data.validation_paths or, for "
            "tfds, data.max_documents) or lower train.seq_len",
        ),
    ):
        if data.n_windows(split) == 0:
            raise UserError(
                f"the {split} split has {data.store.splits[split].tokens} tokens, fewer than one "
                f"window of {data.window} (train.seq_len + 1): {hint}{skipped}"
            )
    return data


def describe(data: Data) -> str:
    """One line for the start-up banner."""
    s = data.summary()
    return (
        f"data: {s['tokens']['train']:,} train / {s['tokens']['validation']:,} validation tokens "
        f"from {s['store']}{token_store.skipped_records(data.store.manifest)}"
    )
