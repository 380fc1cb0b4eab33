"""Every Python example in the docs runs, and prints what the page says it prints.

Conventions for docs/**/*.md (docs/index.md says them to writers too):

- A fenced ```python block runs. The blocks of one page run in order in one namespace,
  as a reader would type them into one session.
- A block written with `>>>` prompts runs as a doctest: each output shown must match
  (`...` matches anything; whitespace differences are ignored).
- A ```text title="Output"``` block is the expected standard output of the python block
  before it (prose may come between, no other code block), compared line by line
  (trailing spaces ignored).
- `<!-- skip: why -->` on the line before the fence keeps a block from running (it needs
  torchrun, a GPU, another machine); the reason is required.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

_BLOCK = re.compile(
    r"^(?P<marker><!--(?P<comment>[^>]*)-->\n)?```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclasses.dataclass
class Block:
    """One fenced code block of a page."""

    info: str
    body: str
    line: int
    skip: str | None
    output: str | None = None


def blocks(page: Path) -> list[Block]:
    """The python blocks of `page`, each with its expected output (if the page gives one)."""
    text = page.read_text()
    found: list[Block] = []
    previous: Block | None = None
    for match in _BLOCK.finditer(text):
        info = match.group("info").strip()
        line = text.count("\n", 0, match.start("info")) + 1
        comment = (match.group("comment") or "").strip()
        skip_match = re.fullmatch(r"skip(?::(.*))?", comment, re.DOTALL)
        skip = (skip_match.group(1) or "").strip() if skip_match else None
        if skip is not None and not skip:
            raise AssertionError(f"{page.name}:{line}: `<!-- skip: why -->` needs a reason")
        if info.startswith("text") and 'title="Output"' in info:
            if previous is None:
                raise AssertionError(
                    f"{page.name}:{line}: an Output block must follow a python block"
                )
            previous.output = match.group("body")
        elif info == "python" or info.startswith("python "):
            previous = Block(info, match.group("body"), line, skip)
            found.append(previous)
        else:
            previous = None
    return found


def run_page(page: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    parser = doctest.DocTestParser()
    for block in blocks(page):
        if block.skip is not None:
            continue
        where = f"{page.name}:{block.line}"
        if re.search(r"^\s*>>> ", block.body, re.MULTILINE):
            test = parser.get_doctest(block.body, namespace, where, str(page), block.line)
            report = io.StringIO()
            runner = doctest.DocTestRunner(optionflags=_DOCTEST_FLAGS)
            runner.run(test, out=report.write, clear_globs=False)
            namespace.update(test.globs)  # DocTest runs in a copy of the namespace
            assert not runner.failures, (
                f"{where}: the example's output differs\n{report.getvalue()}"
            )
            continue
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block.body, where, "exec"), namespace)
        if block.output is not None:
            got = [line.rstrip() for line in stdout.getvalue().strip("\n").splitlines()]
            want = [line.rstrip() for line in block.output.strip("\n").splitlines()]
            assert got == want, f"{where}: printed {got!r}, the page says {want!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path) -> None:
    run_page(page)


def test_the_conventions_are_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('hi')\n```\n\n```text title=\"Output\"\nho\n```\n"
        "<!-- skip: needs torchrun -->\n```python\nraise SystemExit\n```\n"
    )
    with pytest.raises(AssertionError, match="printed"):
        run_page(page)
    page.write_text("```python\n>>> 1 + 1\n3\n```\n")
    with pytest.raises(AssertionError, match="output differs"):
        run_page(page)
    page.write_text("<!-- skip -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"):
        run_page(page)
