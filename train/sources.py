"""Where text comes from and how it becomes token ids: tokenizers (bytes, sentencepiece, a Hugging
Face ``tokenizer.json``) and the
document readers of each source (CPython's bundled docs, local files, TFDS), each able to read
one piece of its input (a byte range of a JSON-lines file, a record range of a TFDS split) so
that ``train.store`` can tokenize the pieces in parallel worker processes.

Nothing here imports JAX: the store's worker processes import this module alone.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from train.errors import UserError

# ---------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes: ids 0-255, EOS 256. Needs no download."""

    vocab_size = 257
    eos_id = 256
    bos_id = None
    pad_id = None
    ends_with_eos = False
    text_specials = np.empty(0, np.int64)  # (no text encodes as EOS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def identity(self) -> dict:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}


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
        self.path = pathlib.Path(path).expanduser()
        if not self.path.is_file():
            raise UserError(f"data.tokenizer: sentencepiece model not found: {path}")
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:  # e.g. a tiktoken tokenizer.model (Llama 3's)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"data.tokenizer: {path} is not a sentencepiece model ({why})") from None
        self.vocab_size = self.processor.get_piece_size()
        self.eos_id = self.processor.eos_id()
        self.pad_id = self.processor.pad_id() if self.processor.pad_id() >= 0 else None  # (its own)
        self.bos_id = None  # a document's ids are its pieces: no BOS (the model's own BOS is unused)
        self.ends_with_eos = False
        self.text_specials = np.empty(0, np.int64)  # it encodes "</s>" in a text as its characters
        if self.eos_id < 0:
            raise UserError(f"data.tokenizer: {path} defines no EOS piece")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # One thread: the store's parallelism is its worker processes.
        return [np.asarray(ids, np.int64) for ids in self.processor.encode(texts, num_threads=1)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def identity(self) -> dict:
        return {
            "kind": "sentencepiece",
            "name": self.path.name,
            "sha256": file_sha256(self.path),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }


TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Where an export puts tokenizer files that transformers would read with a model type's own class
# from the model's directory (train.export.write_tokenizer); train.evaluate --hf looks there too.
TOKENIZER_SUBDIR = "tokenizer"
# tokenizer_config.json keys naming special tokens, in the order transformers adds the missing ones.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens(
    config: dict, padding: dict | None
) -> tuple[dict[str, str | None], dict[str, str], list[str]]:
    """The special tokens of a tokenizer_config.json as transformers 5's ``from_pretrained``
    reads them, in the order it adds them: the named ones (``SPECIAL_KEYS``; a pad token the
    config does not name is the one of ``tokenizer.json``'s saved ``padding``); the model-specific
    ones; last, the ``extra_special_tokens`` list (``additional_special_tokens`` when that is
    empty). The model-specific ones are the ``*_token`` keys holding an AddedToken, then those
    holding a string, merged with an ``extra_special_tokens`` dict (its values win); the config's
    own ``model_specific_special_tokens`` only when there are none of those."""
    named = {k: _token_text(config.get(k)) for k in SPECIAL_KEYS}
    if "pad_token" not in config and padding:
        named["pad_token"] = _token_text(padding.get("pad_token"))
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    custom = [k for k in config if k.endswith("_token") and k not in SPECIAL_KEYS]
    merged = {k: config[k] for k in custom if isinstance(config[k], str)}
    if isinstance(extra, dict):
        merged.update(extra)
        extra = []
    if not merged and isinstance(config.get("model_specific_special_tokens"), dict):
        merged = dict(config["model_specific_special_tokens"])
    added = {
        k: config[k]
        for k in custom
        if isinstance(config[k], dict) and config[k].get("__type") == "AddedToken"
    }
    model_specific = {k: _token_text(v) for k, v in {**added, **merged}.items()}
    listed = [_token_text(t) for t in (extra if isinstance(extra, list | tuple) else [])]
    return named, {k: v for k, v in model_specific.items() if v}, [t for t in listed if t]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (Llama 3 and Qwen ship byte-level BPE ones) read with the
    ``tokenizers`` library, no ``transformers``: a document's ids are ``Tokenizer.encode(text)``
    with its special tokens (e.g. the BOS a Llama 3 post-processor puts first), which is what
    ``transformers.AutoTokenizer`` gives for a ``PreTrainedTokenizerFast`` of these two files. From
    the ``tokenizer_config.json`` beside it, as transformers reads them: EOS is its ``eos_token``
    (required: the store puts it after every document), BOS its ``bos_token`` (may be absent); every
    special token it names is a special added token (matched whole, even inside a text), unless
    ``split_special_tokens``. Its ``add_bos_token``/``add_eos_token`` are not read: the
    post-processor of ``tokenizer.json`` decides, as it does for ``PreTrainedTokenizerFast`` in
    transformers 5 (and ``train.export`` writes a config without them)."""

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise UserError(
                "data.tokenizer names a Hugging Face tokenizer.json but the tokenizers library is not "
                "installed: pip install 'moara-jax[tokenizers]'"
            ) from None
        p = pathlib.Path(path).expanduser()
        if (
            p.is_dir()
            and not (p / TOKENIZER_JSON).is_file()
            and (p / TOKENIZER_SUBDIR / TOKENIZER_JSON).is_file()
        ):
            p = p / TOKENIZER_SUBDIR  # an export's, put apart (train.export.write_tokenizer)
        if p.is_dir():
            p = p / TOKENIZER_JSON
        if not p.is_file():
            raise UserError(f"data.tokenizer: {path}: no {TOKENIZER_JSON} there")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"data.tokenizer: {p} is not a tokenizers file ({why})") from None
        dropout = getattr(self._tok.model, "dropout", None)
        if dropout:
            raise UserError(
                f"data.tokenizer: {p}: its BPE model has dropout {dropout:.3g}, which segments a text "
                "at random (a store built twice would differ): set the model's dropout to null there"
            )
        self.path, self.config_path = p, p.with_name(TOKENIZER_CONFIG)
        self.config = self._read_config()
        # A file saved after a call with truncation or padding keeps them; AutoTokenizer.encode
        # sets both off for each call, and a document is encoded whole.
        padding = self._tok.padding
        self._tok.no_truncation()
        self._tok.no_padding()
        named, model_specific, extra = _special_tokens(self.config, padding)
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        ordered = [*named.values(), *model_specific.values(), *extra]
        new = [t for t in dict.fromkeys(ordered) if t and t not in added]
        self._tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in new])
        self._tok.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        if named["eos_token"] is None:
            raise UserError(
                f"data.tokenizer: {p}: no EOS token: {self.config_path.name} beside it must name one "
                '(e.g. {"eos_token": "<|endoftext|>"}), the token the store puts after every document'
            )
        self.eos_id = self._tok.token_to_id(named["eos_token"])
        self.bos_id = self._tok.token_to_id(named["bos_token"]) if named["bos_token"] else None
        self.pad_id = self._tok.token_to_id(named["pad_token"]) if named["pad_token"] else None
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        # A post-processor that ends every text with EOS (T5's "$A </s>"): that EOS is the
        # document's separator, not followed by another (``document_tokens``).
        probe = [self._tok.encode("a", add_special_tokens=special).ids[-1:] for special in (True, False)]
        self.ends_with_eos = probe[0] == [self.eos_id] != probe[1]
        # The special tokens a text's own characters encode as (matched whole, as AutoTokenizer
        # matches them), unless split_special_tokens; and how many the post-processor puts
        # before and after a text (Llama 3's BOS), which are not the text's.
        decoder = self._tok.get_added_tokens_decoder()
        matched = not self._tok.encode_special_tokens
        specials = sorted(i for i, t in decoder.items() if t.special and matched)
        self.text_specials = np.asarray(specials, np.int64)  # (an array once: read per document)
        # The id the model gives characters it has no piece for (a Unigram or BPE model's unk):
        # where it is a special token too, a text holds that token only if it holds its content.
        unk_token = getattr(self._tok.model, "unk_token", None)  # BPE, WordPiece, WordLevel
        if isinstance(self._tok.model, tokenizers.models.Unigram):  # its unk_id is in no attribute
            unk = json.loads(self._tok.to_str())["model"].get("unk_id")
        else:
            unk = self._tok.token_to_id(unk_token) if unk_token else None
        self.unknown = (unk, decoder[unk].content) if unk in specials else None
        alone, framed = (self._tok.encode("a", add_special_tokens=s).ids for s in (False, True))
        before = next((k for k in range(len(framed)) if framed[k : k + len(alone)] == alone), 0)
        self.framing = (before, len(framed) - before - len(alone))
        self.settings = {
            "special_tokens": {k: v for k, v in named.items() if v},
            "extra_special_tokens": extra,
            "added_special_tokens": new,
            "split_special_tokens": self._tok.encode_special_tokens,
        }
        # (each absent otherwise, so that stores built before it still match)
        if model_specific:
            self.settings["model_specific_special_tokens"] = model_specific
        if self.ends_with_eos:
            self.settings["ends_with_eos"] = True

    def _read_config(self) -> dict:
        if not self.config_path.is_file():
            raise UserError(
                f"data.tokenizer: {self.path}: no {TOKENIZER_CONFIG} beside it to name the EOS token "
                '(write one, e.g. {"eos_token": "<|endoftext|>"})'
            )
        try:
            config = json.loads(self.config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"data.tokenizer: {self.config_path} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise UserError(f"data.tokenizer: {self.config_path} is not a JSON object")
        return config

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # One text at a time, one thread: the store's parallelism is its worker processes.
        return [np.asarray(self._tok.encode(t).ids, np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def identity(self) -> dict:
        return {
            "kind": "hf",
            "name": f"{self.path.parent.name}/{self.path.name}",
            "sha256": file_sha256(self.path),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "settings": self.settings,
        }


def document_tokens(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids and the EOS after it, int64: a document as the token store and
    ``train.evaluate``'s streams hold it. A tokenizer whose encoding already ends with EOS (a
    ``tokenizer.json`` post-processor's, T5's) gets no second one."""
    eos = np.asarray([] if tokenizer.ends_with_eos else [tokenizer.eos_id], np.int64)
    return [np.concatenate([np.asarray(ids, np.int64), eos]) for ids in tokenizer.encode_batch(texts)]


