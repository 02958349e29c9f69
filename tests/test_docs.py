"""The documentation states what the code does: every option with its real default."""

from __future__ import annotations

import dataclasses
import pathlib

from ftcomm.gossip.config import GossipConfig
from ftcomm.options import GroupOptions

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_every_gossip_option_is_documented_with_its_default():
    table = (DOCS / "CONFIGURATION.md").read_text()
    for field in dataclasses.fields(GossipConfig):
        assert f"| `{field.name}` | `{field.default!r}` |" in table, f"{field.name} missing or stale"


def test_every_group_option_is_documented_with_its_default():
    table = (DOCS / "CONFIGURATION.md").read_text()
    for field in dataclasses.fields(GroupOptions):
        default = "GossipConfig()" if field.default is dataclasses.MISSING else repr(field.default)
        assert f"| `{field.name}` | `{default}` |" in table, f"{field.name} missing or stale"


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def test_size_dependent_values_in_the_docs_match_the_functions():
    table = (DOCS / "CONFIGURATION.md").read_text()
    cfg = GossipConfig()
    row = next(line for line in table.splitlines() if line.startswith("| minimum suspicion timeout"))
    assert _cells(row)[-3:] == [f"{cfg.min_suspicion_timeout(n):.1f} s" for n in (8, 100, 1000)]
    row = next(line for line in table.splitlines() if line.startswith("| retransmissions per broadcast"))
    assert _cells(row)[-3:] == [str(cfg.retransmit_limit(n)) for n in (8, 100, 1000)]


def test_every_option_of_ftcomm_run_is_documented():
    from ftcomm.ops.cli import build_parser

    parser = build_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    text = (DOCS / "CLI.md").read_text()
    for action in run._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in text, f"{flag} is not in docs/CLI.md"


def test_the_engine_state_diagram_in_the_architecture_is_the_table():
    from ftcomm.core.engine import state_diagram

    text = (DOCS / "ARCHITECTURE.md").read_text()
    assert f"```mermaid\n{state_diagram()}\n```" in text, "regenerate the diagram: ftcomm.core.engine.state_diagram()"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings of a Markdown text."""
    import re

    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return anchors


def test_every_relative_link_of_the_docs_and_the_readme_leads_somewhere():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
