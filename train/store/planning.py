"""Planning a token store: the pieces a data section's input is cut into (a file, a byte range of
a large JSON-lines file, a record range of a TFDS split) and the store's identity (tokenizer,
portable source description, cache key). Cheap: input files are stat'ed, never read."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass

from train import sources
from train.errors import UserError
from train.store.layout import VERSION

PIECE_BYTES = 64 << 20  # a plain JSON-lines file is cut into pieces of about this size
PIECE_RECORDS = 100_000  # a TFDS split is cut into pieces of this many records
TFDS_VALIDATION_DOCUMENTS = 1000  # the validation records taken from a TFDS dataset by default


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

    @property
    def made_with(self) -> dict:
        """What a piece's tokens depend on besides the piece: kept in its record, so that a build
        continued with another tokenizer or validation fraction redoes the pieces made before."""
        return {"tokenizer": self.tokenizer_identity, "dtype": self.dtype, "fraction": self.fraction}


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
        _check_disjoint(paths, validation_paths)
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
    matches nothing is an error, unless it names a file as written (``c4[1].jsonl``)."""
    out = []
    for p in paths:
        path = os.path.expanduser(str(p))
        if any(c in str(p) for c in "*?["):
            matches = sorted(glob.glob(path))
            if not matches and os.path.isfile(path):
                matches = [path]  # a file whose name holds [ or ?, as written
            if not matches:
                where = "" if os.path.isabs(path) else f" (a relative pattern, from {os.getcwd()})"
                raise UserError(f"data file pattern matches no file: {p}{where}")
            out += matches
        else:
            out.append(path)
    return out


def _check_disjoint(paths: list[str], validation_paths: list[str]) -> None:
    """Refuses a file that ``data.paths`` and ``data.validation_paths`` both name (a glob such
    as ``c4-*.json.gz`` that matches the validation file too): its documents would be trained on
    and then evaluated as held out."""
    train = {pathlib.Path(p).resolve() for p in paths if pathlib.Path(p).exists()}
    both = [p for p in validation_paths if pathlib.Path(p).exists() and pathlib.Path(p).resolve() in train]
    if both:
        shown = ", ".join(both[:3]) + (f" (and {len(both) - 3} more)" if len(both) > 3 else "")
        raise UserError(
            f"data.validation_paths and data.paths both name {shown}: the held-out documents would "
            "be trained on (narrow the data.paths pattern)"
        )


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
