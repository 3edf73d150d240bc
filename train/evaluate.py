"""``python -m train.evaluate (--run-dir R [--step N] | --hf DIR) [--ppl-files NAME=PATH,...]
[--tasks NAME=PATH,...] [--out DIR]``: the paper's kind of final evaluation.

- **Perplexity** of text files (``.txt`` or ``.raw`` as one document, ``.jsonl``, ``.jsonl.gz``,
  ``.json.gz`` with a ``text`` field, as the data section reads them) packed as training packs
  them: every document's tokens followed by EOS, one stream cut into windows of
  ``seq_len + 1``; each window predicts its last ``seq_len`` tokens. The tail shorter than a
  window is scored too, so every token but the first of each window counts.
- **Zero-shot multiple choice** on local JSONL tasks, one ``{"context", "choices", "label"}``
  per line, scored as lm-evaluation-harness scores them: each choice is the continuation
  ``target_delimiter + choice`` of the context, encoded as the harness' ``HFLM`` encodes it
  (``encode_pair``), truncated on the left to ``seq_len + 1`` tokens; ``acc`` takes the choice of largest
  summed log-likelihood, ``acc_norm`` the largest log-likelihood per character of the choice.

Rows are batched by length (padded to powers of two, so a few shapes compile) and sharded over
the mesh's data axes; parameters are placed as in training (read sharded from the checkpoint or
the safetensors files). Writes ``eval.json``, ``eval.md`` and, per task, each example's scores
(``scores-NAME.jsonl``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import pathlib
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import jax
import numpy as np

import models
from train.config import MeshSection
from train.errors import UserError, cli, io_operation
from train.metrics import perplexity
from train.rundir import EVAL, RunDir, check_directory_path, make_directory
from train.sharding import make_mesh, param_shardings
from train.sources import (
    TOKENIZER_SUBDIR,
    Counts,
    autotokenizer_mismatch,
    check_file,
    document_tokens,
    file_documents,
    make_tokenizer,
    tokenizer_option,
)

MIN_BUCKET = 16
# Batches dispatched before the oldest is read back (Scorer.score).
IN_FLIGHT = 2


def sequence_logprobs(
    model_cfg: models.ModelConfig, params, tokens: jax.Array, weights: jax.Array
) -> jax.Array:
    """``sum_t weights[b, t] * log p(tokens[b, t + 1] | tokens[b, :t + 1])`` per row ``b`` (the
    LM head in chunks of ``model_cfg.loss_chunk`` positions where set, as in training)."""
    nll = models.token_nll(model_cfg, params, tokens[:, :-1], tokens[:, 1:])
    return -(nll * weights).sum(-1)


@dataclass
class Scorer:
    """Scores rows (token sequences, each with the positions that count) in length-sorted,
    padded batches sharded over the mesh's ``data x fsdp`` devices."""

    model_cfg: models.ModelConfig
    params: dict
    mesh: jax.sharding.Mesh
    batch_size: int
    max_len: int  # seq_len + 1

    def __post_init__(self):
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.rows = -(-self.batch_size // shards) * shards
        spec = jax.sharding.PartitionSpec(("data", "fsdp"), None)
        self.sharding = jax.sharding.NamedSharding(self.mesh, spec)
        self._score = jax.jit(functools.partial(sequence_logprobs, self.model_cfg))

    def _bucket(self, n: int) -> int:
        return min(self.max_len, max(MIN_BUCKET, 1 << (n - 1).bit_length()))

    def score(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """``rows``: ``(tokens (T,), weights (T - 1,))`` with ``T <= max_len``; returns each row's
        weighted log-likelihood (float64), in the given order."""
        out = np.zeros(len(rows))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        # Batches in flight, read back a few behind: the host pads the next batch while the
        # device scores this one, instead of waiting for each result in turn.
        pending: collections.deque = collections.deque()
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            width = self._bucket(len(rows[chunk[0]][0]))
            tokens = np.zeros((self.rows, width), np.int32)
            weights = np.zeros((self.rows, width - 1), np.float32)
            for j, i in enumerate(chunk):
                t, w = rows[i]
                tokens[j, : len(t)] = t
                weights[j, : len(w)] = w
            tokens, weights = (jax.device_put(x, self.sharding) for x in (tokens, weights))
            pending.append((chunk, self._score(self.params, tokens, weights)))
            if len(pending) > IN_FLIGHT:
                self._read(out, *pending.popleft())
        while pending:
            self._read(out, *pending.popleft())
        return out

    @staticmethod
    def _read(out: np.ndarray, chunk: list[int], scores: jax.Array) -> None:
        out[chunk] = np.asarray(scores)[: len(chunk)]


def packed_rows(stream: np.ndarray, window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Training's packing: consecutive windows of ``window`` tokens, the tail (2 tokens or more)
    as a shorter last row; every position of a row but its first is a target."""
    rows = []
    for start in range(0, len(stream), window):
        piece = stream[start : start + window]
        if len(piece) >= 2:
            rows.append((piece, np.ones(len(piece) - 1, np.float32)))
    return rows


def token_stream(paths: list[str], tokenizer) -> tuple[np.ndarray, Counts, dict[str, int]]:
    """Every document's tokens followed by EOS, as one stream; the documents read and the
    records skipped (``Counts``); and the texts' size (``bytes``: UTF-8; ``words``: the pieces
    whitespace separates, as lm-evaluation-harness counts them), which figures of different
    tokenizers compare on."""
    counts, size = Counts(), {"bytes": 0, "words": 0}
    for p in paths:
        check_file(pathlib.Path(p))
    parts, batch = [], []

    def flush():
        parts.extend(document_tokens(tokenizer, batch))
        batch.clear()

    for text in file_documents(paths, counts):
        batch.append(text)
        counts.documents += 1
        size["bytes"] += len(text.encode("utf-8"))
        size["words"] += len(re.split(r"\s+", text))  # lm-evaluation-harness' count (its edges count)
        if len(batch) == 256:
            flush()
    flush()
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), counts, size


def text_perplexity(scorer: Scorer, paths: list[str], tokenizer) -> dict:
    """Perplexity of the texts of ``paths`` (capped at ``exp(50)`` as the training curve's, so a
    diverged model's loss stays a number; ``skipped``: the records that held no text, by reason,
    as a token store counts them).

    Per token, models of different tokenizers do not compare; per byte and per word of the texts
    they do: the mean loss of the scored tokens times the texts' tokens (``text_tokens``, the
    tokenizer's special tokens and each document's EOS included; the first of each window is not
    scored) per UTF-8 byte gives ``bits_per_byte`` and ``byte_perplexity``, per word (as the
    harness counts them) ``word_perplexity`` (lm-evaluation-harness' definitions; its rolling
    windows score every token of a document apart, and not its EOS, so its figures differ by
    what those tokens add)."""
    stream, counts, size = token_stream(paths, tokenizer)
    rows = packed_rows(stream, scorer.max_len)
    if not rows:
        raise UserError(f"{', '.join(paths)}: no tokens to score")
    count = int(sum(len(w) for _, w in rows))
    loss = -float(scorer.score(rows).sum()) / count
    nll = loss * len(stream)  # the texts' whole, at the scored tokens' mean
    return {
        "ppl": perplexity(loss),
        "loss": loss,
        "tokens": count,
        "text_tokens": len(stream),
        **size,
        "bits_per_byte": nll / size["bytes"] / math.log(2) if size["bytes"] else None,
        "byte_perplexity": perplexity(nll / size["bytes"]) if size["bytes"] else None,
        "word_perplexity": perplexity(nll / size["words"]) if size["words"] else None,
        "documents": counts.documents,
        "skipped": counts.skipped,
        "windows": len(rows),
    }


def read_task(path: str) -> list[dict]:
    """The examples of a JSONL task; a ``UserError`` naming the file, line and problem."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise UserError(f"task file {path} is a directory (one JSONL file per task)")
    if not p.is_file():
        raise UserError(f"task file not found: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"task file {path} is not UTF-8 text") from None
    examples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{n}: not a JSON object") from None
        context, choices, label = (
            record.get(k) if isinstance(record, dict) else None for k in ("context", "choices", "label")
        )
        if not isinstance(context, str):
            raise UserError(f"{path}:{n}: 'context' must be a string")
        if not (
            isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
        ):
            raise UserError(f"{path}:{n}: 'choices' must be a list of two or more non-empty strings")
        if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(choices)):
            raise UserError(
                f"{path}:{n}: 'label' must be the index of the right choice (0 to {len(choices) - 1})"
            )
        examples.append({"context": context, "choices": choices, "label": label})
    if not examples:
        raise UserError(f"task file {path} holds no examples")
    return examples


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as lm-evaluation-harness' ``HFLM`` makes them (0.4): trailing
    spaces of the context move to the continuation; the context alone and the pair are encoded
    with the tokenizer's special tokens (e.g. a Llama 3 BOS; none for a string that already starts
    with the prefix token) and the context's tokens cut off the pair's. An empty context is the
    prefix token (BOS, else EOS) before the continuation encoded without special tokens."""
    prefix = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
    if context == "":
        tokens = list(tokenizer.encode(continuation, add_special_tokens=False))
        return (tokens[:1], tokens[1:]) if tokens[:1] == [prefix] else ([prefix], tokens)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    prefix_text = tokenizer.decode([prefix])

    def encode(text):
        return list(tokenizer.encode(text, add_special_tokens=not text.startswith(prefix_text)))

    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head) :]


def choice_rows(
    tokenizer, example: dict, max_len: int, delimiter: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    rows = []
    for choice in example["choices"]:
        context, continuation = encode_pair(tokenizer, example["context"], delimiter + choice)
        tokens = np.asarray((context + continuation)[-max_len:], np.int64)
        weights = np.zeros(len(tokens) - 1, np.float32)
        weights[len(weights) - min(len(continuation), len(weights)) :] = 1
        rows.append((tokens, weights))
    return rows


def _stderr(hits: np.ndarray) -> float:
    return float(np.std(hits, ddof=1) / math.sqrt(len(hits))) if len(hits) > 1 else 0.0


def multiple_choice(scorer: Scorer, path: str, tokenizer, delimiter: str = " ") -> tuple[dict, list[dict]]:
    """``acc``, ``acc_norm`` (with standard errors) and each example's scores."""
    examples = read_task(path)
    rows = [row for ex in examples for row in choice_rows(tokenizer, ex, scorer.max_len, delimiter)]
    scores = scorer.score(rows)
    per_example, acc, acc_norm = [], [], []
    at = 0
    for ex in examples:
        lls = scores[at : at + len(ex["choices"])]
        at += len(ex["choices"])
        lengths = np.asarray([float(len(c)) for c in ex["choices"]])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
        acc.append(pred == ex["label"])
        acc_norm.append(pred_norm == ex["label"])
        per_example.append(
            {"loglikelihoods": lls.tolist(), "label": ex["label"], "pred": pred, "pred_norm": pred_norm}
        )
    acc, acc_norm = np.asarray(acc, float), np.asarray(acc_norm, float)
    result = {
        "n": len(examples),
        "acc": float(acc.mean()),
        "acc_stderr": _stderr(acc),
        "acc_norm": float(acc_norm.mean()),
        "acc_norm_stderr": _stderr(acc_norm),
    }
    return result, per_example


