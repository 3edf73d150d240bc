"""Building a token store from a plan: worker processes tokenize whole pieces, each into one shard
per split it feeds, and the manifest is written last.

Every shard is written under a ``.tmp`` name and renamed once complete, and a piece's ``.json`` is
renamed after its shards, so an interrupted build (SIGTERM, SIGKILL, a full disk) leaves no piece
that looks complete, and the same command run again continues from the completed pieces and ends
with the same bytes as an uninterrupted build: a piece's output depends on the piece alone, never
on the worker count or the order in which workers finish. Nothing here imports JAX: the worker
processes import this module and ``train.sources``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import signal
import sys
import threading
import time
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from train import sources
from train.errors import IOFault, ProcessLost, UserError, io_operation
from train.store.layout import FORMAT, MANIFEST, SPLITS, VERSION
from train.store.planning import Piece, Plan
from train.store.reading import (
    atomic_write,
    outside_vocabulary,
    read_manifest,
    skipped_records,
    write_manifest,
)


class Interrupted(Exception):
    """SIGTERM/SIGINT during a build: completed pieces are kept, running ones discarded."""


# -------------------------------------------------------------------------------------- workers

_worker: dict = {}


def _setup(tokenizer: str, made_with: dict, counters) -> None:
    """What ``tokenize_piece`` reads, set once per process."""
    _worker.update(
        tok=sources.make_tokenizer(tokenizer),
        dtype=np.dtype(made_with["dtype"]),
        fraction=made_with["fraction"],
        made_with=made_with,
        counters=counters,
    )


def _init_worker(parent: int, *args) -> None:
    """A worker's set-up; ``parent``: the building process's pid (given, not read here: the
    build may have been killed before this runs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interruption
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _setup(*args)


def _exit_with(parent: int) -> None:
    """Ends this worker once its parent has gone (killed with SIGKILL, say, which it cannot
    pass on): an orphan would go on writing into the store that the next build continues."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


class _ShardWriter:
    """Appends token arrays to ``NAME.PID.tmp`` (a name of this process's alone), hashing as it
    goes; ``finish`` renames it to ``NAME`` once complete (or removes it when nothing was written)."""

    def __init__(self, path: pathlib.Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
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
    mtime = _mtime(piece) if piece.kind == "file" else None
    splits = ("train", "validation") if piece.role == "mixed" else (piece.role,)
    writers = {s: _ShardWriter(shards / f"{s}-{piece.index:05d}.bin", dtype) for s in splits}
    documents = dict.fromkeys(splits, 0)
    special = dict.fromkeys(splits, 0)  # documents whose text holds a special token's
    counts = sources.Counts()
    batch: list[str] = []
    read = 0
    exhausted = True

    def flush():
        parts: dict[str, list] = {s: [] for s in splits}  # one write per split and batch
        for text, ids in zip(batch, sources.document_tokens(tok, batch), strict=True):
            split = piece.role
            if split == "mixed":
                split = "validation" if sources.is_validation(text, _worker["fraction"]) else "train"
            parts[split].append(ids)
            documents[split] += 1
            special[split] += sources.holds_special_text(tok, text, ids)
        tokens = 0
        for split, arrays in parts.items():
            if arrays:
                joined = np.concatenate(arrays)
                _check_ids(joined, tok, piece)
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
        "made_with": _worker["made_with"],
        "limit": limit,
        "exhausted": exhausted,
        "documents": documents,
        "special_text": special,
        "shards": shards_out,
        "skipped": dict(sorted(counts.skipped.items())),
    }
    if piece.kind == "file":
        record["input_mtime_ns"] = mtime
        if piece.start == 0:
            record["input_sha256"] = sources.file_sha256(pathlib.Path(piece.path))
    atomic_write(_meta_path(shards, piece), json.dumps(record, sort_keys=True, indent=1) + "\n")
    counters.work(piece.work)
    return record


def _check_ids(ids: np.ndarray, tok, piece: Piece) -> None:
    """Refuses ids outside the tokenizer's vocabulary (a ``tokenizer.json`` whose post-processor
    names an id its vocabulary lacks): the store's dtype would wrap them silently."""
    bad = outside_vocabulary(ids, tok.vocab_size)
    if bad is not None:
        where = piece.path or piece.kind
        raise UserError(
            f"data.tokenizer gave token id {bad} for a document of {where}, outside its vocabulary "
            f"of {tok.vocab_size} ids: the tokenizer's files disagree (e.g. a post-processor's token "
            "that the vocabulary lacks)"
        )


class _Counters:
    """Documents, tokens and input work done, shared by the workers with the parent. The workers
    add under each counter's lock; the building process never takes one: ``_stop`` terminates
    workers mid-piece, and a worker killed inside ``add`` leaves that lock held for good (a
    process-shared semaphore is not released with its holder), so a parent that waited for it
    would wait forever (the cut at ``max_documents`` tokenizes in the parent right after
    ``_stop``). The parent adds only while no worker runs (one worker; that cut) and reads
    without the lock (the progress line)."""

    def __init__(self, ctx):
        self.docs, self.toks, self.done = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
        self.parent = os.getpid()  # (pickled to the workers as it is: theirs differ)

    def _add(self, counter, n: int) -> None:
        if os.getpid() == self.parent:
            counter.get_obj().value += n
            return
        with counter.get_lock():
            counter.value += n

    def add(self, docs: int, tokens: int) -> None:
        self._add(self.docs, docs)
        self._add(self.toks, tokens)

    def work(self, n: int) -> None:
        self._add(self.done, n)

    def read(self) -> tuple[int, int, int]:
        """Documents, tokens and work done so far, read without the locks."""
        return self.docs.get_obj().value, self.toks.get_obj().value, self.done.get_obj().value


# ---------------------------------------------------------------------------------------- build


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build(directory: pathlib.Path, p: Plan, workers: int | None = None, quiet: bool = False) -> dict:
    """Builds the store (or finishes an interrupted build) and returns its manifest. One process
    builds a directory at a time; another waits for it and then reads its manifest."""
    directory = pathlib.Path(directory)
    try:
        with io_operation("creating the token store", directory):
            directory.mkdir(parents=True, exist_ok=True)
            lock = open(directory / ".lock", "a+")  # noqa: SIM115 - closed below
    except OSError as e:  # not a fault of the machine: e.g. a file where the directory should be
        raise UserError(f"cannot create the token store {directory}: {e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / MANIFEST).is_file():
            return read_manifest(directory)
        shards = directory / "shards"
        shards.mkdir(exist_ok=True)
        try:
            with io_operation("building the token store", directory):
                _remove_partial(shards)  # left by a build that was killed
                with _interrupts_raise():
                    records = _run(p, shards, workers or default_workers(), quiet)
                manifest = _manifest(p, records)
                if manifest["splits"]["train"]["documents"] == 0:  # no store: the inputs can be mended
                    raise UserError(
                        f"the inputs of token store {directory} gave no train document"
                        f"{skipped_records(manifest)}"
                    )
                write_manifest(directory, manifest)
        except IOFault as e:
            raise e.with_note("completed shards are kept") from None  # (each command says how to go on)
        finally:
            _remove_partial(shards)  # of workers stopped mid-piece
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


def _limit_of(piece: Piece, limit: int | None) -> int | None:
    """The documents a piece may read: ``data.max_documents`` caps the pieces that read train
    text; a validation file's pieces are read whole (the split does not depend on how many files
    or pieces it comes in)."""
    return None if piece.role == "validation" else limit


def _reusable(record: dict | None, p: Plan, piece: Piece, limit: int | None, shards: pathlib.Path) -> bool:
    if record is None or record["piece"] != json.loads(json.dumps(dataclasses.asdict(piece))):
        return False
    if record.get("made_with") != json.loads(json.dumps(p.made_with)):
        return False  # made with another tokenizer or validation fraction (or before it was kept)
    if piece.kind == "file" and record.get("input_mtime_ns") not in (None, _mtime(piece)):
        return False  # the input changed (its size the same) since the piece was made
    read = sum(record["documents"].values())
    if record["limit"] != limit and not (record["exhausted"] and (limit is None or read < limit)):
        return False
    itemsize = np.dtype(p.dtype).itemsize
    return all(  # each shard whole (a cut one would only show when the store is opened)
        _size(shards.parent / s["file"]) == s["tokens"] * itemsize
        for s in record["shards"].values()
        if s["tokens"]
    )


def _size(path: pathlib.Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _mtime(piece: Piece) -> int:
    return pathlib.Path(piece.path).stat().st_mtime_ns


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
        if _reusable(record, p, piece, _limit_of(piece, limit), shards):
            records[piece.index] = record
        else:
            todo.append(piece)
    # Validation pieces first: a limit stops the train pieces early, never them.
    todo.sort(key=lambda q: (q.role != "validation", q.index))
    ctx = mp.get_context("spawn")
    counters = _Counters(ctx)
    initargs = (p.tokenizer, p.made_with, counters)
    progress = _Progress(p, counters, records, quiet)
    jobs = [(q, shards, _limit_of(q, limit)) for q in todo]
    pool = None
    _setup(*initargs)  # the parent tokenizes too: with one worker, and the piece a limit cuts
    if max(1, min(workers, len(todo))) == 1:
        results = map(tokenize_piece, jobs)
    else:
        # An executor, not multiprocessing.Pool: a worker the system kills (out of memory) breaks
        # it and fails the waits, where a Pool would replace the worker and lose its piece silently.
        pool = futures.ProcessPoolExecutor(
            min(workers, len(todo)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(os.getpid(), *initargs),
        )
        results = iter([pool.submit(tokenize_piece, job) for job in jobs])
    try:
        for _ in jobs:
            record = _next_record(results, pool is not None, progress, p, records)
            records[record["piece"]["index"]] = record
            progress.update()
            if limit is not None and _train_documents(p, records) >= limit:
                break
    finally:
        if pool is not None:
            _stop(pool)
        progress.end()
    if limit is not None:
        _cut_at_limit(p, shards, records, limit)
    return [records[q.index] for q in p.pieces if q.index in records]


def _next_record(results, parallel: bool, progress, p: Plan, records: dict) -> dict:
    """The next piece's record, the progress line kept moving while a worker has it."""
    if not parallel:
        return next(results)
    pending = next(results)
    while True:
        try:
            return pending.result(timeout=0.5)
        except futures.TimeoutError:
            progress.update()
        except BrokenProcessPool:
            done = sum(1 for q in p.pieces if q.index in records)
            raise ProcessLost(
                "a tokenizing worker process ended before its piece was done (killed by the system? "
                f"out of memory?); the {done} of {len(p.pieces)} pieces completed are kept: run the "
                "same command again to continue (with fewer --workers if memory ran out)"
            ) from None


STOP_WAIT_S = 10.0  # how long _stop waits for the pool's manager thread


def _stop(pool: futures.ProcessPoolExecutor) -> None:
    """Ends the workers now, their running pieces discarded (their shards stay ``.tmp``), before
    anything after the build (the cut at ``max_documents``) looks at the shards."""
    # shutdown(wait=False) forgets the processes and the thread that manages them; no public names
    processes = list((pool._processes or {}).values())
    manager = pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join()
    if manager is not None:
        # It sees its workers gone and ends. Not waited on without end: one stopped inside the
        # write of a large result leaves it reading the rest of that message (it ends at exit).
        manager.join(timeout=STOP_WAIT_S)


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
        docs, toks, work = self.counters.read()
        done = self.base + work
        rate = toks / max(now - self.t0, 1e-9)
        frac = done / max(self.total, 1)
        fresh = done - self.base
        eta = (now - self.t0) * (self.total - done) / fresh if fresh else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        line = (
            f"prepare: {docs:,} docs  {toks / 1e6:.1f}M tokens  "
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
    special = dict.fromkeys(SPLITS, 0)
    inputs = []
    for r in records:
        for s, shard in r["shards"].items():
            splits[s]["documents"] += r["documents"][s]
            splits[s]["tokens"] += shard["tokens"]
            special[s] += r.get("special_text", {}).get(s, 0)  # (not counted in older pieces)
            if shard["tokens"]:
                splits[s]["shards"].append(shard)
        for why, n in r["skipped"].items():
            skipped[why] = skipped.get(why, 0) + n
        if "input_sha256" in r:
            path = pathlib.Path(r["piece"]["path"])
            entry = {"path": str(path), "size": path.stat().st_size, "sha256": r["input_sha256"]}
            if r.get("input_mtime_ns") is not None:  # (pieces made before it was recorded lack it)
                entry["mtime_ns"] = r["input_mtime_ns"]
            inputs.append(entry)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": p.tokenizer_identity,
        "dtype": p.dtype,
        "source": p.source,
        "inputs": inputs,
        "splits": splits,
        "skipped": dict(sorted(skipped.items())),
        # documents with a special token's text, which their tokenizer encodes as that token
        "special_text": special,
    }
