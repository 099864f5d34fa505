"""Every command's --help reads whole at 80 columns: every option explained, no option
name or example cut, no metavar in braces, examples in a paragraph of their own."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from everycycle.cli import app


def commands() -> Iterator[tuple[str, Any]]:
    def walk(prefix: str, cmd: Any) -> Iterator[tuple[str, Any]]:
        yield prefix, cmd
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            yield from walk(f"{prefix} {name}".strip(), sub)

    yield from walk("", typer.main.get_command(app))


ALL = list(commands())


@pytest.mark.parametrize(("name", "cmd"), ALL, ids=[n or "everycycle" for n, _ in ALL])
def test_help_at_80_columns(name: str, cmd: Any) -> None:
    for param in cmd.params:
        if param.param_type_name == "option" and param.name != "help":
            assert param.help, f"{name}: {param.opts} has no help"
    out = CliRunner().invoke(app, [*name.split(), "--help"], terminal_width=80,
                             env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    text = out.output
    long = [ln for ln in text.splitlines() if len(ln) > 80]
    assert not long, long
    usage = text.split("\n\n")[0]
    # Arguments in capitals ({NAME} is Typer's mark for a required one), never {model}.
    assert not re.search(r"\{[a-z]", usage), usage
    if name and not getattr(cmd, "commands", None) or name == "models":
        # one style: an Example paragraph, each example on lines of its own, whole
        assert "\n  Example:\n" in text, (name, text)
        block = (cmd.help or "").split("Example:\n", 1)[1]
        for line in block.splitlines():
            if line.strip():
                assert f"  {line}" in text.splitlines(), (name, line)
    assert "\x08" not in text  # (Click's no-rewrap mark is not printed)