def _is_name(text: str) -> bool:
    return text.replace("-", "").replace("_", "").replace(".", "").isalnum()


def parse_named(text: str | None, what: str) -> dict[str, list[str]]:
    """``name=PATH[+PATH...],name=PATH`` (a bare PATH, with no ``=``, is named after its file).
    The name ends at the first ``=``, so paths may hold ``=`` (``r=/data/lang=en/r.txt``)."""
    out: dict[str, list[str]] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, paths = item.partition("=")
        if not sep:
            name, paths = "", item
        paths_list = [p for p in paths.split("+") if p]
        if not paths_list:
            raise UserError(f"{what}: {item!r} names no file")
        name = name or pathlib.Path(paths_list[0]).name.split(".")[0]
        if not _is_name(name):
            raise UserError(
                f"{what}: name {name!r} must be letters, digits, '-', '_' or '.' (a path with '=' in it "
                "needs a name: NAME=PATH)"
            )
        if name in out:
            join = " (join files under one name with '+')" if what == "--ppl-files" else ""
            raise UserError(f"{what}: the name {name!r} is given twice{join}")
        out[name] = paths_list
    return out


def _hf_tokenizer(directory: pathlib.Path, override: str | None):
    """The tokenizer of a model directory: its ``tokenizer.json`` (what ``AutoTokenizer``, and so
    lm-evaluation-harness, reads, through the class ``tokenizer_config.json`` or the model type
    names: a warning where that encodes otherwise), else its sentencepiece model."""
    if override:
        return tokenizer_option(override)
    if (directory / "tokenizer.json").is_file():
        tok = make_tokenizer(str(directory / "tokenizer.json"))
        _warn_if_the_harness_reads_it_otherwise(tok, directory)
        return tok
    for name in ("spiece.model", "tokenizer.model"):
        if (directory / name).is_file():
            return _converted(directory) or make_tokenizer(str(directory / name))
    if (directory / TOKENIZER_SUBDIR / "tokenizer.json").is_file():  # where train.export put one apart
        return make_tokenizer(str(directory / TOKENIZER_SUBDIR / "tokenizer.json"))
    raise UserError(
        f"{directory} holds no tokenizer (tokenizer.json, spiece.model or tokenizer.model): pass "
        "--tokenizer PATH (or bytes)"
    )


