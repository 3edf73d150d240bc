"""The token store: a corpus tokenized once, in parallel, into flat token shards that training
memory-maps (``layout`` describes a store directory).

One entry from a data section to its tokens, ``open_store``, for ``python -m train`` (through
``train.data.build_data``) and ``python -m train.prepare``; each step lives in one place:

1. plan (``planning``): the pieces the input is cut into and the store's identity, from file stats;
2. find or build (here): ``data.store`` or the cache entry keyed by the plan, built there
   (``building``, worker processes) when it holds no complete store;
3. open (``reading``): ``TokenStore``, refused when made with another tokenizer or from other inputs.

Nothing in this package imports JAX: the build's worker processes import it and ``train.sources``.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import TYPE_CHECKING

from train.sources import autotokenizer_mismatch, make_tokenizer
from train.store.building import Interrupted, build, default_workers, tokenize_piece
from train.store.layout import FORMAT, MANIFEST, SPLITS, VERSION
from train.store.planning import Piece, Plan, expand_paths, plan
from train.store.reading import (
    IDENTITY_KEYS,
    TokenStore,
    TokenStream,
    read_manifest,
    skipped_records,
    tokenizer_key,
)

if TYPE_CHECKING:
    from train.config import DataSection

__all__ = [
    "FORMAT",
    "IDENTITY_KEYS",
    "MANIFEST",
    "SPLITS",
    "VERSION",
    "Interrupted",
    "Piece",
    "Plan",
    "TokenStore",
    "TokenStream",
    "build",
    "build_warnings",
    "cache_root",
    "default_workers",
    "expand_paths",
    "find_or_build",
    "open_store",
    "plan",
    "read_manifest",
    "skipped_records",
    "store_dir",
    "tokenize_piece",
    "tokenizer_key",
]


def open_store(
    cfg: DataSection, quiet: bool = False, out: str | None = None, workers: int | None = None
) -> TokenStore:
    """The store of a data section, opened: ``source: store`` reads ``data.store`` as it is; any
    other source is planned, found in ``out`` (``train.prepare --out``), ``data.store`` or the
    cache, and built there when missing. A store made with another tokenizer or from other
    inputs is refused."""
    if cfg.source == "store":
        p, directory = None, pathlib.Path(cfg.store).expanduser()
        identity = make_tokenizer(cfg.tokenizer).identity()
    else:
        p = plan(cfg)  # loads the tokenizer and hashes its file once
        directory = pathlib.Path(out) if out is not None else store_dir(cfg, p)
        find_or_build(directory, p, workers or cfg.workers, quiet)
        identity = p.tokenizer_identity
    opened = TokenStore(directory)
    opened.check(p, identity)
    return opened


def store_dir(cfg: DataSection, p: Plan) -> pathlib.Path:
    """``data.store``, else the cache entry keyed by the inputs and the tokenizer."""
    if cfg.store:
        return pathlib.Path(cfg.store).expanduser()
    return cache_root(cfg.cache_dir) / p.key


def cache_root(cache_dir: str | None) -> pathlib.Path:
    """``data.cache_dir``, else ``$MOARA_JAX_CACHE``, else ``$XDG_CACHE_HOME/moara-jax``
    (``~/.cache/moara-jax``), each with a ``stores/`` folder."""
    root = cache_dir or os.environ.get("MOARA_JAX_CACHE")
    if not root:
        root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "moara-jax"
    return pathlib.Path(root).expanduser() / "stores"


def find_or_build(directory: pathlib.Path, p: Plan, workers: int | None = None, quiet: bool = False) -> None:
    """Builds the store of ``p`` in ``directory`` unless a complete one is there (a complete store
    is only read: its directory may be read-only)."""
    if (directory / MANIFEST).is_file():
        return
    if not quiet:
        pieces = len(p.pieces)
        print(f"token store: building {directory} ({pieces} piece{'s' * (pieces != 1)})", file=sys.stderr)
    build(directory, p, workers, quiet=quiet)
    for line in build_warnings(read_manifest(directory), p):
        print(f"warning: {line}", file=sys.stderr)


def build_warnings(manifest: dict, p: Plan) -> list[str]:
    """What a store just built should tell its user: documents whose text holds a special token's
    (``sources.holds_special_text``), and a ``tokenizer.json`` that ``AutoTokenizer`` on its
    directory would encode otherwise (``sources.autotokenizer_mismatch``)."""
    said = []
    special = {s: n for s, n in manifest.get("special_text", {}).items() if n}
    if special:
        where = " and ".join(f"{n:,} {s}" for s, n in special.items())
        said.append(
            f"{where} documents hold the text of a special token of the tokenizer (e.g. "
            "<|endoftext|> in a web page), which it encodes as that token, as AutoTokenizer does: "
            "a document boundary or BOS inside a document (split_special_tokens: true in "
            "tokenizer_config.json encodes it as text)"
        )
    tok = make_tokenizer(p.tokenizer)
    text = autotokenizer_mismatch(tok)
    if text is not None:
        said.append(
            f"the store holds {tok.path}'s tokens, but transformers.AutoTokenizer "
            f"on {tok.path.parent} encodes {text!r} otherwise (the tokenizer class its tokenizer_config.json "
            "or model type names replaces the file's rules): a model trained on this store reads other "
            "ids than that tokenizer gives (train.export writes tokenizer files that give the store's)"
        )
    return said
