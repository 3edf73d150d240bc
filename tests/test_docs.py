"""The README's Python example and the docstring examples of ``moara_jax`` run as written; the links
between the README and ``docs/`` lead somewhere."""

import doctest
import importlib
import inspect
import json
import pathlib
import pkgutil
import re
import warnings

import pytest

import moara_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


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


def _outside_code(text: str) -> str:
    """The Markdown outside fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to hyphens, ``-1``, ``-2``... after a repeated one."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_the_anchor_rule_is_githubs():
    """Anchors GitHub is known to make from such headings (code spans and punctuation dropped)."""
    page = _anchors(ROOT / "docs" / "training.md")
    assert {"training-python--m-train", "the-code-map-of-train", "profiling-mode-profile"} <= page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_the_pages_lead_to_a_file_and_heading_there(page):
    links = re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text()))
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local or page != README, "the README links to no page of docs/"
    broken = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and anchor not in _anchors(target):
            broken.append(f"{link}: no heading {anchor!r} in {target.relative_to(ROOT)}")
    assert not broken, broken


def test_the_readme_links_every_page_of_docs():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    pages = {str(p.relative_to(ROOT)) for p in PAGES[1:]}
    assert pages and pages <= linked, sorted(pages - linked)


def _public_functions() -> list[str]:
    return sorted(
        n for n in moara_jax.__all__ if callable(f := getattr(moara_jax, n)) and not inspect.isclass(f)
    )


@pytest.mark.parametrize("name", _public_functions())
def test_a_public_function_documents_each_argument_and_what_it_returns(name):
    """Every function of ``moara_jax.__all__`` has ``Args:`` naming each of its parameters (alone
    or in a group: ``b1, b2, eps: ...``) and ``Returns:``, as optax's public functions do."""
    function = getattr(moara_jax, name)
    doc = inspect.getdoc(function) or ""
    assert "Returns:" in doc, f"{name}: no Returns section"
    parameters = [p for p in inspect.signature(function).parameters if p not in ("self", "args", "kwargs")]
    if not parameters:
        return
    assert "Args:" in doc, f"{name}: no Args section"
    args = doc.split("Args:", 1)[1]
    args = re.split(r"^(?:Returns|Raises|References|Example|Examples):", args, flags=re.M)[0]
    named = set(re.findall(r"^ {2}(\*{0,2}\w+(?:, \*{0,2}\w+)*):", args, flags=re.M))
    named = {n.lstrip("*") for group in named for n in group.split(", ")}
    assert not set(parameters) - named, f"{name}: Args does not name {sorted(set(parameters) - named)}"


@pytest.mark.slow
def test_the_documented_tokenizer_recipe_makes_one_a_run_trains_with(tmp_path, monkeypatch):
    """``docs/training.md``'s ``tokenizer.json`` recipe, run as written on a corpus of text files:
    its tokenizer encodes with EOS last, and ``python -m train`` trains on the corpus with it."""
    pytest.importorskip("tokenizers")
    from train.__main__ import main
    from train.sources import builtin_documents, document_tokens, make_tokenizer

    (recipe,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "training.md").read_text(), flags=re.S)
        if "BpeTrainer" in b
    ]
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(builtin_documents()[:60]):
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    exec(compile(recipe, "docs/training.md", "exec"), {})  # noqa: S102
    tokenizer = make_tokenizer("my-tokenizer")
    (ids,) = document_tokens(tokenizer, ["The quick brown fox."])
    assert ids[-1] == tokenizer.eos_id == tokenizer._tok.token_to_id("<|endoftext|>")
    assert 257 < tokenizer.vocab_size <= 2000 and tokenizer.decode(ids[:-1]) == "The quick brown fox."
    sets = ["data.source=files", "data.paths=[corpus/*.txt]", "data.tokenizer=my-tokenizer", "train.steps=2"]
    sets += ["train.batch_size=4", "train.seq_len=32", "train.eval_every=2", "train.eval_batches=1"]
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", "run", "--quiet"]
    assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["tokenizer"]["kind"] == "hf" and summary["status"] == "completed"
