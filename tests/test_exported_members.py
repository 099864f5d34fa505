"""The package's public names: sorted, importable, and nothing heavy at import."""

from __future__ import annotations

import subprocess
import sys

import everycycle


def test_all_is_sorted_and_every_name_exists() -> None:
    assert everycycle.__all__ == sorted(everycycle.__all__)
    for name in everycycle.__all__:
        assert hasattr(everycycle, name), name


def test_importing_the_package_loads_neither_llama_cpp_nor_an_event_loop() -> None:
    code = ("import sys, everycycle, everycycle.protocol; "
            "assert not {'llama_cpp', 'anyio', 'asyncio'} & set(sys.modules), sys.modules.keys()")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
