"""The documentation against the repository: every relative link in README.md and docs/*.md
reaches a file (and its heading, for ``#anchor`` links), no page points outside the repository,
docs/design.md's layer table names every module of the package, and docs/cli.md's settings
table is generated from the settings' declaration."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# committed results are read by users too: they must not name this machine's directories
# (hidden folders under results/ are benchmarks' scratch runs, ignored by git)
RESULTS = sorted(p for p in (REPO / "results").rglob("*") if p.suffix in (".json", ".md")
                 and not any(part.startswith(".") for part in p.relative_to(REPO).parts))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_heading(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or REPO not in (dest, *dest.parents):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES + RESULTS, ids=lambda p: p.name)
def test_no_page_points_outside_the_repository(page):
    text = page.read_text()
    bad = [m.group(0) for m in re.finditer(r"(?<![\w.])/work/\S*|\.\./shared\S*", text)]
    assert not bad, f"{page.relative_to(REPO)} points outside the repository: {bad}"


def test_design_names_every_module():
    design = (REPO / "docs" / "design.md").read_text()
    modules = [p for p in (REPO / "hpclb").rglob("*.py") if p.stem != "__init__"]
    missing = [str(p.relative_to(REPO)) for p in modules
               if f"`{p.stem}`" not in design and f"`{p.name}`" not in design]
    assert modules and not missing, f"docs/design.md's layer table lacks {missing}"


def test_cli_sync_settings_table_is_the_declaration():
    """docs/cli.md's table of gradient-sync settings is hpclb.config.sync_settings_table()."""
    from hpclb.config import sync_settings_table

    text = (REPO / "docs" / "cli.md").read_text()
    start = text.index("<!-- sync-settings-table:")
    body = text[text.index("\n", start) + 1:text.index("<!-- end sync-settings-table -->")]
    assert body == sync_settings_table(), (
        "docs/cli.md's sync settings table differs from the declaration; replace it with: "
        "python -c 'from hpclb.config import sync_settings_table as t; print(t(), end=\"\")'")


def test_cli_settings_table_is_the_declaration():
    """docs/cli.md's table of run settings is hpclb.config.settings_table(), generated from the
    one declaration of each setting (hpclb/config/fields.py): it cannot drift from the flags and
    the checks."""
    from hpclb.config import settings_table

    text = (REPO / "docs" / "cli.md").read_text()
    start = text.index("<!-- settings-table:")
    body = text[text.index("\n", start) + 1:text.index("<!-- end settings-table -->")]
    assert body == settings_table(), (
        "docs/cli.md's settings table differs from the declaration; replace it with the output "
        "of: python -c 'from hpclb.config import settings_table as t; print(t(), end=\"\")'")