def holds_special_text(tokenizer, text: str, ids: np.ndarray) -> bool:
    """Whether a document's ids (``document_tokens``' of ``text``) hold a special token its text
    encoded as (e.g. ``<|endoftext|>`` written in a web page): a boundary the document does not
    have. The unk id of characters the model has no piece for (``HFTokenizer.unknown``) counts
    only where the text holds the unk token's own content."""
    if not tokenizer.text_specials.size:  # (no tokenizer but an HF one has a framing)
        return False
    before, after = tokenizer.framing
    end = len(ids) - after - (0 if tokenizer.ends_with_eos else 1)  # (the separator EOS, appended)
    body = ids[before:end]
    found = body[np.isin(body, tokenizer.text_specials)]
    if tokenizer.unknown is not None and tokenizer.unknown[1] not in text:
        found = found[found != tokenizer.unknown[0]]
    return bool(found.size)


# Texts on which a tokenizer that transformers builds must encode as this package's does.
PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "two  spaces,   three, a tab\there\nand new\n\nlines\r\n",
    "  leading and trailing spaces  ",
    "caf\u00e9 na\u00efve \u00fc\u00df \u65e5\u672c\u8a9e \U0001f600 \ufb01 \u2460 x\u00a0y e\u0301",
    "digits 0123456789 3.14159 2024-01-01",
    "",
)