def _warn_if_the_harness_reads_it_otherwise(tok, directory: pathlib.Path) -> None:
    """A warning where ``AutoTokenizer`` (what lm-evaluation-harness reads) encodes otherwise
    than the directory's ``tokenizer.json`` says (``train.sources.autotokenizer_mismatch``): the
    harness would score other ids than this evaluation."""
    text = autotokenizer_mismatch(tok)
    if text is not None:
        warnings.warn(
            f"{directory}: transformers.AutoTokenizer, which lm-evaluation-harness reads, encodes "
            f"{text!r} otherwise than its tokenizer.json, which this evaluation reads (the "
            "tokenizer class its tokenizer_config.json or model type names replaces the file's "
            "rules): the harness would score other tokens. To score the file's in both, put "
            "tokenizer.json in a directory of its own with a tokenizer_config.json whose "
            "tokenizer_class is PreTrainedTokenizerFast (as train.export writes them) and pass it "
            "to both (--tokenizer here, tokenizer= in the harness's --model_args)",
            stacklevel=2,
        )


def _converted(directory: pathlib.Path):
    """A directory with a sentencepiece model and a ``tokenizer_config.json`` but no
    ``tokenizer.json`` (Llama 2 style): the tokenizer ``AutoTokenizer`` builds from it, the one
    lm-evaluation-harness scores with (for ``LlamaTokenizer`` it puts BOS first, which the bare
    sentencepiece model does not), written out as a ``tokenizer.json`` and read from there. None
    when transformers is missing or makes no such tokenizer of it."""
    if not (directory / "tokenizer_config.json").is_file():
        return None
    try:
        import transformers

        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # noqa: BLE001 - not installed, or a tokenizer it cannot build
        return None
    if getattr(hf, "backend_tokenizer", None) is None:
        return None
    held = tempfile.TemporaryDirectory(prefix="moara-tokenizer-")
    hf.save_pretrained(held.name)
    if not (pathlib.Path(held.name) / "tokenizer.json").is_file():
        held.cleanup()
        return None
    tokenizer = make_tokenizer(str(pathlib.Path(held.name) / "tokenizer.json"))
    tokenizer.held = held  # its files live as long as it does
    return tokenizer


