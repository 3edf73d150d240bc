"""The README's Python example and the docstring examples of ``moara_jax`` run as written."""

import doctest
import importlib
import pathlib
import pkgutil
import re
import warnings

import pytest

import moara_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    """The first example runs with no warning, and its ranks are the ones the README states
    after it (the paper's allocation: q and k r/2, down 2r)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    assert "params" in namespace and "state" in namespace
    ranks = {r["module"]: r["requested"] for r in moara_jax.rank_table(namespace["params"], r_base=64)}
    stated = re.search(r"Here q and k get rank (\d+) and down (\d+)", README.read_text())
    r = 64  # the example's r_base
    assert ranks == {"q": r // 2, "k": r // 2, "down": 2 * r}
    assert (ranks["q"], ranks["down"]) == (int(stated[1]), int(stated[2]))


@pytest.mark.parametrize("name", [m.name for m in pkgutil.iter_modules(moara_jax.__path__)])
def test_docstring_examples(name):
    module = importlib.import_module(f"moara_jax.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