def autotokenizer_difference(tok, directory: pathlib.Path) -> str | None:
    """The first probe text that ``transformers.AutoTokenizer`` on ``directory`` encodes otherwise
    than ``tok`` (a tokenizer of this package's, read from files there), or None. transformers
    builds the tokenizer with the class ``tokenizer_config.json`` or ``config.json``'s model type
    names (``qwen2``: ``Qwen2Tokenizer``, with Qwen's pre-tokenizer in place of the file's).
    Raises ImportError without transformers."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    probes = list(PROBES)
    if isinstance(tok, HFTokenizer):  # special tokens inside a text are matched whole by both
        probes += [f"a{t}b {t}" for t in tok.settings["special_tokens"].values()]
    for text in probes:
        if list(hf.encode(text, verbose=False)) != list(tok.encode(text)):
            return text
    if hf.eos_token_id != tok.eos_id or hf.bos_token_id != tok.bos_id:
        return "<the EOS or BOS token>"
    return None


def autotokenizer_mismatch(tok) -> str | None:
    """For a ``tokenizer.json`` tokenizer: the probe text that ``AutoTokenizer`` on the file's
    directory encodes otherwise, where it does (its tokenizer class replaces the file's rules);
    None where it encodes alike, or transformers is missing or builds no tokenizer there."""
    if not isinstance(tok, HFTokenizer):
        return None
    try:
        return autotokenizer_difference(tok, tok.path.parent)
    except Exception:  # noqa: BLE001 - transformers missing, or no tokenizer it can build there
        return None


def tokenizer_option(spec: str):
    """:func:`make_tokenizer` for a command's ``--tokenizer`` option: its refusals name the option,
    not the config key ``data.tokenizer``."""
    try:
        return make_tokenizer(spec)
    except UserError as e:
        said = str(e)
        if said.startswith("data.tokenizer"):
            raise UserError("--tokenizer" + said.removeprefix("data.tokenizer")) from None
        raise UserError(f"--tokenizer: {said}") from None


def make_tokenizer(spec: str):
    """``bytes``, a Hugging Face ``tokenizer.json`` (a ``.json`` file or a directory holding one) or
    the path of a sentencepiece model."""
    if spec == "bytes":
        return ByteTokenizer()
    if not spec:
        raise UserError("data.tokenizer is empty: give bytes, a sentencepiece model or a tokenizer.json")
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path, from {pathlib.Path.cwd()})"
        raise UserError(f"data.tokenizer: {spec}: no such file or directory{where}")
    if path.is_dir() or path.name.endswith(".json"):
        return HFTokenizer(spec)
    return SentencePieceTokenizer(spec)


def tokenizer_path(spec: str) -> str | None:
    """The absolute path of a tokenizer ``spec`` (None for ``bytes``), which a run's summary
    records: its commands find the tokenizer from any directory, whatever ``data.tokenizer``
    was relative to."""
    return None if spec == "bytes" else str(pathlib.Path(spec).expanduser().resolve())


def describe_tokenizer(identity: dict) -> str:
    """One line naming a tokenizer identity (for errors that compare two)."""
    kind = identity.get("kind")
    if kind == "bytes":
        return "bytes (vocab 257)"
    sha, vocab = str(identity.get("sha256"))[:12], identity.get("vocab_size")
    if kind == "hf":
        settings = identity.get("settings") or {}
        eos = (settings.get("special_tokens") or {}).get("eos_token")
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
        eos = f"{eos!r} = {identity.get('eos_id')}"
        name = identity.get("name")
        return f"hf {name} (sha256 {sha}, vocab {vocab}, EOS {eos}, special-token settings {digest})"
    return f"sentencepiece {identity.get('name')} (sha256 {sha}, vocab {vocab})"


def file_sha256(path: pathlib.Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------ documents


@dataclass
class Counts:
    documents: int = 0
    skipped: dict = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".json")
TEXT_SUFFIXES = (".txt", ".raw")  # one document per file (.raw: WikiText's files)


def builtin_documents() -> list[str]:
    """English documentation text shipped inside CPython (``pydoc_data.topics``); offline."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def check_file(path: pathlib.Path) -> None:
    if path.is_dir():
        raise UserError(f"data file {path} is a directory (name its files, or a glob of them)")
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    if not path.name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES):
        kinds = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES)
        raise UserError(f"unsupported data file type: {path} (use {kinds}; .json as JSON lines)")


