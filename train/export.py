"""``python -m train.export --run-dir R [--step N] --out DIR [--dtype D] [--tokenizer PATH]``:
a run's checkpoint as a Hugging Face model directory that ``transformers`` (and through it
lm-evaluation-harness or vLLM) loads: ``config.json``, ``generation_config.json``, safetensors
weights and the tokenizer files (a run's ``tokenizer.json`` as it is; a sentencepiece unigram
or BPE model converted to one), which encode as the run did. Needs the ``[hf]`` extra (safetensors,
transformers, tokenizers), not torch."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys

import models
from train.checkpoint import read_params
from train.errors import IOFault, UserError, cli, io_operation
from train.rundir import RunDir, check_directory_path, make_directory
from train.sources import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    TOKENIZER_SUBDIR,
    HFTokenizer,
    SentencePieceTokenizer,
    autotokenizer_difference,
)

# transformers' generic tokenizer class: it encodes as tokenizer.json says (a model's own class may
# rebuild the pipeline, e.g. T5Tokenizer appends EOS to every encoding).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# tokenizer_config.json keys an export leaves out: flags that would change the post-processor,
# tokens beside tokenizer.json's own added tokens, remote code, file names.
DROPPED_CONFIG_KEYS = ("add_bos_token", "add_eos_token", "added_tokens_decoder", "auto_map", "tokenizer_file")
# What transformers reads as a tokenizer: an --overwrite removes an earlier export's first.
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    "spiece.model",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
)


def write_tokenizer(tok, out: pathlib.Path, max_length: int) -> tuple[list[str], str]:
    """The ``transformers`` tokenizer files of the run's tokenizer, with which
    ``AutoTokenizer.from_pretrained(out).encode(text)`` gives the ids the run trained on for
    ``text``, with no EOS appended (the EOS after each document is the store's packing, not part of
    a text's encoding), so lm-evaluation-harness scores the run's tokens. Checked here on a few
    texts; files that would encode otherwise are removed.

    transformers reads some model types' tokenizers with a class of its own whatever the files say
    (``qwen2``: ``Qwen2Tokenizer``, which puts Qwen's normalizer and pre-tokenizer in place of the
    file's): then, where that class would encode otherwise, the files go to ``out/tokenizer``
    (``TOKENIZER_SUBDIR``), a directory without the model's ``config.json``, which
    ``AutoTokenizer`` reads as the files say (the harness: ``tokenizer=out/tokenizer``). Returns
    the files (relative to ``out``) and a line for the user."""
    if not isinstance(tok, (HFTokenizer, SentencePieceTokenizer)):
        return [], "none written (the run used the byte tokenizer: ids are UTF-8 bytes, EOS 256)"
    files, why = _write_tokenizer_files(tok, out, max_length)
    if not files:
        return [], f"none written ({why})"
    differs = autotokenizer_difference(tok, out)
    if differs is None:
        return files, f"{', '.join(files)} (transformers.AutoTokenizer loads them and encodes as the run did)"
    for name in files:
        (out / name).unlink()
    apart = out / TOKENIZER_SUBDIR
    apart.mkdir()
    files, _ = _write_tokenizer_files(tok, apart, max_length)
    if autotokenizer_difference(tok, apart) is not None:
        shutil.rmtree(apart)
        return [], f"none written (transformers would encode {differs!r} otherwise than the run did)"
    return [f"{TOKENIZER_SUBDIR}/{name}" for name in files], (
        f"in {apart} (transformers.AutoTokenizer loads them from there and encodes as the run did; "
        f"from {out} it reads them with this model type's own tokenizer class, which would encode "
        f"{differs!r} otherwise): lm-evaluation-harness takes --model_args pretrained={out},tokenizer={apart}"
    )


def _write_tokenizer_files(tok, out: pathlib.Path, max_length: int) -> tuple[list[str], str]:
    if isinstance(tok, HFTokenizer):
        return _write_hf(tok, out, max_length), ""
    return _write_sentencepiece(tok, out, max_length)


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401 - only whether it is installed
    except ImportError:
        raise UserError(
            "the export writes the model's config and checks its tokenizer files with transformers, "
            "which is not installed: "
            "pip install 'moara-jax[hf]'"
        ) from None


def _write_hf(tok: HFTokenizer, out: pathlib.Path, max_length: int) -> list[str]:
    """``tokenizer.json`` as it is and its ``tokenizer_config.json`` with the generic class, its
    special tokens as the run read them, none of ``DROPPED_CONFIG_KEYS``, and the model's length
    as ``model_max_length``."""
    shutil.copyfile(tok.path, out / TOKENIZER_JSON)
    config = {k: v for k, v in tok.config.items() if k not in DROPPED_CONFIG_KEYS}
    config["tokenizer_class"] = TOKENIZER_CLASS
    config["model_max_length"] = max_length
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [TOKENIZER_JSON, TOKENIZER_CONFIG]


def sentencepiece_tokenizer_json(tok: SentencePieceTokenizer):
    """A ``tokenizers.Tokenizer`` that encodes as the sentencepiece model ``tok`` does (no
    post-processor: nothing appended), or the reason there is none. Sentencepiece's pipeline: its
    normalisation rule (the precompiled character map), extra whitespace removed, ``▁`` put first
    and for every space; then its model, unknown characters as UNK (a run of them as one) or as
    bytes with byte fallback:

    - unigram (T5's): the Viterbi segmentation over the pieces' scores, pieces never crossing a
      ``▁``; differs from sentencepiece where two segmentations tie (sentencepiece sums scores in
      float32 over the whole text, so rounding decides);
    - BPE (Llama 2's kind): merges of two pieces into a third, the one whose result scores highest
      first; differs from sentencepiece where two different results score the same (sentencepiece
      merges the leftmost pair first, the converted tokenizer the lower piece id).

    Either differs for a text holding a control piece literally (e.g. ``</s>``: transformers
    matches it as the special token). Models with user-defined or unused pieces, or whitespace as
    a suffix, are not converted."""
    try:
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    except ImportError:
        raise UserError(
            "exporting a sentencepiece tokenizer needs protobuf and tokenizers: pip install 'moara-jax[hf]'"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.path.read_bytes())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type not in (trainer.UNIGRAM, trainer.BPE):
        return None, "only sentencepiece unigram and BPE models are converted"
    unsupported = [
        name
        for name, on in (
            ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix),
            ("user-defined pieces", any(p.type == p.USER_DEFINED for p in proto.pieces)),
            ("unused pieces", any(p.type == p.UNUSED for p in proto.pieces)),
        )
        if on
    ]
    if unsupported:
        return None, f"the sentencepiece model uses {', '.join(unsupported)}, which are not converted"
    if trainer.model_type == trainer.UNIGRAM:
        model = models.Unigram(
            [(p.piece, p.score) for p in proto.pieces],
            unk_id=trainer.unk_id,
            byte_fallback=trainer.byte_fallback,
        )
    else:
        model = models.BPE(
            {p.piece: i for i, p in enumerate(proto.pieces)},
            _bpe_merges(proto),
            unk_token=proto.pieces[trainer.unk_id].piece,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    converted = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    converted.normalizer = normalizers.Sequence(steps)
    # Sentencepiece's BPE does not split at whitespace when encoding: a piece crosses a ``▁`` only
    # where the vocabulary has one that does (``▁▁``, a model trained with whitespace-only pieces).
    if trainer.split_by_whitespace and trainer.model_type == trainer.UNIGRAM:
        converted.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    converted.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return converted, ""


def _bpe_merges(proto) -> list[tuple[str, str]]:
    """A sentencepiece BPE model's pieces as ``tokenizers`` merges: every split of a normal piece
    into two pieces, ranked by the merged piece's score (highest first, as sentencepiece merges),
    then by the pieces' ids."""
    ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked = []
    for i, p in enumerate(proto.pieces):
        if p.type != p.NORMAL:
            continue
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in ids and right in ids:
                ranked.append((-p.score, i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _write_sentencepiece(tok: SentencePieceTokenizer, out: pathlib.Path, max_length: int):
    """``spiece.model`` (the run's file, for reference), its conversion to ``tokenizer.json`` and a
    generic-class ``tokenizer_config.json`` naming EOS, UNK and pad (no BOS: the run has none)."""
    converted, why = sentencepiece_tokenizer_json(tok)
    if converted is None:
        return [], why
    sp = tok.processor
    shutil.copyfile(tok.path, out / "spiece.model")
    converted.save(str(out / TOKENIZER_JSON))
    # A pad token for transformers' batches (the harness pads): EOS where the model has none of its
    # own (the model's config.json says pad_token_id null then).
    pad = tok.eos_id if tok.pad_id is None else tok.pad_id
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "eos_token": sp.id_to_piece(tok.eos_id),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "pad_token": sp.id_to_piece(pad),
        "model_max_length": max_length,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return ["spiece.model", TOKENIZER_JSON, TOKENIZER_CONFIG], ""


def export(
    run_dir,
    out,
    step: int | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> dict:
    """Writes checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out`` as a Hugging
    Face model directory; returns what was written."""
    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
    if dtype not in (None, "float32", "bfloat16"):
        raise UserError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    check_directory_path(out, "--out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    run = RunDir(run_dir)
    model_cfg = run.model_config()
    tok = run.tokenizer(tokenizer)
    source = getattr(tok, "path", None)
    if source is not None and out.resolve() in source.resolve().parents:  # DIR/tokenizer/ too
        raise UserError(
            f"--out {out} holds the run's tokenizer ({source}), which an export there would replace: "
            "choose another --out"
        )
    _require_transformers()  # before anything is written
    try:
        models.to_hf_config(model_cfg)
    except ValueError as e:
        raise UserError(f"{run.model_file}: {e}") from None
    step, params = read_params(run_dir, step, expected=models.abstract_params(model_cfg))
    make_directory(out, "--out", "exporting to")
    try:
        with io_operation("exporting to", out):
            trained_len = run.setting("train", "seq_len")
            written = _write_model(
                out, run, model_cfg, tok, step, params, dtype, max_shard_bytes, trained_len
            )
            # the model's limit, as its config says (a tokenizer.json's own may be far above it)
            limit = model_cfg.max_position_embeddings
            tokenizer_files, tokenizer_note = write_tokenizer(tok, out, limit)
            _write_card(out, model_cfg.name, run, step, tokenizer_files, tokenizer_note)
    except IOFault as e:
        raise e.with_note("the export there is incomplete: run the same command with --overwrite") from None
    return {
        **written,
        "step": step,
        "tokenizer_files": tokenizer_files,
        "tokenizer_note": tokenizer_note,
        "tokenizer": tok.identity(),
    }


def _write_model(
    out: pathlib.Path, run: RunDir, model_cfg, tok, step: int, params, dtype, max_shard_bytes: int, seq_len
):
    """The weights, configs and provenance (an earlier export's weights and tokenizer removed;
    ``seq_len``: the run's ``train.seq_len``)."""
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()  # --overwrite: no weights or tokenizer file of an earlier export may stay
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    if (out / TOKENIZER_SUBDIR).is_dir():
        shutil.rmtree(out / TOKENIZER_SUBDIR)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    try:
        written = models.write_hf_dir(
            out, model_cfg, params, dtype=dtype, max_shard_bytes=max_shard_bytes, token_ids=ids
        )
    except ImportError as e:
        raise UserError(str(e)) from None
    provenance = {
        "run_dir": str(run.path.resolve()),
        "step": step,
        "model": model_cfg.name,
        "seq_len": seq_len,
    }
    (out / "training_run.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return written


CARD_TITLE = "pretrained with moara-jax"  # the end of the card's first line: an export's card


def _write_card(out: pathlib.Path, name: str, run: RunDir, step: int, files: list[str], note: str) -> None:
    """``README.md`` (unless one not written by an export is there): where the model came from
    and how to load it and its tokenizer, which may be in ``tokenizer/`` (there ``AutoTokenizer``
    on the directory itself reads no tokenizer files: for ``qwen2``, without an error, a
    tokenizer that encodes every text as nothing)."""
    card = out / "README.md"
    if card.is_file() and not card.read_text(errors="replace").partition("\n")[0].endswith(CARD_TITLE):
        return  # the user's own (a model card of theirs): it stays
    apart = any(f.startswith(f"{TOKENIZER_SUBDIR}/") for f in files)
    where = f'"DIR/{TOKENIZER_SUBDIR}"' if apart else '"DIR"'
    lines = [
        f"# {name}, {CARD_TITLE}",
        "",
        f"Exported by `python -m train.export` from the run dir `{run.path.resolve()}` at step {step}",
        "(`training_run.json`).",
        "",
        "```python",
        "import transformers  # DIR: this directory",
        "",
        'model = transformers.AutoModelForCausalLM.from_pretrained("DIR")',
    ]
    if files:
        lines += [f"tokenizer = transformers.AutoTokenizer.from_pretrained({where})"]
    lines += ["```", "", f"Tokenizer: {note}."]
    if apart:
        lines += [
            "",
            f'The tokenizer is in `{TOKENIZER_SUBDIR}/`: `AutoTokenizer.from_pretrained("DIR")` finds no '
            "tokenizer files and returns a tokenizer that encodes every text as no ids. "
            f"lm-evaluation-harness: `--model_args pretrained=DIR,tokenizer=DIR/{TOKENIZER_SUBDIR}`.",
        ]
    card.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.export",
        description="Write a run's checkpoint as a Hugging Face model directory.",
    )
    parser.add_argument("--run-dir", required=True, help="the run dir of python -m train")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights dtype (default: the checkpoint's)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="the run's tokenizer (.model, tokenizer.json), if it moved"
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest weights file (GB, 10^9 bytes; default 5)"
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    return cli(lambda: _export_and_report(args))


def _export_and_report(args) -> int:
    if not 0 < args.max_shard_gb < math.inf:
        raise UserError(f"--max-shard-gb must be a positive number, got {args.max_shard_gb}")
    done = export(
        args.run_dir,
        args.out,
        args.step,
        args.dtype,
        args.tokenizer,
        int(args.max_shard_gb * 10**9),
        args.overwrite,
    )
    print(
        f"wrote {args.out}: step {done['step']}, {done['tensors']} tensors, {done['bytes'] / 1e6:.1f} MB "
        f"in {', '.join(f for f in done['files'] if f.endswith('.safetensors'))}"
    )
    print(f"tokenizer: {done['tokenizer_note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
