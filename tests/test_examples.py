"""The examples in ``examples/`` run as their docstrings say."""

import importlib.util
import pathlib
import re

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_nnx_example_allocates_ranks_by_its_labels_and_trains(capsys):
    """Its own layer names, through ``label_fn`` and ``matrix_axes``: ``query``/``key`` get half
    of ``r_base`` on the whole ``embed x (heads * head_dim)`` matrix, ``down`` twice it, and 40
    steps of MoARa Full bring the loss well down."""
    losses = _load("nnx_lm").main(["--steps", "40", "--log-every", "20", "--rank", "16"])
    out = capsys.readouterr().out
    ranks = dict(
        re.findall(
            r"\['(query|key|value|out|gate|up|down)'\]\['kernel'\]: \w+, matrix \(\d+, \d+\), rank (\d+)", out
        )
    )
    assert ranks == {
        "query": "8",
        "key": "8",
        "value": "16",
        "out": "16",
        "gate": "16",
        "up": "16",
        "down": "32",
    }
    assert "['attn']['query']['kernel']: q, matrix (64, 64)" in out  # (embed, heads, head_dim) as one matrix
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.5, losses