def _trained_len(directory: pathlib.Path) -> int | None:
    """The ``train.seq_len`` an export's run trained at (its ``training_run.json``), where it is
    one: scored at it, as the run evaluated, an export gives the run's perplexity."""
    try:
        seq_len = json.loads((directory / "training_run.json").read_text()).get("seq_len")
    except (OSError, ValueError, AttributeError):
        return None
    return seq_len if isinstance(seq_len, int) and seq_len > 0 else None


@dataclass(frozen=True)
class LoadedModel:
    """A model to evaluate: its config, sharded parameters, tokenizer, the sequence length it
    is scored at by default, and a description for the report."""

    config: models.ModelConfig
    params: dict
    tokenizer: object
    seq_len: int
    source: str


def load_model(
    mesh,
    *,
    run_dir: str | None = None,
    hf: str | None = None,
    step: int | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
) -> LoadedModel:
    """Checkpoint ``step`` (default: the newest) of ``run_dir``, or the Hugging Face directory
    ``hf``, on ``mesh`` (``dtype``: its parameters and compute in it; ``tokenizer``: another
    than the model's)."""
    dtypes = {"param_dtype": dtype, "dtype": dtype} if dtype else {}
    if hf:
        directory = pathlib.Path(hf)
        try:
            dtypes = {"param_dtype": "float32", "dtype": "float32"} | dtypes
            cfg = models.read_hf_config(directory, **dtypes)
        except (ImportError, ValueError) as e:
            raise UserError(f"--hf: {e}") from None
        shardings = param_shardings(models.logical_axes(cfg), models.abstract_params(cfg), mesh)
        try:
            params = models.load_hf_params(directory, cfg, shardings)
        except (ImportError, ValueError) as e:
            raise UserError(f"--hf: {e}") from None
        seq_len = _trained_len(directory) or min(cfg.max_position_embeddings, 2048)
        return LoadedModel(cfg, params, _hf_tokenizer(directory, tokenizer), seq_len, str(directory))
    from train.checkpoint import read_params

    run = RunDir(run_dir)
    cfg = run.model_config().replace(**dtypes)
    abstract = models.abstract_params(cfg)
    shardings = param_shardings(models.logical_axes(cfg), abstract, mesh)
    step, params = read_params(run, step, shardings, expected=abstract)
    if dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    seq_len = int(run.setting("train", "seq_len") or cfg.max_position_embeddings)
    return LoadedModel(cfg, params, run.tokenizer(tokenizer), seq_len, f"{run} step {step}")