def _json_text(raw: bytes, counts: Counts) -> str | None:
    """The ``text`` of one JSON-lines record, or None (the reason counted) for a bad record."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        counts.skip("non_utf8")
        return None
    except json.JSONDecodeError:
        counts.skip("broken_json")
        return None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        counts.skip("missing_text")
    elif not text.strip():
        counts.skip("empty_text")
    elif b"\\u" in raw and not _encodable(text):
        counts.skip("lone_surrogate")  # an escape such as "\\ud83d" without its pair: no UTF-8 text
    else:
        return text
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lines(path: pathlib.Path, start: int, stop: int | None) -> Iterator[bytes]:
    """The lines of ``path`` (gzip-decompressed for ``.gz``); for a plain file, those starting in
    the byte range ``[start, stop)`` (range ends sit just after a newline, see ``line_ranges``)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                yield from f
            return
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            for line in f:
                if stop is not None and pos >= stop:
                    return
                pos += len(line)
                yield line
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged deflate stream
        raise UserError(f"cannot read data file {path}: {e}") from None


def line_ranges(path: pathlib.Path, chunk_bytes: int) -> list[tuple[int, int | None]]:
    """Splits a plain JSON-lines file into byte ranges of about ``chunk_bytes`` that start and
    end on line boundaries (a gzip file, a text file, which is one document, or a small one is one
    range)."""
    size = path.stat().st_size
    if path.suffix == ".gz" or path.name.endswith(TEXT_SUFFIXES) or size <= chunk_bytes:
        return [(0, None)]
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            f.seek(bounds[-1] + chunk_bytes)
            f.readline()
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    return [(a, b) for a, b in zip(bounds, bounds[1:] + [None], strict=True)]


