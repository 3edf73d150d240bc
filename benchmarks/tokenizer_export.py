"""How exactly an exported sentencepiece tokenizer reproduces the run's encoding: the tokenizer
files ``train.export`` writes for a sentencepiece unigram model (its conversion to
``tokenizer.json``), loaded by ``transformers.AutoTokenizer``, against sentencepiece itself on
every document of some JSON-lines files. Prints the documents and tokens compared, the documents
encoded differently and, for each, the pieces where the two first part.

Usage:
  python benchmarks/tokenizer_export.py --tokenizer shared/data/spiece.model \\
      shared/data/c4_en_validation_sample2k.part1.jsonl shared/data/c4_en_train.00000-head1000.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
            pieces = sp._sp.id_to_piece
            differ.append(
                {
                    "document": documents - 1,
                    "tokens": [len(want), len(got)],
                    "sentencepiece": [pieces(i) for i in want[at : at + 4]],
                    "transformers": [pieces(i) for i in got[at : at + 4]],
                }
            )
    return {"documents": documents, "tokens": tokens, "documents_differing": len(differ), "differ": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a sentencepiece unigram model")
    parser.add_argument("paths", nargs="+", help="JSON-lines files with a text field")
    args = parser.parse_args()
    print(json.dumps(compare(args.tokenizer, args.paths), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