def markdown(report: dict) -> str:
    lines = [f"# Evaluation of {report['model']}", "", f"seq_len {report['seq_len']}", ""]
    if report["perplexity"]:
        lines += ["| text | tokens | loss | ppl | bits per byte |", "|---|---:|---:|---:|---:|"]
        for name, r in report["perplexity"].items():
            bpb = "-" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.4f}"
            lines.append(f"| {name} | {r['tokens']:,} | {r['loss']:.4f} | {r['ppl']:.2f} | {bpb} |")
        lines.append("")
        for name, r in report["perplexity"].items():
            if r["skipped"]:
                lines += [f"{name}: {sum(r['skipped'].values()):,} input records skipped: {r['skipped']}", ""]
    if report["tasks"]:
        lines += ["| task | n | acc | acc_norm |", "|---|---:|---:|---:|"]
        for name, r in report["tasks"].items():
            lines.append(
                f"| {name} | {r['n']} | {r['acc']:.4f} ± {r['acc_stderr']:.4f} | "
                f"{r['acc_norm']:.4f} ± {r['acc_norm_stderr']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def evaluate(
    *,
    run_dir: str | None = None,
    hf: str | None = None,
    step: int | None = None,
    ppl_files: str | None = None,
    tasks: str | None = None,
    target_delimiter: str = " ",
    seq_len: int | None = None,
    batch_size: int = 32,
    tokenizer: str | None = None,
    dtype: str | None = None,
    fsdp: int = 1,
    tensor: int = 1,
    out: str | None = None,
    overwrite: bool = False,
) -> dict:
    """``python -m train.evaluate`` (each keyword is its option): writes ``eval.json``, ``eval.md``
    and each task's ``scores-NAME.jsonl`` to ``out`` and returns the report with ``out``."""
    if bool(run_dir) == bool(hf):
        raise UserError("give one of --run-dir and --hf")
    if hf and step is not None:
        raise UserError("--step picks a checkpoint of --run-dir; an --hf directory has one set of weights")
    if run_dir and not pathlib.Path(run_dir).is_dir():  # before --out is made in it
        there = pathlib.Path(run_dir).exists()
        raise UserError(f"run dir {run_dir}: {'not a directory' if there else 'no such directory'}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    texts, task_files = parse_named(ppl_files, "--ppl-files"), parse_named(tasks, "--tasks")
    if not texts and not task_files:
        raise UserError("nothing to evaluate: give --ppl-files and/or --tasks")
    for name, paths in task_files.items():
        if len(paths) != 1:
            raise UserError(f"--tasks {name}: one JSONL file per task")
        read_task(paths[0])  # a bad task file fails before the model loads
    out = pathlib.Path(out or (pathlib.Path(run_dir) / EVAL if run_dir else EVAL))
    check_directory_path(out, "--out")
    if (out / "eval.json").exists() and not overwrite:
        raise UserError(f"{out} holds an evaluation (eval.json); choose another --out or pass --overwrite")
    make_directory(out, "--out", "writing the evaluation to")
    mesh = make_mesh(MeshSection(data=-1, fsdp=fsdp, tensor=tensor))
    model = load_model(mesh, run_dir=run_dir, hf=hf, step=step, tokenizer=tokenizer, dtype=dtype)
    model_cfg, tok = model.config, model.tokenizer
    seq_len = model.seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= model_cfg.max_position_embeddings:
        raise UserError(f"--seq-len must be in [1, {model_cfg.max_position_embeddings}], got {seq_len}")
    if tok.vocab_size > model_cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids, the model {model_cfg.vocab_size}")
    scorer = Scorer(model_cfg, model.params, mesh, batch_size, seq_len + 1)
    with io_operation("writing the evaluation to", out):  # --overwrite: no file of the last one stays
        for stale in [out / "eval.json", out / "eval.md", *out.glob("scores-*.jsonl")]:
            stale.unlink(missing_ok=True)
    report = {
        "model": model.source,
        "seq_len": seq_len,
        "tokenizer": tok.identity(),
        "perplexity": {},
        "tasks": {},
    }
    started = time.perf_counter()
    for name, paths in texts.items():
        report["perplexity"][name] = {**text_perplexity(scorer, paths, tok), "files": paths}
    for name, (path,) in task_files.items():
        result, per_example = multiple_choice(scorer, path, tok, target_delimiter)
        report["tasks"][name] = {**result, "file": path}
        with io_operation("writing the evaluation to", out), open(out / f"scores-{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in per_example)
    report["wall_s"] = time.perf_counter() - started
    with io_operation("writing the evaluation to", out):
        (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "eval.md").write_text(markdown(report))
    return {**report, "out": str(out)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description="Text perplexity and zero-shot multiple-choice accuracy of a run or an HF model.",
    )
    parser.add_argument("--run-dir", help="a run dir of python -m train (its newest checkpoint, or --step)")
    parser.add_argument(
        "--step", type=int, default=None, help="the checkpoint of --run-dir (default: the newest)"
    )
    parser.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--ppl-files", help="NAME=PATH[+PATH...],... text files whose perplexity to report")
    parser.add_argument("--tasks", help='NAME=PATH,... JSONL tasks: {"context", "choices", "label"} per line')
    parser.add_argument(
        "--target-delimiter", default=" ", help="put between context and choice (default: a space)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens a window predicts (default: the run's train.seq_len; with --hf, the seq_len "
        "of an export's training_run.json, else the model's max_position_embeddings, at most 2048)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="rows per step, over all devices (default 32)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json (or its directory), a sentencepiece model or bytes (default: the model's)",
    )
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="parameter and compute dtype"
    )
    parser.add_argument("--fsdp", type=int, default=1, help="mesh fsdp axis (the rest is data)")
    parser.add_argument("--tensor", type=int, default=1, help="mesh tensor axis")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/eval or ./eval)")
    parser.add_argument("--overwrite", action="store_true", help="replace an evaluation in --out")
    args = parser.parse_args(argv)
    return cli(lambda: _evaluate_and_report(args))


def _evaluate_and_report(args) -> int:
    report = evaluate(**vars(args))
    print(markdown(report))
    print(f"wrote {report['out']}/eval.json and eval.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