def path_documents(
    path: pathlib.Path, counts: Counts, start: int = 0, stop: int | None = None
) -> Iterator[str]:
    """Documents of one file: a ``.txt`` or ``.raw`` file is one document; ``.jsonl``/``.jsonl.gz``/
    ``.json.gz`` hold one JSON object with a ``text`` field per line. Bad records are skipped and
    counted."""
    check_file(path)
    if path.name.endswith(TEXT_SUFFIXES):
        try:
            text = path.read_bytes().decode("utf-8-sig")  # without a byte-order mark
        except UnicodeDecodeError:
            counts.skip("non_utf8")
            return
        if text.strip():
            yield text
        else:
            counts.skip("empty_text")
        return
    for i, raw in enumerate(_lines(path, start, stop)):
        if i == 0 and start == 0:
            raw = raw.removeprefix(UTF8_BOM)
            if raw.lstrip().startswith(b"["):
                raise UserError(
                    f"data file {path} holds a JSON array; give JSON lines: one object with a "
                    '"text" field per line'
                )
        if raw.strip() and (text := _json_text(raw, counts)) is not None:
            yield text


UTF8_BOM = b"\xef\xbb\xbf"  # a byte-order mark some editors put first (no JSON, no text)


def file_documents(paths: Iterable[str], counts: Counts) -> Iterator[str]:
    """The documents of several files, in order."""
    for p in paths:
        yield from path_documents(pathlib.Path(p), counts)


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise UserError(
            "data.source is tfds but tensorflow-datasets is not installed: pip install 'moara-jax[tfds]'"
        ) from None
    return tfds


def tfds_split_info(name: str, split: str) -> tuple[int, str]:
    """The number of records of a prepared TFDS split and the dataset's version."""
    tfds = _tfds()
    try:
        info = tfds.builder(name).info
        return int(info.splits[split].num_examples), str(info.version)
    except Exception as e:  # noqa: BLE001 - TFDS raises many types for "not prepared"
        raise UserError(
            f"TFDS dataset {name!r} ({split}) is not available: {str(e).splitlines()[0]}"
        ) from None


def tfds_documents(name: str, split: str, start: int, stop: int) -> Iterator[str]:
    """Records ``[start, stop)`` of a prepared TFDS split: by random access when it is stored as
    array_record (``tfds.data_source``), else streamed from a sliced split (``split[a:b]``, which
    reads only the files that hold those records). Never the whole split."""
    tfds = _tfds()
    try:
        source = tfds.data_source(name, split=split, download=False)
    except Exception:  # noqa: BLE001 - e.g. a tfrecord dataset has no random-access source
        source = None
    if source is not None:
        records = (source[i] for i in range(start, stop))
    else:
        try:
            ds = tfds.load(name, split=f"{split}[{start}:{stop}]", download=False)
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"TFDS dataset {name!r} ({split}) is not available: {str(e).splitlines()[0]}"
            ) from None
        records = tfds.as_numpy(ds)
    for ex in records:
        text = ex["text"]
        yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)


def is_validation(text: str, fraction: float) -> bool:
    """The hash-based held-out split: a document's own bytes decide, not its position."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "little")
    return h % 1_000_000 < fraction * 1_000_000
