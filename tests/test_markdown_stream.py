"""How a streamed answer is cut into blocks for the terminal (cli/markdown.py)."""

from __future__ import annotations

from everycycle.cli.markdown import finished_blocks, tail


def test_a_block_is_finished_at_a_blank_line_outside_a_code_fence() -> None:
    assert finished_blocks("one\n\ntwo") == len("one\n\n")
    assert finished_blocks("one\n") == 0
    code = "```py\na = 1\n\nb = 2\n"  # (a blank line inside a fence ends nothing)
    assert finished_blocks(code) == 0
    assert finished_blocks(code + "```\n\nafter") == len(code + "```\n\n")
    assert finished_blocks("~~~\nx\n\n~~~\n\n") == len("~~~\nx\n\n~~~\n\n")


def test_the_tail_on_screen_reopens_a_fence_cut_off_above_it() -> None:
    block = "```python\n" + "\n".join(f"x = {i}" for i in range(100))
    shown = tail(block, 5, 10_000)
    assert shown.splitlines() == ["```python", "x = 95", "x = 96", "x = 97", "x = 98",
                                  "x = 99"]
    assert tail("short\ntext", 5, 100) == "short\ntext"
    long = tail("word " * 1000, 5, 60)
    assert long.startswith("…") and len(long) == 61
