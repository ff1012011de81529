"""Entry point for `python -m envctl`."""

from envctl.cli import entry

entry()
