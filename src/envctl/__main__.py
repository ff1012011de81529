"""Entry point for `python -m envctl`."""

from envctl.entry import main

main()
