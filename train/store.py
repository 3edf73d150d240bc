"""The token store: a corpus tokenized once, in parallel, into flat token shards that training
memory-maps.

Layout of a store directory::

    manifest.json                 written last: its presence means the store is complete
    shards/train-00000.bin        the train tokens of input piece 0 (uint16, or uint32 for a
    shards/validation-00000.bin   vocabulary over 65536), documents separated by EOS
    shards/00000.json             what piece 0 read, wrote and skipped
    .lock                         held by the one process that builds the store

The input is cut into *pieces* (a file, a byte range of a large JSON-lines file, a record range
of a TFDS split); each worker tokenizes whole pieces. Every shard is written under a ``.tmp``
name and renamed once complete, and a piece's ``.json`` is renamed after its shards, so an
interrupted build (SIGTERM, SIGKILL, a full disk) leaves no piece that looks complete, and the
same command run again continues from the completed pieces and ends with the same bytes as an
uninterrupted build: a piece's output depends on the piece alone, never on the worker count or
the order in which workers finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from train import sources
from train.errors import UserError

FORMAT = "moara-jax token store"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
PIECE_BYTES = 64 << 20  # a plain JSON-lines file is cut into pieces of about this size
PIECE_RECORDS = 100_000  # a TFDS split is cut into pieces of this many records
TFDS_VALIDATION_DOCUMENTS = 1000  # the validation records taken from a TFDS dataset by default


class Interrupted(Exception):
    """SIGTERM/SIGINT during a build: completed pieces are kept, running ones discarded."""


@dataclass(frozen=True)
class Piece:
    """One piece of input, tokenized by one worker into one shard per split it feeds.

    ``role``: ``mixed`` (documents hash-split into train and validation by
    ``data.validation_fraction``), ``train`` or ``validation``."""

    index: int
    kind: str  # builtin | file | tfds
    role: str
    path: str = ""  # the file, or the TFDS dataset's name
    split: str = ""  # the TFDS split
    start: int = 0  # byte offset (file) or record index (tfds)
    stop: int | None = None
    work: int = 1  # input bytes or records, for the progress line


@dataclass(frozen=True)
class Plan:
    """What a store is built from: its pieces, tokenizer and the settings its content depends on."""

    pieces: tuple[Piece, ...]
    tokenizer: str  # data.tokenizer
    tokenizer_identity: dict
    source: dict  # portable description: kind, input names and sizes, split settings
    fraction: float
    max_documents: int | None  # over the pieces that read train text, in order (files, builtin)
    key: str  # cache key: the source with local paths and modification times, the tokenizer

    @property
    def dtype(self) -> str:
        return "uint16" if self.tokenizer_identity["vocab_size"] <= 1 << 16 else "uint32"


# ------------------------------------------------------------------------------------- planning


def plan(cfg) -> Plan:
    """The pieces and identity of the store for a ``DataSection`` (``source`` builtin, files or
    tfds). Cheap: it stats the input files, reads none of them."""
    tok = sources.make_tokenizer(cfg.tokenizer)
    identity = tok.identity()
    local: dict = {}
    if cfg.source == "builtin":
        text = "\0".join(sources.builtin_documents()).encode()
        source = {"kind": "builtin", "sha256": hashlib.sha256(text).hexdigest()}
        pieces = [Piece(0, "builtin", "mixed", work=len(text))]
    elif cfg.source == "files":
        paths, validation_paths = expand_paths(cfg.paths), expand_paths(cfg.validation_paths)
        pieces = _file_pieces(paths, "train" if validation_paths else "mixed", 0)
        pieces += _file_pieces(validation_paths, "validation", len(pieces))
        source = {
            "kind": "files",
            "inputs": _portable(paths),
            "validation_inputs": _portable(validation_paths),
        }
        local = {"stat": _stat(paths + validation_paths)}
    elif cfg.source == "tfds":
        n_train, version = sources.tfds_split_info(cfg.tfds_name, "train")
        n_val, _ = sources.tfds_split_info(cfg.tfds_name, "validation")
        n_train = min(n_train, cfg.max_documents or n_train)
        n_val = min(n_val, cfg.max_documents or TFDS_VALIDATION_DOCUMENTS)
        ranges = [
            (split, a, min(a + PIECE_RECORDS, n))
            for split, n in (("train", n_train), ("validation", n_val))
            for a in range(0, n, PIECE_RECORDS)
        ]
        pieces = [
            Piece(i, "tfds", split, cfg.tfds_name, split, a, b, b - a)
            for i, (split, a, b) in enumerate(ranges)
        ]
        source = {"kind": "tfds", "name": cfg.tfds_name, "version": version, "records": [n_train, n_val]}
    else:
        raise ValueError(f"no store plan for source {cfg.source!r}")
    if cfg.source != "tfds":
        source["max_documents"] = cfg.max_documents
    if source.get("validation_inputs") or cfg.source == "tfds":
        source["validation"] = "inputs"
    else:
        source["validation"] = f"fraction {cfg.validation_fraction}"
    key_text = json.dumps([VERSION, identity, source, local], sort_keys=True)
    return Plan(
        pieces=tuple(pieces),
        tokenizer=cfg.tokenizer,
        tokenizer_identity=identity,
        source=source,
        fraction=cfg.validation_fraction,
        max_documents=cfg.max_documents if cfg.source != "tfds" else None,
        key=f"{source['kind']}-{hashlib.sha256(key_text.encode()).hexdigest()[:20]}",
    )


def expand_paths(paths: list) -> list[str]:
    """``data.paths`` with globs (``*``, ``?``, ``[...]``) expanded in sorted order; a glob that
    matches nothing is an error."""
    out = []
    for p in paths:
        if any(c in str(p) for c in "*?["):
            matches = sorted(glob.glob(os.path.expanduser(str(p))))
            if not matches:
                raise UserError(f"data file pattern matches no file: {p}")
            out += matches
        else:
            out.append(os.path.expanduser(str(p)))
    return out


def _file_pieces(paths: list, role: str, first: int) -> list[Piece]:
    pieces = []
    for p in paths:
        path = pathlib.Path(p)
        sources.check_file(path)
        for start, stop in sources.line_ranges(path, PIECE_BYTES):
            end = path.stat().st_size if stop is None else stop
            pieces.append(
                Piece(first + len(pieces), "file", role, str(path.resolve()), "", start, stop, end - start)
            )
    return pieces


def _portable(paths: list) -> list:
    """Input files as ``[name, size]``: the same store is recognised on another machine."""
    return [[pathlib.Path(p).name, pathlib.Path(p).stat().st_size] for p in paths]


def _stat(paths: list) -> list:
    """Input files as ``[path, size, mtime]``: a changed file gets a new cache entry."""
    return [
        [str(pathlib.Path(p).resolve()), (st := pathlib.Path(p).stat()).st_size, st.st_mtime_ns]
        for p in paths
    ]


# -------------------------------------------------------------------------------------- workers

_worker: dict = {}


def _setup(tokenizer: str, dtype: str, fraction: float, counters) -> None:
    """What ``tokenize_piece`` reads, set once per process."""
    _worker.update(tok=sources.make_tokenizer(tokenizer), dtype=np.dtype(dtype), fraction=fraction)
    _worker["counters"] = counters


def _init_worker(*args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interruption
    _setup(*args)


class _ShardWriter:
    """Appends token arrays to ``NAME.tmp``, hashing as it goes; ``finish`` renames it to
    ``NAME`` once complete (or removes it when nothing was written)."""

    def __init__(self, path: pathlib.Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish
        self.sha = hashlib.sha256()
        self.tokens = 0

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(ids)

    def finish(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.tokens == 0:
            self.tmp.unlink()
            self.path.unlink(missing_ok=True)
            return {"tokens": 0}
        os.replace(self.tmp, self.path)
        return {"file": f"shards/{self.path.name}", "tokens": self.tokens, "sha256": self.sha.hexdigest()}


def _documents(piece: Piece, counts: sources.Counts):
    if piece.kind == "builtin":
        return iter(sources.builtin_documents())
    if piece.kind == "file":
        return sources.path_documents(pathlib.Path(piece.path), counts, piece.start, piece.stop)
    return sources.tfds_documents(piece.path, piece.split, piece.start, piece.stop)


def _meta_path(shards: pathlib.Path, piece: Piece) -> pathlib.Path:
    return shards / f"{piece.index:05d}.json"


def tokenize_piece(job: tuple) -> dict:
    """Tokenizes one piece into ``shards/{split}-NNNNN.bin`` and writes ``shards/NNNNN.json``
    last; returns that record. Runs in a worker (or in the parent with one worker)."""
    piece, shards, limit = job
    tok, dtype, counters = _worker["tok"], _worker["dtype"], _worker["counters"]
    splits = ("train", "validation") if piece.role == "mixed" else (piece.role,)
    writers = {s: _ShardWriter(shards / f"{s}-{piece.index:05d}.bin", dtype) for s in splits}
    documents = dict.fromkeys(splits, 0)
    counts = sources.Counts()
    eos = np.asarray([tok.eos_id])
    batch: list[str] = []
    read = 0
    exhausted = True

    def flush():
        parts: dict[str, list] = {s: [] for s in splits}  # one write per split and batch
        for text, ids in zip(batch, tok.encode_batch(batch), strict=True):
            split = piece.role
            if split == "mixed":
                split = "validation" if sources.is_validation(text, _worker["fraction"]) else "train"
            parts[split] += [ids, eos]
            documents[split] += 1
        tokens = 0
        for split, arrays in parts.items():
            if arrays:
                joined = np.concatenate(arrays)
                writers[split].write(joined)
                tokens += len(joined)
        counters.add(len(batch), tokens)
        batch.clear()

    try:
        for text in _documents(piece, counts):
            if limit is not None and read >= limit:
                exhausted = False
                break
            batch.append(text)
            read += 1
            if len(batch) == 256:
                flush()
        flush()
        shards_out = {s: w.finish() for s, w in writers.items()}
    finally:
        for w in writers.values():
            if not w.file.closed:
                w.file.close()
                w.tmp.unlink(missing_ok=True)
    record = {
        "piece": dataclasses.asdict(piece),
        "limit": limit,
        "exhausted": exhausted,
        "documents": documents,
        "shards": shards_out,
        "skipped": dict(sorted(counts.skipped.items())),
    }
    if piece.kind == "file" and piece.start == 0:
        record["input_sha256"] = sources.file_sha256(pathlib.Path(piece.path))
    _atomic_write(_meta_path(shards, piece), json.dumps(record, sort_keys=True, indent=1) + "\n")
    counters.work(piece.work)
    return record


class _Counters:
    """Documents, tokens and input work done, shared by the workers with the parent."""

    def __init__(self, ctx):
        self.docs, self.toks, self.done = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)

    def add(self, docs: int, tokens: int) -> None:
        for counter, n in ((self.docs, docs), (self.toks, tokens)):
            with counter.get_lock():
                counter.value += n

    def work(self, n: int) -> None:
        with self.done.get_lock():
            self.done.value += n


# ---------------------------------------------------------------------------------------- build


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cache_root(cache_dir: str | None) -> pathlib.Path:
    """``data.cache_dir``, else ``$MOARA_JAX_CACHE``, else ``$XDG_CACHE_HOME/moara-jax``
    (``~/.cache/moara-jax``), each with a ``stores/`` folder."""
    root = cache_dir or os.environ.get("MOARA_JAX_CACHE")
    if not root:
        root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "moara-jax"
    return pathlib.Path(root).expanduser() / "stores"


def build(directory: pathlib.Path, p: Plan, workers: int | None = None, quiet: bool = False) -> dict:
    """Builds the store (or finishes an interrupted build) and returns its manifest. One process
    builds a directory at a time; another waits for it and then reads its manifest."""
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".lock", "a+")  # noqa: SIM115 - closed below
    except OSError as e:
        raise UserError(f"cannot create the token store {directory}: {e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / MANIFEST).is_file():
            return read_manifest(directory)
        shards = directory / "shards"
        shards.mkdir(exist_ok=True)
        try:
            _remove_partial(shards)  # left by a build that was killed
            with _interrupts_raise():
                records = _run(p, shards, workers or default_workers(), quiet)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise UserError(
                    f"no space left on the device of the token store {directory}; free some and run "
                    "the same command again (completed shards are kept)"
                ) from None
            raise
        finally:
            _remove_partial(shards)  # of workers stopped mid-piece
        manifest = _manifest(p, records)
        _atomic_write(directory / MANIFEST, json.dumps(manifest, sort_keys=True, indent=1) + "\n")
        return manifest


def _remove_partial(shards: pathlib.Path) -> None:
    for partial in shards.glob("*.tmp"):
        partial.unlink(missing_ok=True)


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _interrupts_raise():
    """SIGTERM/SIGINT raise ``Interrupted`` in the building process (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _reusable(record: dict | None, piece: Piece, limit: int | None, shards: pathlib.Path) -> bool:
    if record is None or record["piece"] != json.loads(json.dumps(dataclasses.asdict(piece))):
        return False
    read = sum(record["documents"].values())
    if record["limit"] != limit and not (record["exhausted"] and (limit is None or read < limit)):
        return False
    return all((shards.parent / s["file"]).is_file() for s in record["shards"].values() if s["tokens"])


def _load_record(shards: pathlib.Path, piece: Piece) -> dict | None:
    path = _meta_path(shards, piece)
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:  # torn by a crash of the file system itself: redo the piece
        return None


def _run(p: Plan, shards: pathlib.Path, workers: int, quiet: bool) -> list[dict]:
    """Tokenizes every piece not already complete; with ``max_documents``, train pieces in order
    until that many documents are read (the piece that crosses the limit is cut at it)."""
    limit = p.max_documents
    records: dict[int, dict] = {}
    todo = []
    for piece in p.pieces:
        record = _load_record(shards, piece)
        if _reusable(record, piece, limit, shards):
            records[piece.index] = record
        else:
            todo.append(piece)
    # Validation pieces first: a limit stops the train pieces early, never them.
    todo.sort(key=lambda q: (q.role != "validation", q.index))
    ctx = mp.get_context("spawn")
    counters = _Counters(ctx)
    initargs = (p.tokenizer, p.dtype, p.fraction, counters)
    progress = _Progress(p, counters, records, quiet)
    jobs = [(q, shards, limit) for q in todo]
    pool = None
    _setup(*initargs)  # the parent tokenizes too: with one worker, and the piece a limit cuts
    if max(1, min(workers, len(todo))) == 1:
        results = map(tokenize_piece, jobs)
    else:
        pool = ctx.Pool(min(workers, len(todo)), initializer=_init_worker, initargs=initargs)
        results = pool.imap(tokenize_piece, jobs)
    try:
        for _ in jobs:
            while True:
                try:
                    record = results.next(timeout=0.5) if pool else next(results)
                    break
                except mp.TimeoutError:
                    progress.update()
            records[record["piece"]["index"]] = record
            progress.update()
            if limit is not None and _train_documents(p, records) >= limit:
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        progress.end()
    if limit is not None:
        _cut_at_limit(p, shards, records, limit)
    return [records[q.index] for q in p.pieces if q.index in records]


def _train_documents(p: Plan, records: dict) -> int:
    """Documents read by the leading run of completed train pieces (in input order)."""
    read = 0
    for q in p.pieces:
        if q.role == "validation":
            continue
        if q.index not in records:
            break
        read += sum(records[q.index]["documents"].values())
    return read


def _cut_at_limit(p: Plan, shards: pathlib.Path, records: dict, limit: int) -> None:
    """Keeps the first ``limit`` train documents: the piece that crosses the limit is tokenized
    again up to it, the pieces after it are dropped (with any output a stopped worker left)."""
    read = 0
    for q in (q for q in p.pieces if q.role != "validation"):
        if read >= limit:
            records.pop(q.index, None)
            for split in SPLITS:
                (shards / f"{split}-{q.index:05d}.bin").unlink(missing_ok=True)
            _meta_path(shards, q).unlink(missing_ok=True)
            continue
        n = sum(records[q.index]["documents"].values())
        if read + n > limit:
            records[q.index] = tokenize_piece((q, shards, limit - read))
            n = limit - read
        read += n


class _Progress:
    """``prepare: 1,234 docs  5.6M tokens  1.2M tokens/s  45%  ETA 0:01:23`` on stderr."""

    def __init__(self, p: Plan, counters: _Counters, done: dict, quiet: bool):
        self.counters, self.quiet = counters, quiet
        self.total = sum(q.work for q in p.pieces)
        self.base = sum(q.work for q in p.pieces if q.index in done)
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.printed = False

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.quiet or (not force and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        c = self.counters
        done = self.base + c.done.value
        rate = c.toks.value / max(now - self.t0, 1e-9)
        frac = done / max(self.total, 1)
        fresh = done - self.base
        eta = (now - self.t0) * (self.total - done) / fresh if fresh else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        line = (
            f"prepare: {c.docs.value:,} docs  {c.toks.value / 1e6:.1f}M tokens  "
            f"{rate / 1e6:.2f}M tokens/s  {100 * frac:.0f}%  ETA {eta_text}"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)
        self.printed = True

    def end(self) -> None:
        self.update(force=True)
        if self.printed and self.tty:
            print(file=sys.stderr)


def _manifest(p: Plan, records: list[dict]) -> dict:
    splits = {s: {"documents": 0, "tokens": 0, "shards": []} for s in SPLITS}
    skipped: dict = {}
    inputs = []
    for r in records:
        for s, shard in r["shards"].items():
            splits[s]["documents"] += r["documents"][s]
            splits[s]["tokens"] += shard["tokens"]
            if shard["tokens"]:
                splits[s]["shards"].append(shard)
        for why, n in r["skipped"].items():
            skipped[why] = skipped.get(why, 0) + n
        if "input_sha256" in r:
            path = pathlib.Path(r["piece"]["path"])
            inputs.append({"path": str(path), "size": path.stat().st_size, "sha256": r["input_sha256"]})
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": p.tokenizer_identity,
        "dtype": p.dtype,
        "source": p.source,
        "inputs": inputs,
        "splits": splits,
        "skipped": dict(sorted(skipped.items())),
    }


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- reading


def read_manifest(directory: pathlib.Path) -> dict:
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{directory} is not a complete token store (no {MANIFEST}); build it with "
            "python -m train.prepare"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"token store {directory}: {MANIFEST} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(
            f"token store {directory} has format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this moara-jax reads {FORMAT!r} version {VERSION}: rebuild it"
        )
    return manifest


