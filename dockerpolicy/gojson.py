"""JSON decoded into Docker's request structs the way Go's ``encoding/json`` fills them.

Docker reads a request body with Go's decoder into typed structs, which differs from a
naive reading of the same bytes in ways an attacker can use:

- escapes are decoded first: ``"\\u0050rivileged"`` is the key ``Privileged``;
- an object key names a struct field by exact match first, else case-insensitively, and
  the case folding is Unicode's: ``privileged``, ``PRIVILEGED``, ``Binds`` spelt with a long
  s (U+017F), ``NetworkMode`` with a Kelvin sign (U+212A) and, since Go 1.21, ``Privileged``
  with a dotless or dotted i (U+0131, U+0130) all name the field;
- keys that name no field are ignored;
- a later duplicate key overwrites scalars but is decoded *into* the earlier struct, map or
  slice element (``{"HostConfig": {"Privileged": true}, "HostConfig": {}}`` is privileged);
- ``null`` leaves a scalar or struct alone and empties a slice, map or pointer.

This module reproduces the field matching exactly (as Go 1.21+ does it, which matches every
key an older Go matches and a few more) and refuses what would make the outcome depend on
merge rules: a field or map key given twice is an error, so the value decoded here is the
one value Docker would read. Type mismatches are errors, as they are for Docker (it answers
400 after decoding "as best it can"). The caller forwards ``encode(value)``, never the bytes
it was given.
"""

import json
from json import scanner
from typing import Any

# The pure-Python scanner's number pattern matches any Unicode digit ("[\u0661]" would
# parse as [1]); the C scanner, like Go, accepts ASCII digits only.
assert scanner.c_make_scanner is not None, "dockerpolicy needs json's C scanner"

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()
"""A field left at its zero value: ``null``, or never given."""

# Non-ASCII runes whose Unicode simple case folding lands on an ASCII letter, i.e. those
# for which Go's unicode.ToUpper(unicode.ToLower(r)) is ASCII. Every other non-ASCII rune
# folds to a non-ASCII rune and so can never match Docker's ASCII field names.
_FOLD_TO_ASCII = {"\u017f": "S", "\u212a": "K", "\u0130": "I", "\u0131": "I"}


class DecodeError(ValueError):
    """The body is not JSON Docker would decode into exactly one meaning."""


class Pairs(list):
    """A JSON object as parsed: its (key, value) pairs in order, duplicates kept."""


class FloatLiteral(str):
    """A JSON number written with a fraction or an exponent (Go refuses it for an int)."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(
    object_pairs_hook=Pairs, parse_float=FloatLiteral, parse_constant=_no_constant, strict=True
)


def parse(body: bytes) -> Any:
    """Strict JSON (RFC 8259, one value, UTF-8, no byte-order mark) to Python values."""
    if body.startswith(b"\xef\xbb\xbf"):
        raise DecodeError("the body starts with a byte-order mark")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"the body is not valid JSON: {str(exc)[:120]}") from None


def encode(value: Any) -> bytes:
    """The canonical JSON of a decoded value: ASCII only, no whitespace, keys sorted."""
    return json.dumps(
        value, ensure_ascii=True, separators=(",", ":"), allow_nan=False, sort_keys=True
    ).encode()


def go_fold(key: str) -> str:
    """The folded form Go compares struct field names by (equal for equal-folding keys)."""
    return "".join(ch.upper() if ch < "\x80" else _FOLD_TO_ASCII.get(ch, ch) for ch in key)


def json_kind(value: Any) -> str:
    if isinstance(value, Pairs):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str) and not isinstance(value, FloatLiteral):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def _text(value: str, path: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DecodeError(f"{path} holds an unpaired surrogate escape") from None
    return value


def show(key: str) -> str:
    """A key as it may appear in a log line or a message: quoted, escaped, bounded."""
    return ascii(key[:64])


class GoType:
    """A Go type a JSON value is decoded into."""

    name = "?"

    def decode(self, value: Any, path: str) -> Any:
        """The value for a struct field: ABSENT where Go leaves the field at zero."""
        raise NotImplementedError

    def zero(self) -> Any:
        return None

    def element(self, value: Any, path: str) -> Any:
        """The value for a slice or map element, which null sets to its zero value."""
        decoded = self.decode(value, path)
        return self.zero() if decoded is ABSENT else decoded

    def mismatch(self, value: Any, path: str) -> DecodeError:
        return DecodeError(f"{path} must be {self.name}, not {json_kind(value)}")


class Bool(GoType):
    name = "a boolean"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if isinstance(value, bool):
            return value
        raise self.mismatch(value, path)

    def zero(self) -> Any:
        return False


class String(GoType):
    name = "a string"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if isinstance(value, str) and not isinstance(value, FloatLiteral):
            return _text(value, path)
        raise self.mismatch(value, path)

    def zero(self) -> Any:
        return ""


class Int(GoType):
    """A Go integer of ``bits`` bits; JSON numbers with a fraction or exponent are refused."""

    def __init__(self, bits: int = 64, signed: bool = True) -> None:
        self.low = -(2 ** (bits - 1)) if signed else 0
        self.high = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
        self.name = f"an {'' if signed else 'unsigned '}integer"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.mismatch(value, path)
        if not self.low <= value <= self.high:
            raise DecodeError(f"{path} is out of range")
        return value

    def zero(self) -> Any:
        return 0


class Float(GoType):
    name = "a number"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if isinstance(value, FloatLiteral) or (
            isinstance(value, int) and not isinstance(value, bool)
        ):
            number = float(value)
            if number in (float("inf"), float("-inf")):
                raise DecodeError(f"{path} is out of range")
            return number
        raise self.mismatch(value, path)

    def zero(self) -> Any:
        return 0.0


class AnyValue(GoType):
    """``interface{}``: any JSON, objects with duplicate keys refused."""

    name = "any value"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        return self.plain(value, path)

    def plain(self, value: Any, path: str) -> Any:
        if isinstance(value, Pairs):
            out: dict[str, Any] = {}
            for key, item in value:
                if key in out:
                    raise DecodeError(f"{path} has the key {show(key)} more than once")
                out[_text(key, path)] = self.plain(item, f"{path}[{show(key)}]")
            return out
        if isinstance(value, list):
            return [self.plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, FloatLiteral):
            return Float().decode(value, path)
        if isinstance(value, str):
            return _text(value, path)
        return value


class EmptyStruct(GoType):
    """``struct{}`` (the values of ``ExposedPorts`` and ``Volumes``): any object, keys ignored."""

    name = "an object"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if isinstance(value, Pairs):
            return {}
        raise self.mismatch(value, path)

    def zero(self) -> Any:
        return {}


class Slice(GoType):
    def __init__(self, elem: GoType) -> None:
        self.elem = elem
        self.name = f"an array of {elem.name.split(' ', 1)[-1]}s"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if not isinstance(value, list) or isinstance(value, Pairs):
            raise self.mismatch(value, path)
        return [self.elem.element(item, f"{path}[{i}]") for i, item in enumerate(value)]


class Array(Slice):
    """A fixed-size Go array: extra elements are dropped, missing ones are zero."""

    def __init__(self, elem: GoType, size: int) -> None:
        super().__init__(elem)
        self.size = size

    def decode(self, value: Any, path: str) -> Any:
        items = super().decode(value, path)
        if items is ABSENT:
            return ABSENT
        return (items + [self.elem.zero()] * self.size)[: self.size]


class StrSlice(Slice):
    """Docker's ``strslice.StrSlice`` (Cmd, Entrypoint, CapAdd): an array or one string."""

    def __init__(self) -> None:
        super().__init__(String())
        self.name = "a string or an array of strings"

    def decode(self, value: Any, path: str) -> Any:
        if isinstance(value, str) and not isinstance(value, FloatLiteral):
            return [_text(value, path)]
        return super().decode(value, path)


