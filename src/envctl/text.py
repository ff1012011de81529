"""Small predicates on text a user types, shared by every layer (no imports)."""


def ascii_digits(text: str) -> bool:
    """A plain number: ASCII digits only. str.isdigit() holds for '²', which int() refuses
    (a traceback where a one-line exit 2 is due), and for other scripts' digits ('１２' would
    be 12): every number a user types is checked with this."""
    return text.isascii() and text.isdigit()
