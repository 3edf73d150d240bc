"""The command-line options the commands share (argparse only, so a driver that imports them
does not import JAX)."""

from __future__ import annotations

import argparse


def add_config_arguments(
    parser: argparse.ArgumentParser, *, config: bool = True, required: bool = True
) -> None:
    """The ``--config`` (unless ``config`` is false) and ``--set`` options of the commands that
    load a run config, with one help text each."""
    if config:
        parser.add_argument(
            "--config",
            required=required,
            action="append",
            default=None if required else [],
            help="YAML run config (see configs/); repeat to layer files, later ones win",
        )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="set config keys, e.g. --set train.steps=100 mesh.fsdp=8 (repeatable); each value is YAML, "
        "and a section given as a mapping replaces the whole section",
    )
