"""The README's Python example and the docstring examples of ``moara_jax`` run as written."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import moara_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    assert "params" in namespace and "state" in namespace


@pytest.mark.parametrize("name", [m.name for m in pkgutil.iter_modules(moara_jax.__path__)])
def test_docstring_examples(name):
    module = importlib.import_module(f"moara_jax.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
