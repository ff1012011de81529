"""envctl.record.Record: what the launch path's classes rely on instead of dataclasses."""

from __future__ import annotations

import pytest

from envctl.record import Factory, Record


class Point(Record):
    """A docstring."""

    x: int
    y: int = 0
    tags: list[str] = Factory(list)


class Frozen(Record, frozen=True):
    a: int
    b: str = "b"


class Point3(Point):
    z: int = 9


def test_fields_defaults_and_fresh_factories():
    p = Point(1)
    assert (p.x, p.y, p.tags) == (1, 0, [])
    q = Point(1, 2, tags=["t"])
    assert (q.x, q.y, q.tags) == (1, 2, ["t"])
    p.tags.append("mine")
    assert Point(1).tags == []  # a fresh list per instance
    assert Point._fields == ("x", "y", "tags")
    assert "y" not in Point.__dict__  # the default is not left as a class attribute
    assert Point3(1).z == 9 and Point3._fields == ("x", "y", "tags", "z")


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="missing argument 'x'"):
        Point()
    with pytest.raises(TypeError, match="'w'"):
        Point(1, w=2)
    with pytest.raises(TypeError, match="'x'"):
        Point(1, x=2)
    with pytest.raises(TypeError, match="takes 3"):
        Point(1, 2, [], 4)


def test_eq_repr_replace_asdict():
    p = Point(1, 2)
    assert p == Point(1, 2) and p != Point(1, 3) and p != Frozen(1)
    assert repr(p) == "Point(x=1, y=2, tags=[])"
    r = p.replace(y=5)
    assert (r.x, r.y, type(r)) == (1, 5, Point) and p.y == 2
    assert p.asdict() == {"x": 1, "y": 2, "tags": []}
    p.y = 7  # mutable
    assert p.y == 7
    with pytest.raises(TypeError, match="unhashable"):
        hash(p)


def test_frozen_refuses_assignment_and_hashes():
    f = Frozen(1)
    with pytest.raises(AttributeError, match="frozen"):
        f.a = 2
    with pytest.raises(AttributeError, match="frozen"):
        del f.b
    assert hash(f) == hash(Frozen(1, "b")) and {f, Frozen(1)} == {f}
    assert f.replace(a=2) == Frozen(2)


def test_from_dict_is_the_constructor_without_its_checks():
    raw = {"x": 1, "tags": ["t"], "unknown": "ignored"}
    assert Point.from_dict(raw) == Point(1, tags=["t"])
    assert Point.from_dict({"x": 1, "tags": ["t"]}) == Point(1, tags=["t"])  # fields only
    a, b = Point3.from_dict({"x": 1}), Point3.from_dict({"x": 2})
    assert (a.y, a.z) == (0, 9) and a.tags == [] and a.tags is not b.tags  # fresh factories
    f = Frozen.from_dict({"a": 3})
    assert (f.a, f.b) == (3, "b") and hash(f) == hash(Frozen(3))
    with pytest.raises(AttributeError):
        f.a = 4  # still frozen
    with pytest.raises(TypeError, match="missing argument 'x'"):
        Point.from_dict({"y": 1})
