"""The README's quick start and .ci/run stay in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'^TEST_CMD="(.*)"$', ci, re.M)
    assert command is not None
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    lines = [ln for ln in quick.splitlines() if ln.startswith("pip install")]
    assert len(lines) == 2, "the quick start is exactly two commands"
    assert lines[1] == command.group(1)
    assert "autopar plan" in lines[0]
