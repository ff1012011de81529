"""Plain record classes for the launch path, without `dataclasses`.

`envctl exec` and `envctl submit-job` are latency targets (≤ 80 ms and ≤ 100 ms, whole
process), and `import dataclasses` costs ~13 ms of them here: it imports `inspect`, which
imports `ast`, `dis`, `tokenize` and more. The classes those two commands load (the host
handle, the environment's run-time context, the launch, the job record, a spec problem) are
therefore `Record`s: fields are the class's annotations in order, a class attribute is the
field's default, `Factory(list)` a per-instance default. A Record has a keyword-or-positional
`__init__`, `__repr__`, `__eq__`, `replace(**changes)` (a copy) and `asdict()` (a shallow
dict); `Record, frozen=True` refuses assignment and is hashable. Everything else keeps using
dataclasses.
"""

from __future__ import annotations

_MISSING = object()


class Factory:
    """A default made fresh for each instance: `cpus: list[int] = Factory(list)`."""

    __slots__ = ("make",)

    def __init__(self, make: object) -> None:
        self.make = make


class Record:
    _fields: tuple[str, ...] = ()
    _defaults: dict = {}
    _frozen = False
    # For from_dict, made once per class: the plain defaults, the Factory ones, the fields
    # without a default, and the fields as a set.
    _plain: dict = {}
    _made: tuple[tuple[str, Factory], ...] = ()
    _required: tuple[str, ...] = ()
    _field_set: frozenset[str] = frozenset()

    def __init_subclass__(cls, frozen: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        names = [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_")]
        fields = [f for f in cls._fields if f not in names] + names
        defaults = dict(cls._defaults)
        for name in names:
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                delattr(cls, name)  # the instance's value, never the class's, is what reads
            else:
                defaults.pop(name, None)
        cls._fields, cls._defaults, cls._frozen = tuple(fields), defaults, frozen or cls._frozen
        cls._plain = {n: v for n, v in defaults.items() if not isinstance(v, Factory)}
        cls._made = tuple((n, v) for n, v in defaults.items() if isinstance(v, Factory))
        cls._required = tuple(f for f in fields if f not in defaults)
        cls._field_set = frozenset(fields)

    def __init__(self, *args: object, **kwargs: object) -> None:
        if len(args) > len(self._fields):
            raise TypeError(f"{type(self).__name__}() takes {len(self._fields)} arguments")
        values = dict(zip(self._fields, args, strict=False))
        for name, value in kwargs.items():
            if name not in self._fields or name in values:
                raise TypeError(f"{type(self).__name__}() got an unexpected or repeated "
                                f"argument {name!r}")
            values[name] = value
        for name in self._fields:
            value = values.get(name, _MISSING)
            if value is _MISSING:
                value = self._defaults.get(name, _MISSING)
                if value is _MISSING:
                    raise TypeError(f"{type(self).__name__}() missing argument {name!r}")
                if isinstance(value, Factory):
                    value = value.make()
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen:
            raise AttributeError(f"{type(self).__name__} is frozen: cannot assign {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")
        object.__delattr__(self, name)

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        if not self._frozen:
            raise TypeError(f"unhashable type: {type(self).__name__!r}")
        return hash(self._values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({inner})"

    @classmethod
    def from_dict(cls, raw: dict) -> Record:
        """An instance from `raw`'s values for the fields (other keys ignored), defaults for
        the rest; TypeError when a field without a default is missing. The constructor's
        result, without its per-argument checks (for many records read back)."""
        # Whole dicts at a time, not a loop over every field (`envctl jobs` builds 10,000
        # records of ~50 fields from the queue's index: ~35 µs each that way, ~5 µs this way).
        for name in cls._required:
            if name not in raw:
                raise TypeError(f"{cls.__name__}() missing argument {name!r}")
        self = object.__new__(cls)
        values = self.__dict__
        values.update(cls._plain)
        for name, factory in cls._made:
            if name not in raw:
                values[name] = factory.make()
        if raw.keys() <= cls._field_set:
            values.update(raw)
        else:
            for name in raw.keys() & cls._field_set:
                values[name] = raw[name]
        return self

    def replace(self, **changes: object) -> Record:
        """A copy with `changes` (dataclasses.replace)."""
        return type(self)(**{**self.asdict(), **changes})

    def asdict(self) -> dict:
        """{field: value}, shallow (values are not copied)."""
        return {f: getattr(self, f) for f in self._fields}