class Map(GoType):
    """``map[string]T``: keys taken as they are (no folding); a repeated key is refused."""

    def __init__(self, elem: GoType) -> None:
        self.elem = elem
        self.name = "an object"

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if not isinstance(value, Pairs):
            raise self.mismatch(value, path)
        out: dict[str, Any] = {}
        for key, item in value:
            if key in out:
                raise DecodeError(f"{path} has the key {show(key)} more than once")
            out[_text(key, path)] = self.elem.element(item, f"{path}[{show(key)}]")
        return out


class Field:
    """A struct field as Go's decoder sees it: its JSON name and its type."""

    def __init__(self, name: str, gotype: GoType) -> None:
        self.name, self.type = name, gotype


class Struct(GoType):
    """A Go struct; embedded structs' fields are listed in it (Go promotes them)."""

    name = "an object"

    def __init__(self, *fields: tuple[str, GoType]) -> None:
        self.fields = [Field(name, gotype) for name, gotype in fields]
        self.exact = {f.name: f for f in self.fields}
        self.folded: dict[str, Field] = {}
        for f in self.fields:  # for historical reasons the first folded match wins
            self.folded.setdefault(go_fold(f.name), f)

    def lookup(self, key: str) -> Field | None:
        """The field a key names: exact match first, else a case-folded one, else none."""
        return self.exact.get(key) or self.folded.get(go_fold(key))

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        if not isinstance(value, Pairs):
            raise self.mismatch(value, path)
        out: dict[str, Any] = {}
        given: dict[str, str] = {}
        for key, item in value:
            field = self.lookup(key)
            if field is None:
                continue  # Go ignores a key that names no field, and so does Docker
            where = f"{path}.{field.name}" if path else field.name
            if field.name in given:
                raise DecodeError(
                    f"{where} is given more than once (as {show(given[field.name])} "
                    f"and {show(key)}): refused rather than guess which one counts"
                )
            given[field.name] = key
            decoded = field.type.decode(item, where)
            if decoded is not ABSENT:
                out[field.name] = decoded
        return out

    def zero(self) -> Any:
        return {}


class Ptr(GoType):
    """``*T``: null is nil; anything else decodes as T."""

    def __init__(self, inner: GoType) -> None:
        self.inner = inner
        self.name = inner.name

    def decode(self, value: Any, path: str) -> Any:
        if value is None:
            return ABSENT
        return self.inner.element(value, path)

    def zero(self) -> Any:
        return None


def decode(body: bytes, gotype: GoType) -> Any:
    """Parse ``body`` and decode it as ``gotype``; the top level must be an object."""
    value = parse(body)
    if not isinstance(value, Pairs):
        raise DecodeError(f"the body must be a JSON object, not {json_kind(value)}")
    return gotype.element(value, "")
