"""What a user sees first: the license, `--version`, the README's command table and links."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import crossdevice
from crossdevice._cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: Markdown files whose relative links must resolve inside the repository.
MARKDOWN = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_license_is_the_one_pyproject_names() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text


def test_version_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "crossdevice", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == f"crossdevice {crossdevice.__version__}"


def test_readme_opens_with_the_demo_and_test_commands() -> None:
    text = README.read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, re.DOTALL)
    assert first_block is not None
    lines = first_block.group(1).splitlines()
    assert lines[0].startswith("bash scripts/demo.sh")
    assert lines[1].startswith("bash scripts/test.sh")


def test_readme_command_table_lists_every_command() -> None:
    text = README.read_text()
    table = text[text.index("## The command line") :]
    table = table[: table.index("\n## ")]
    for name in COMMANDS:
        assert f"| `crossdevice {name}` |" in table, f"`crossdevice {name}` is not in the table"
    assert "`crossdevice --version`" in table


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code is not a link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(path: Path) -> None:
    for link in _links(path):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue  # a web address or an anchor on the same page
        target = (path.parent / link.split("#")[0]).resolve()
        assert target.is_relative_to(ROOT), f"{path.name}: {link} leaves the repository"
        assert target.exists(), f"{path.name}: {link} does not exist"


def _mentioned_documents(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b", text))


def test_mentioned_documents_exist() -> None:
    """`DESIGN.md §4` in a docstring must name a file a reader of the repository can open."""
    sources = [README, *MARKDOWN, *sorted((ROOT / "src").rglob("*.py"))]
    missing = []
    for path in sources:
        for name in _mentioned_documents(path.read_text()):
            candidates = [ROOT / name, path.parent / name, ROOT / "docs" / name]
            if not any(c.exists() for c in candidates):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "documents that are not in the repository: " + ", ".join(missing)
