"""Reading a complete token store: its manifest, each split as one token sequence cut into
windows (memory-mapped per read), and the check that it was made with the data section's
tokenizer and from its inputs."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from concurrent import futures

import numpy as np

from train import sources
from train.errors import UserError
from train.store.layout import FORMAT, MANIFEST, SPLITS, VERSION
from train.store.planning import Plan


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
    if not isinstance(manifest, dict):
        manifest = {}
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(
            f"token store {directory} has format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this moara-jax reads {FORMAT!r} version {VERSION}: rebuild it"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise UserError(
            f"token store {directory} is damaged: its {MANIFEST} {problem}; delete the store and build "
            "it again"
        )
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    """What a manifest of this format lacks for reading, or None."""
    tokenizer, splits = manifest.get("tokenizer"), manifest.get("splits")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("vocab_size"), int):
        return "has no tokenizer with a vocab_size"
    if manifest.get("dtype") not in ("uint16", "uint32"):
        return f"has dtype {manifest.get('dtype')!r}, not uint16 or uint32"
    if not isinstance(manifest.get("source"), dict) or not isinstance(manifest.get("skipped"), dict):
        return "has no source or skipped records"
    if not isinstance(splits, dict):
        return "has no splits"
    for name in SPLITS:
        split = splits.get(name)
        if not isinstance(split, dict) or not isinstance(split.get("documents"), int):
            return f"has no {name} split with its documents"
        shards = split.get("shards")
        if not isinstance(shards, list) or not all(
            isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in SHARD_KEYS.items())
            for s in shards
        ):
            return f"has no list of {name} shards (each a file, its tokens and sha256)"
    return None


SHARD_KEYS = {"file": str, "tokens": int, "sha256": str}  # what reading a shard's entry needs


def outside_vocabulary(ids: np.ndarray, vocab_size: int) -> int | None:
    """An id of ``ids`` that a vocabulary of ``vocab_size`` lacks (negative, or too large), else
    None."""
    if not ids.size:
        return None
    low, high = int(ids.min()), int(ids.max())
    return low if low < 0 else high if high >= vocab_size else None


def skipped_records(manifest: dict) -> str:
    """``" (N input records skipped: {why: n})"``, or ``""`` when none were."""
    skipped = manifest["skipped"]
    return f" ({sum(skipped.values()):,} input records skipped: {skipped})" if skipped else ""


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    """``manifest.json``, replaced atomically (its presence marks the store complete)."""
    atomic_write(pathlib.Path(directory) / MANIFEST, json.dumps(manifest, sort_keys=True, indent=1) + "\n")


def atomic_write(path: pathlib.Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file of this process, synced, then renamed: a
    reader sees the old file or the whole new one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class TokenStream:
    """One split of a store as a single token sequence, cut into consecutive windows of
    ``window`` tokens (the tail that fills no window is unused).

    Shards are memory-mapped for each read and unmapped after it: the pages a long run has read
    are then page cache, not this process's resident memory (a map kept open would count every
    page read so far, up to the whole store, in the process's RSS)."""

    def __init__(self, directory: pathlib.Path, split: dict, dtype: str, vocab_size: int):
        self.directory, self.dtype, self.vocab_size = directory, np.dtype(dtype), vocab_size
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
        return self._checked(self._read(start, stop))

    def _read(self, start: int, stop: int) -> np.ndarray:
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
            out[row] = self._read(int(starts[row]), int(starts[row]) + window)
        return self._checked(out)

    def _checked(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens``, unless one is no id of the store's tokenizer (a shard overwritten since it
        was built): a model would embed it as garbage, or read past its table."""
        bad = outside_vocabulary(tokens, self.vocab_size)
        if bad is not None:
            raise UserError(
                f"token store {self.directory} is damaged: it holds token id {bad}, not one of its "
                f"tokenizer's {self.vocab_size}; delete the store and build it again"
            )
        return tokens


# What a store's tokens depend on (a tokenizer.json's "settings": the special tokens its config names).
IDENTITY_KEYS = ("kind", "sha256", "vocab_size", "eos_id", "settings")


def tokenizer_key(identity: dict) -> dict:
    """What of a tokenizer identity decides the tokens (``IDENTITY_KEYS``; not its file's name):
    two stores, runs or checkpoints with equal keys have the same tokenizer."""
    return {k: identity.get(k) for k in IDENTITY_KEYS}


class TokenStore:
    """A complete store directory opened for reading (cheap: the manifest and one memory map
    per shard; nothing is read until windows are)."""

    def __init__(self, directory: pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.manifest = read_manifest(self.directory)
        self.tokenizer = self.manifest["tokenizer"]
        dtype, vocab_size = self.manifest["dtype"], self.tokenizer["vocab_size"]
        self.splits = {
            s: TokenStream(self.directory, self.manifest["splits"][s], dtype, vocab_size) for s in SPLITS
        }

    def verify(self, workers: int = 1) -> int:
        """Reads every shard and checks it against the sha256 its manifest recorded when it was
        built (opening a store checks sizes only, and the tokens a window reads against the
        vocabulary); returns the bytes read. A shard changed since is refused in one line."""
        shards = [s for split in self.manifest["splits"].values() for s in split["shards"]]
        with futures.ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib runs without the GIL
            hashes = list(pool.map(lambda s: sources.file_sha256(self.directory / s["file"]), shards))
        changed = [s["file"] for s, sha in zip(shards, hashes, strict=True) if sha != s["sha256"]]
        if changed:
            raise UserError(
                f"token store {self.directory} is damaged: {len(changed)} of its {len(shards)} shards "
                f"differ from the sha256 its manifest recorded ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}); delete the store and build it again"
            )
        return sum((self.directory / s["file"]).stat().st_size for s in shards)

    def check(self, p: Plan | None, tokenizer_identity: dict) -> None:
        """Refuses a store made with another tokenizer or (when ``p`` is given) from other inputs
        or split settings, in one line naming both."""
        if tokenizer_key(self.tokenizer) != tokenizer_key(tokenizer_identity):
            raise UserError(
                f"token store {self.directory} was made with tokenizer "
                f"{sources.describe_tokenizer(self.tokenizer)}, but data.tokenizer is "
                f"{sources.describe_tokenizer(tokenizer_identity)}: set data.tokenizer to the store's "
                "(e.g. --set data.tokenizer=PATH), or give data.store another directory"
            )
        if p is not None and self.manifest["source"] != p.source:
            raise UserError(
                f"token store {self.directory} was made from other data than the data section names "
                f"({_source_difference(self.manifest['source'], p.source)}): remove the store, or give "
                "data.store (train.prepare --out) another directory"
            )
        if p is not None and (self._check_inputs_unchanged(p) | self._check_inputs_are_its_own(p)):
            with contextlib.suppress(OSError):  # not hashed again at the next start, where writable
                write_manifest(self.directory, self.manifest)

    def _check_inputs_unchanged(self, p: Plan) -> bool:
        """An input the data section names at the path it was read from, its size the same but
        modified since (a store recognises its inputs by name and size): hashed again, and
        refused if its bytes differ. Whether one was hashed (and its new time recorded)."""
        verified = False
        named = _named_files(p)
        for entry in self.manifest.get("inputs", []):
            path = pathlib.Path(entry["path"])
            if path not in named:  # (one of another machine's paths, or a copy's original)
                continue
            try:
                st = path.stat()
            except OSError:  # gone since the plan read its size
                continue
            if "mtime_ns" not in entry or st.st_mtime_ns == entry["mtime_ns"] or st.st_size != entry["size"]:
                continue
            sha = sources.file_sha256(path)
            if sha != entry["sha256"]:
                raise UserError(
                    f"token store {self.directory} was made from another version of {path} (sha256 "
                    f"{entry['sha256'][:12]}, now {sha[:12]}): remove the store, or give data.store "
                    "another directory"
                )
            entry["mtime_ns"], verified = st.st_mtime_ns, True
        return verified

    def _check_inputs_are_its_own(self, p: Plan) -> bool:
        """An input the data section names at another path than the one the store read (a store
        knows its inputs by name and size, e.g. one made on another machine): hashed once, and
        refused unless it has the bytes of an input of that name and size. Whether one was hashed
        (and recorded as a copy)."""
        entries = self.manifest.get("inputs", [])
        recorded = {pathlib.Path(e["path"]) for e in entries}
        verified = False
        for named in _named_files(p):
            st = named.stat()
            alike = [
                e for e in entries if pathlib.Path(e["path"]).name == named.name and e["size"] == st.st_size
            ]
            if named in recorded or not alike:
                continue
            if any(e.get("copies", {}).get(str(named)) == st.st_mtime_ns for e in alike):
                continue  # hashed at an earlier start, unchanged since
            sha = sources.file_sha256(named)
            same = [e for e in alike if e["sha256"] == sha]
            if not same:
                raise UserError(
                    f"token store {self.directory} was made from another file named {named.name} "
                    f"({alike[0]['path']}, sha256 {alike[0]['sha256'][:12]}; {named} has sha256 "
                    f"{sha[:12]}): remove the store, or give data.store another directory"
                )
            same[0].setdefault("copies", {})[str(named)], verified = st.st_mtime_ns, True
        return verified


def _named_files(p: Plan) -> list[pathlib.Path]:
    """The input files a plan reads, in order, each once."""
    return list(dict.fromkeys(pathlib.Path(q.path) for q in p.pieces if q.kind == "file"))


def _source_difference(made: dict, asked: dict) -> str:
    """What differs between the source a store was made from and the one asked for, in words."""
    if made.get("kind") != asked.get("kind"):
        return f"{_describe_source(made)}, now {_describe_source(asked)}"
    said = []
    for key in ("inputs", "validation_inputs"):
        then, now = dict(map(tuple, made.get(key, []))), dict(map(tuple, asked.get(key, [])))
        field = "data.paths" if key == "inputs" else "data.validation_paths"
        here = [f"{field} no longer names {name}" for name in then.keys() - now.keys()]
        here += [f"{field} names {name}, which the store did not read" for name in now.keys() - then.keys()]
        here += [
            f"{n} was {then[n]:,} bytes, now {now[n]:,}"
            for n in then.keys() & now.keys()
            if then[n] != now[n]
        ]
        if not here and list(then) != list(now):
            here.append(f"{field} names its files in another order")
        said += here
    for key in sorted((made.keys() | asked.keys()) - {"kind", "inputs", "validation_inputs"}):
        if made.get(key) != asked.get(key):
            said.append(f"{key} {made.get(key)!r}, now {asked.get(key)!r}")
    if not said:  # e.g. two inputs of one name
        said.append(f"{_describe_source(made)}, now {_describe_source(asked)}")
    return "; ".join(sorted(said)[:4]) + (f"; and {len(said) - 4} more" if len(said) > 4 else "")


def _describe_source(source: dict) -> str:
    kind = source.get("kind")
    if kind == "files":
        names = [n for n, _ in source.get("inputs", [])]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} files)" if len(names) > 3 else "")
        return f"files [{shown}]"
    return json.dumps(source, sort_keys=True)
