"""The docs are code: every shell command of README.md and docs/*.md runs as typed (tests/docs_tour.py says
how, and what the docs mark), and where the docs show output it is what the command prints."""

from __future__ import annotations

import pytest
from docs_tour import ALL, Tour, tour


def test_every_docs_command_runs_as_typed(docs_tour: Tour) -> None:
    print(docs_tour.summary())
    assert not docs_tour.problems(), "\n\n".join(docs_tour.problems())


def test_docs_slow_commands(docs_tour: Tour) -> None:
    """The few expensive commands (8 ranks, sweeps over world sizes), together, after the others, scaled down
    to this machine (docs_tour.SCALED_DOWN), in the same workspace."""
    slow = tour([c for c in ALL if c.slow], docs_tour.workspace, earlier=docs_tour)
    print(slow.summary())
    assert not slow.problems(), "\n\n".join(slow.problems())


def test_the_docs_have_commands_and_markers_parse() -> None:
    """The parser itself: if it found no commands, the tour would pass vacuously."""
    assert len(ALL) >= 40
    readme = [c for c in ALL if c.doc == "README.md"]
    assert readme[0].text.startswith("make demo")
    errors = [c for c in readme if c.exit == 2]
    assert errors and all(c.output for c in errors)  # each error example shows its one line
    assert all(c.needs in ("", "cuda", "nodes", "slurm", "bench", "netns") for c in ALL)
    assert sum(c.slow for c in ALL) <= 8  # "the few slow ones"


@pytest.mark.parametrize("doc", sorted({c.doc for c in ALL}))
def test_every_doc_with_commands_is_in_the_tour(doc: str) -> None:
    from docs_tour import DOCS, REPO

    assert doc in DOCS
    listed = {str(p.relative_to(REPO)) for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    assert listed <= set(DOCS), f"a doc the tour does not read: {sorted(listed - set(DOCS))}"


def test_the_tours_stand_in_for_make_demo_is_the_makefiles_recipe() -> None:
    from docs_tour import DEMO, REPO

    recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1].strip()
    assert recipe == f"$(VENV)/bin/{DEMO}"
