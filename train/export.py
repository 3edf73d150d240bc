"""``python -m train.export --run-dir R [--step N] --out DIR [--dtype D] [--tokenizer PATH]``:
a run's checkpoint as a Hugging Face model directory that ``transformers`` (and through it
lm-evaluation-harness or vLLM) loads: ``config.json``, ``generation_config.json``, safetensors
weights and, when the run used a sentencepiece model, the tokenizer files. Needs the ``[hf]``
extra (safetensors, transformers' config classes), not torch."""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import models
from train.checkpoint import read_params
from train.errors import IOFault, UserError, cli, io_operation
from train.rundir import RunDir
from train.sources import SentencePieceTokenizer


def write_tokenizer(tok, out: pathlib.Path, max_length: int) -> list[str]:
    """The ``transformers`` tokenizer files of a sentencepiece unigram model (T5's kind):
    ``spiece.model`` with a ``T5Tokenizer`` config that encodes as sentencepiece does and appends
    EOS, as the token store does after each document. Other models get no files (returned: [])."""
    if not isinstance(tok, SentencePieceTokenizer):
        return []
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise UserError(
            "exporting a sentencepiece tokenizer needs protobuf: pip install 'moara-jax[hf]'"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.path.read_bytes())
    if proto.trainer_spec.model_type != proto.trainer_spec.UNIGRAM:
        return []
    sp = tok._sp
    shutil.copyfile(tok.path, out / "spiece.model")
    pad = sp.pad_id() if sp.pad_id() >= 0 else tok.eos_id
    config = {
        "tokenizer_class": "T5Tokenizer",
        "extra_ids": 0,
        "eos_token": sp.id_to_piece(tok.eos_id),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "pad_token": sp.id_to_piece(pad),
        "model_max_length": max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["spiece.model", "tokenizer_config.json"]


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
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    run = RunDir(run_dir)
    model_cfg = run.model_config()
    tok = run.tokenizer(tokenizer)
    step, params = read_params(run_dir, step)
    try:
        with io_operation("exporting to", out):
            written, tokenizer_files = _write(out, run, model_cfg, tok, step, params, dtype, max_shard_bytes)
    except IOFault as e:
        raise e.with_note("the export there is incomplete: run the same command with --overwrite") from None
    return {**written, "step": step, "tokenizer_files": tokenizer_files, "tokenizer": tok.identity()}


def _write(out: pathlib.Path, run: RunDir, model_cfg, tok, step: int, params, dtype, max_shard_bytes: int):
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()  # --overwrite: no weights file of an earlier export may stay
    pad = tok._sp.pad_id() if isinstance(tok, SentencePieceTokenizer) else -1
    ids = {"bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": pad if pad >= 0 else None}
    try:
        written = models.write_hf_dir(
            out, model_cfg, params, dtype=dtype, max_shard_bytes=max_shard_bytes, token_ids=ids
        )
    except ImportError as e:
        raise UserError(str(e)) from None
    seq_len = run.setting("train", "seq_len") or model_cfg.max_position_embeddings
    tokenizer_files = write_tokenizer(tok, out, int(seq_len))
    provenance = {"run_dir": str(run.path.resolve()), "step": step, "model": model_cfg.name}
    (out / "training_run.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return written, tokenizer_files


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
    parser.add_argument("--tokenizer", default=None, help="the run's sentencepiece model, if it moved")
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest weights file (GB, 10^9 bytes)"
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    return cli(lambda: _export_and_report(args))


def _export_and_report(args) -> int:
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
    if done["tokenizer_files"]:
        print(f"tokenizer: {', '.join(done['tokenizer_files'])} (transformers.AutoTokenizer loads it)")
    elif done["tokenizer"]["kind"] == "bytes":
        print("tokenizer: none written (the run used the byte tokenizer: ids are UTF-8 bytes, EOS 256)")
    else:
        print("tokenizer: none written (only sentencepiece unigram models map onto a transformers tokenizer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
