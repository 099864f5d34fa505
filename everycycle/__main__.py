"""``python -m everycycle``."""

from everycycle.cli import main

main()
