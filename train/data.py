"""Data: sources -> tokenize -> pack (EOS-separated) into ``seq_len + 1`` windows -> a grain
pipeline (seeded shuffle, repeat, batch) whose iterator state is checkpointed.

Documents are tokenized and packed in memory up front (fine for the sample corpora and shards a
single run reads; for a full C4 use TFDS with ``max_documents``), then grain does the rest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grain
import numpy as np

from train.config import DataSection
from train.errors import UserError


class ByteTokenizer:
    """UTF-8 bytes: ids 0-255, EOS 256. Needs no download."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece model file (e.g. T5's ``spiece.model``: 32000 pieces, EOS 1)."""

    def __init__(self, path: str):
        try:
            import sentencepiece as spm
        except ImportError:
            raise UserError(
                "data.tokenizer names a sentencepiece model but sentencepiece is not "
                "installed: pip install 'moara-jax[sentencepiece]'"
            ) from None
        if not pathlib.Path(path).is_file():
            raise UserError(f"data.tokenizer: sentencepiece model not found: {path}")
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise UserError(f"data.tokenizer: {path} defines no EOS piece")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))


def make_tokenizer(spec: str):
    return ByteTokenizer() if spec == "bytes" else SentencePieceTokenizer(spec)


@dataclass
class Counts:
    documents: int = 0
    skipped: dict = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def builtin_documents() -> list[str]:
    """English documentation text shipped inside CPython (``pydoc_data.topics``); offline."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _lines(path: pathlib.Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            yield from f
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read data file {path}: {e}") from None


def file_documents(paths: Iterable[str], counts: Counts) -> Iterator[str]:
    """Documents from ``.txt`` (one per file) and ``.jsonl``/``.jsonl.gz``/``.json.gz`` (one JSON
    object per line with a ``text`` field). Bad records are skipped and counted."""
    for p in paths:
        path = pathlib.Path(p)
        if not path.is_file():
            raise UserError(f"data file not found: {path}")
        name = path.name
        if name.endswith(".txt"):
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                counts.skip("non_utf8")
                continue
            if text.strip():
                yield text
            else:
                counts.skip("empty_text")
            continue
        if not (
            name.endswith(".jsonl")
            or name.endswith(".jsonl.gz")
            or name.endswith(".json.gz")
            or name.endswith(".json")
        ):
            raise UserError(f"unsupported data file type: {path} (use .txt, .jsonl, .jsonl.gz, .json.gz)")
        for raw in _lines(path):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                counts.skip("non_utf8")
                continue
            except json.JSONDecodeError:
                counts.skip("broken_json")
                continue
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                counts.skip("missing_text")
            elif not text.strip():
                counts.skip("empty_text")
            else:
                yield text


def tfds_documents(name: str, split: str, limit: int | None) -> Iterator[str]:
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise UserError(
            "data.source is tfds but tensorflow-datasets is not installed: pip install 'moara-jax[tfds]'"
        ) from None
    try:
        ds = tfds.load(name, split=split, download=False)
    except Exception as e:  # noqa: BLE001 - TFDS raises many types for "not prepared"
        raise UserError(
            f"TFDS dataset {name!r} ({split}) is not available: {str(e).splitlines()[0]}"
        ) from None
    for i, ex in enumerate(tfds.as_numpy(ds)):
        if limit is not None and i >= limit:
            return
        yield ex["text"].decode("utf-8", errors="replace")


def _is_validation(text: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "little")
    return h % 1_000_000 < fraction * 1_000_000


def load_splits(cfg: DataSection) -> tuple[list[str], list[str], Counts]:
    """Train and validation documents. Validation: ``data.validation_paths`` if given, else a
    hash-based held-out fraction of the documents (at least one document)."""
    counts = Counts()
    if cfg.source == "builtin":
        docs = builtin_documents()
    elif cfg.source == "files":
        docs = list(file_documents(cfg.paths, counts))
    else:
        docs = list(tfds_documents(cfg.tfds_name, "train", cfg.max_documents))
    if cfg.max_documents is not None:
        docs = docs[: cfg.max_documents]
    if not docs:
        raise UserError("no usable documents in the data source")
    if cfg.validation_paths:
        val = list(file_documents(cfg.validation_paths, counts))
        train = docs
    elif cfg.source == "tfds":
        train, val = docs, list(tfds_documents(cfg.tfds_name, "validation", cfg.max_documents or 1000))
    else:
        val = [d for d in docs if _is_validation(d, cfg.validation_fraction)]
        train = [d for d in docs if not _is_validation(d, cfg.validation_fraction)]
        if not val:
            val, train = train[-1:], train[:-1]
    if not train or not val:
        raise UserError("the data source needs at least two documents (train and validation)")
    counts.documents = len(train) + len(val)
    return train, val, counts


def pack(docs: Iterable[str], tokenizer, window: int, split: str = "train") -> np.ndarray:
    """Concatenates ``doc + EOS`` token streams and cuts them into ``(n, window)`` rows.

    ``split`` names the split in the error raised when it holds less than one window."""
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(tokenizer.eos_id)
    n = len(ids) // window
    if n == 0:
        hint = (
            "give it more documents (data.validation_fraction, data.validation_paths or, for "
            "tfds, data.max_documents) or lower train.seq_len"
            if split == "validation"
            else "add documents (data.paths, data.max_documents) or lower train.seq_len"
        )
        raise UserError(
            f"the {split} split has {len(ids)} tokens, fewer than one window of {window} "
            f"(train.seq_len + 1): {hint}"
        )
    return np.asarray(ids[: n * window], np.int32).reshape(n, window)


def batches(windows: np.ndarray, batch_size: int, seed: int, shuffle: bool = True):
    """A grain ``IterDataset`` of ``(batch_size, window)`` int32 batches, repeating forever."""
    ds = grain.MapDataset.source(windows)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat().batch(batch_size, drop_remainder=True).to_iter_dataset()


@dataclass
class Data:
    tokenizer: object
    train_windows: np.ndarray
    val_windows: np.ndarray
    counts: Counts

    def train_iterator(self, batch_size: int, seed: int):
        if len(self.train_windows) < 1:
            raise UserError("no training windows")
        return iter(batches(self.train_windows, batch_size, seed))

    def val_batches(self, batch_size: int, n: int) -> list[np.ndarray]:
        """The first ``n`` validation batches (fixed; windows wrap around if too few)."""
        idx = np.arange(n * batch_size) % len(self.val_windows)
        return [self.val_windows[idx[i * batch_size : (i + 1) * batch_size]] for i in range(n)]


def build_data(cfg: DataSection, seq_len: int) -> Data:
    tokenizer = make_tokenizer(cfg.tokenizer)
    train, val, counts = load_splits(cfg)
    return Data(
        tokenizer,
        pack(train, tokenizer, seq_len + 1),
        pack(val, tokenizer, seq_len + 1, split="validation"),
        counts,
    )
