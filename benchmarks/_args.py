"""Argument checks the benchmark scripts share: each refusal is argparse's one ``error:`` line
(exit 2), before any work."""

from __future__ import annotations

import argparse
import pathlib


def positive(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """An argparse ``type``: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def check_names(parser: argparse.ArgumentParser, flag: str, given, known) -> None:
    """Refuses names in ``given`` that are not ``known`` (a typo would run nothing and exit 0)."""
    unknown = [n for n in given or () if n not in known]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")


def check_micro_batches(parser: argparse.ArgumentParser, batch: int, micro_batches) -> None:
    """Refuses a micro-batch that does not divide the batch (it would be run as another one)."""
    for micro in micro_batches:
        if batch % micro:
            parser.error(f"--micro-batch {micro} does not divide --batch {batch}")


def check_out(parser: argparse.ArgumentParser, out: str | None) -> None:
    """Refuses an ``--out`` that is a directory or lies in none, before anything is timed."""
    if out is None:
        return
    path = pathlib.Path(out)
    if path.is_dir():
        parser.error(f"--out {out} is a directory: give a file path")
    if not path.parent.is_dir():
        parser.error(f"--out {out}: no directory {path.parent}")


def check_files(parser: argparse.ArgumentParser, paths) -> None:
    """Refuses input files that are not there, all named in one line, before any work."""
    missing = [p for p in paths if not pathlib.Path(p).is_file()]
    if missing:
        parser.error(f"no file {', '.join(missing)}")