class TokenStream:
    """One split of a store as a single token sequence, cut into consecutive windows of
    ``window`` tokens (the tail that fills no window is unused).

    Shards are memory-mapped for each read and unmapped after it: the pages a long run has read
    are then page cache, not this process's resident memory (a map kept open would count every
    page read so far, up to the whole store, in the process's RSS)."""

    def __init__(self, directory: pathlib.Path, split: dict, dtype: str):
        self.dtype = np.dtype(dtype)
        self.paths = [pathlib.Path(directory) / s["file"] for s in split["shards"]]
        for path, s in zip(self.paths, split["shards"], strict=True):
            size = path.stat().st_size if path.is_file() else None
            if size != s["tokens"] * self.dtype.itemsize:
                found = "missing" if size is None else f"{size} bytes"
                raise UserError(
                    f"token store {directory} is damaged: {s['file']} is {found}, the manifest says "
                    f"{s['tokens']} tokens of {dtype}; delete the store and build it again"
                )
        self.starts = np.cumsum([0] + [s["tokens"] for s in split["shards"]])
        self.tokens = int(self.starts[-1])

    def _map(self, i: int) -> np.memmap:
        return np.memmap(self.paths[i], dtype=self.dtype, mode="r")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split, as int32."""
        out = np.empty(stop - start, np.int32)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - self.starts[i]
            n = min(stop - pos, self.starts[i + 1] - pos)
            out[pos - start : pos - start + n] = self._map(i)[lo : lo + n]
            pos += n
            i += 1
        return out

    def windows(self, indices: np.ndarray, window: int) -> np.ndarray:
        """Rows ``indices`` of the window view, ``(len(indices), window)`` int32. Windows inside
        one shard are gathered shard by shard in one indexing operation; the few that straddle
        two shards are read piece by piece."""
        starts = np.asarray(indices, np.int64) * window
        shard_of = np.searchsorted(self.starts, starts, side="right") - 1
        offsets = starts - self.starts[shard_of]
        inside = offsets + window <= self.starts[shard_of + 1] - self.starts[shard_of]
        out = np.empty((len(starts), window), np.int32)
        span = np.arange(window)
        for s in np.unique(shard_of[inside]):
            rows = np.flatnonzero(inside & (shard_of == s))
            out[rows] = self._map(s)[offsets[rows, None] + span]
        for row in np.flatnonzero(~inside):
            out[row] = self.read(int(starts[row]), int(starts[row]) + window)
        return out


# What a store's tokens depend on (a tokenizer.json's "settings": the special tokens its config names).
IDENTITY_KEYS = ("kind", "sha256", "vocab_size", "eos_id", "settings")


class TokenStore:
    """A complete store directory opened for reading (cheap: the manifest and one memory map
    per shard; nothing is read until windows are)."""

    def __init__(self, directory: pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.manifest = read_manifest(self.directory)
        self.tokenizer = self.manifest["tokenizer"]
        self.splits = {
            s: TokenStream(self.directory, self.manifest["splits"][s], self.manifest["dtype"]) for s in SPLITS
        }

    def check(self, p: Plan | None, tokenizer_identity: dict) -> None:
        """Refuses a store made with another tokenizer or (when ``p`` is given) from other inputs
        or split settings, in one line naming both."""
        mine = {k: self.tokenizer.get(k) for k in IDENTITY_KEYS}
        theirs = {k: tokenizer_identity.get(k) for k in IDENTITY_KEYS}
        if mine != theirs:
            raise UserError(
                f"token store {self.directory} was made with tokenizer "
                f"{sources.describe_tokenizer(self.tokenizer)}, but data.tokenizer is "
                f"{sources.describe_tokenizer(tokenizer_identity)}"
            )
        if p is not None and self.manifest["source"] != p.source:
            raise UserError(
                f"token store {self.directory} was made from {_describe_source(self.manifest['source'])}, "
                f"but the data section asks for {_describe_source(p.source)}"
            )


def _describe_source(source: dict) -> str:
    kind = source.get("kind")
    if kind == "files":
        names = [n for n, _ in source.get("inputs", [])]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} files)" if len(names) > 3 else "")
        extra = {k: v for k, v in source.items() if k not in ("kind", "inputs")}
        return f"files [{shown}] {json.dumps(extra, sort_keys=True)}"
    return json.dumps(source, sort_keys=True)
