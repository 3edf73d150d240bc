"""How exactly an exported sentencepiece tokenizer reproduces the run's encoding: the tokenizer
files ``train.export`` writes for a sentencepiece unigram or BPE model (its conversion to
``tokenizer.json``), loaded by ``transformers.AutoTokenizer``, against sentencepiece itself on
every document of some JSON-lines files. Prints the documents and tokens compared, the documents
encoded differently and, for each, the pieces where the two first part.

Usage:
  python benchmarks/tokenizer_export.py --tokenizer shared/data/spiece.model \\
      shared/data/c4_en_validation_sample2k.part1.jsonl shared/data/c4_en_train.00000-head1000.jsonl
  # a BPE model with Llama 2's settings, trained on one file and compared on others:
  python benchmarks/tokenizer_export.py --train-bpe shared/data/c4_en_train.00000-head1000.jsonl \\
      --vocab-size 8000 shared/data/c4_en_validation_sample2k.part0.jsonl \\
      shared/data/c4_en_validation_sample2k.part1.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _args import check_files, positive  # noqa: E402  (this script's folder: sys.path[0])

from train.export import write_tokenizer  # noqa: E402
from train.sources import Counts, SentencePieceTokenizer, file_documents  # noqa: E402


def compare(tokenizer: str, paths: list[str]) -> dict:
    import transformers

    sp = SentencePieceTokenizer(tokenizer)
    with tempfile.TemporaryDirectory() as out:
        files, note = write_tokenizer(sp, pathlib.Path(out), 1 << 20)
        if not files:
            raise SystemExit(f"no tokenizer written: {note}")
        hf = transformers.AutoTokenizer.from_pretrained(out)
    documents = tokens = 0
    differ = []
    for text in file_documents(paths, Counts()):
        want, got = sp.encode(text), hf.encode(text, verbose=False)
        documents += 1
        tokens += len(want)
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), len(want))
            pieces = sp.processor.id_to_piece
            differ.append(
                {
                    "document": documents - 1,
                    "tokens": [len(want), len(got)],
                    "sentencepiece": [pieces(i) for i in want[at : at + 4]],
                    "transformers": [pieces(i) for i in got[at : at + 4]],
                }
            )
    return {"documents": documents, "tokens": tokens, "documents_differing": len(differ), "differ": differ}


def train_bpe(corpus: str, vocab_size: int, prefix: pathlib.Path) -> str:
    """A sentencepiece BPE model with Llama 2's settings (byte fallback, digits apart,
    whitespace-only pieces, no normalisation; UNK 0, BOS 1, EOS 2) trained on ``corpus``'s texts."""
    import sentencepiece as spm

    text = prefix.with_suffix(".txt")
    text.write_text("\n".join(d.replace("\n", " ") for d in file_documents([corpus], Counts())))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=0.9995,
        minloglevel=2,
    )
    return str(prefix.with_suffix(".model"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", help="a sentencepiece unigram or BPE model")
    which.add_argument(
        "--train-bpe", metavar="JSONL", help="train a BPE model (Llama 2's settings) on this file"
    )
    parser.add_argument("--vocab-size", type=positive, default=8000, help="of the model --train-bpe trains")
    parser.add_argument("paths", nargs="+", help="JSON-lines files with a text field")
    args = parser.parse_args()
    check_files(parser, [args.tokenizer or args.train_bpe, *args.paths])
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = args.tokenizer or train_bpe(args.train_bpe, args.vocab_size, pathlib.Path(tmp) / "bpe")
        print(json.dumps(compare(tokenizer, args.paths), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
