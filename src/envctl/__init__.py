"""envctl: static, isolated GPU and CPU partitions of one Linux host."""

__version__ = "0.1.0"
