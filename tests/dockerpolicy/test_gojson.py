"""The decoder against Go's encoding/json semantics, as Docker uses them.

Each expectation here is what Go's decoder does with the same bytes (the docker-stage
module test_go_semantics.py checks the ones a Docker Engine can show against a real one),
except where this decoder deliberately refuses: a field or map key given twice.
"""

import sys
import unicodedata

import pytest

from dockerpolicy import dockertypes
from dockerpolicy.gojson import (
    ABSENT,
    DecodeError,
    Int,
    Map,
    Pairs,
    Slice,
    String,
    Struct,
    decode,
    encode,
    go_fold,
    parse,
)


def host(body: str) -> dict:
    return decode(body.encode(), dockertypes.CONTAINER_CREATE).get("HostConfig", {})


# --- Field matching ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "Privileged",
        "privileged",
        "PRIVILEGED",
        "pRiViLeGeD",
        "\\u0050rivileged",
        "\\u0050\\u0072\\u0069\\u0076\\u0069\\u006c\\u0065\\u0067\\u0065\\u0064",
        "Pr\u0131vileged",  # dotless i folds to I (Go 1.21+)
        "Pr\u0130vileged",  # dotted capital I folds to I (Go 1.21+)
        "Pr\\u0131vileged",  # the same, escaped
    ],
)
def test_a_key_names_the_field_go_would_fill(key: str) -> None:
    assert host('{"HostConfig": {"KEY": true}}'.replace("KEY", key)) == {"Privileged": True}


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("Bind\u017f", "Binds"),  # long s folds to S
        ("\u017fecurityOpt", "SecurityOpt"),
        ("Networ\u212aMode", "NetworkMode"),  # Kelvin sign folds to K
        ("networ\u212amode", "NetworkMode"),
        ("MOUNT\u017f", "Mounts"),
    ],
)
def test_unicode_case_folding_matches_like_go(key: str, field: str) -> None:
    value = '["x"]' if field in ("Binds", "SecurityOpt", "Mounts") else '"x"'
    if field == "Mounts":
        value = '[{"Type": "bind"}]'
    assert list(
        host('{"HostConfig": {"KEY": VALUE}}'.replace("KEY", key).replace("VALUE", value))
    ) == [field]


@pytest.mark.parametrize(
    "key",
    [
        "Privileged\u200b",
        "Privileged ",
        " Privileged",
        "Privi-leged",
        "Privileg\u00e9d",
        "Resources",
        "HostConfig.Privileged",
        "Privilegedd",
        "\u0420rivileged",  # Cyrillic Er
    ],
)
def test_keys_that_name_no_field_are_ignored(key: str) -> None:
    assert host('{"HostConfig": {"KEY": true}}'.replace("KEY", key)) == {}


def test_an_embedded_struct_has_no_key_of_its_own() -> None:
    """``Resources`` is embedded in HostConfig without a tag: Go promotes its fields, and
    a key "Resources" names nothing."""
    assert host('{"HostConfig": {"Resources": {"Devices": [{"PathOnHost": "/dev/mem"}]}}}') == {}
    assert host('{"HostConfig": {"Devices": [{"PathOnHost": "/dev/mem"}]}}') == {
        "Devices": [{"PathOnHost": "/dev/mem"}]
    }


def test_an_exact_match_wins_over_a_folded_one_and_the_first_folded_field_wins() -> None:
    gotype = Struct(("Name", String()), ("NAME", Int()), ("nAmE", Int()))
    assert decode(b'{"NAME": 1}', gotype) == {"NAME": 1}
    assert decode(b'{"nAmE": 2}', gotype) == {"nAmE": 2}
    assert decode(b'{"name": "x"}', gotype) == {"Name": "x"}  # first in field order


def test_the_fold_table_is_every_non_ascii_rune_that_folds_onto_ascii() -> None:
    """Go folds a rune r as unicode.ToUpper(unicode.ToLower(r)) (simple case mappings).
    Python exposes full mappings; they differ from the simple ones only where the result
    is several characters, and there the simple mapping is the first character for
    lower-casing U+0130 and the rune itself otherwise."""

    def simple(char: str, mapped: str) -> str:
        return mapped if len(mapped) == 1 else (mapped[0] if char == "\u0130" else char)

    folding_to_ascii = set()
    for code in range(0x80, sys.maxunicode + 1):
        char = chr(code)
        if unicodedata.category(char) == "Cs":
            continue
        lower = simple(char, char.lower())
        upper = simple(lower, lower.upper())
        if upper.isascii():
            folding_to_ascii.add((char, upper))
    assert folding_to_ascii == {("\u017f", "S"), ("\u212a", "K"), ("\u0130", "I"), ("\u0131", "I")}
    assert all(go_fold(char) == upper for char, upper in folding_to_ascii)


# --- Duplicates: Go keeps the last scalar and merges into structs; both are refused -------------


@pytest.mark.parametrize(
    "body",
    [
        '{"HostConfig": {"Privileged": true, "Privileged": false}}',
        '{"HostConfig": {"Privileged": false, "Privileged": true}}',
        '{"HostConfig": {"Privileged": false, "privileged": true}}',
        '{"HostConfig": {"privileged": true, "\\u0050rivileged": false}}',
        '{"HostConfig": {"Privileged": true, "Privileged": null}}',
        '{"HostConfig": {"Binds": ["a:/a"], "Bind\u017f": ["/:/h"]}}',
        '{"HostConfig": {"Privileged": true}, "HostConfig": {}}',  # Go merges: privileged
        '{"HostConfig": {"Privileged": true}, "hostconfig": null}',
        '{"Image": "a", "image": "b"}',
        '{"Labels": {"tollgate.managed": "false", "tollgate.managed": "true"}}',
        '{"HostConfig": {"DeviceRequests": [{"Driver": "x", "driver": "y"}]}}',
    ],
)
def test_a_field_or_map_key_given_twice_is_refused(body: str) -> None:
    with pytest.raises(DecodeError, match="more than once"):
        decode(body.encode(), dockertypes.CONTAINER_CREATE)


# --- null, zero values and types -----------------------------------------------------------------


def test_null_leaves_a_field_unset_and_makes_elements_zero() -> None:
    assert host('{"HostConfig": {"Privileged": null, "Binds": null, "LogConfig": null}}') == {}
    assert decode(b'{"HostConfig": null}', dockertypes.CONTAINER_CREATE) == {}
    assert host('{"HostConfig": {"Binds": ["a:/a", null]}}') == {"Binds": ["a:/a", ""]}
    assert host('{"HostConfig": {"Tmpfs": {"/x": null}}}') == {"Tmpfs": {"/x": ""}}
    assert host('{"HostConfig": {"Ulimits": [null]}}') == {"Ulimits": [None]}
    spec = decode(b'{"ExposedPorts": {"8000/tcp": null}}', dockertypes.CONTAINER_CREATE)
    assert spec == {"ExposedPorts": {"8000/tcp": {}}}


def test_strslice_takes_one_string_or_an_array() -> None:
    assert host('{"HostConfig": {"CapAdd": "SYS_ADMIN"}}') == {"CapAdd": ["SYS_ADMIN"]}
    assert host('{"HostConfig": {"CapAdd": ["SYS_ADMIN", null]}}') == {"CapAdd": ["SYS_ADMIN", ""]}


def test_a_fixed_array_drops_extra_elements_and_zero_fills() -> None:
    assert host('{"HostConfig": {"ConsoleSize": [1, 2, 3]}}') == {"ConsoleSize": [1, 2]}
    assert host('{"HostConfig": {"ConsoleSize": [7]}}') == {"ConsoleSize": [7, 0]}


def test_struct_values_inside_objects_ignore_unknown_keys() -> None:
    assert decode(
        b'{"ExposedPorts": {"8000/tcp": {"HostPort": "22"}}}', dockertypes.CONTAINER_CREATE
    ) == {"ExposedPorts": {"8000/tcp": {}}}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"HostConfig": {"Privileged": 1}}', "must be a boolean, not a number"),
        ('{"HostConfig": {"Privileged": "true"}}', "must be a boolean, not a string"),
        ('{"HostConfig": {"ShmSize": 1.0}}', "must be an integer"),
        ('{"HostConfig": {"ShmSize": 1e3}}', "must be an integer"),
        ('{"HostConfig": {"ShmSize": "1024"}}', "must be an integer"),
        ('{"HostConfig": {"ShmSize": true}}', "must be an integer"),
        ('{"HostConfig": {"ShmSize": 9223372036854775808}}', "out of range"),
        ('{"HostConfig": {"BlkioWeight": 65536}}', "out of range"),
        ('{"HostConfig": {"BlkioWeight": -1}}', "out of range"),
        ('{"HostConfig": {"PidMode": 1}}', "must be a string"),
        ('{"HostConfig": {"Binds": "a:/a"}}', "must be an array"),
        ('{"HostConfig": {"Binds": [1]}}', "must be a string"),
        ('{"HostConfig": {"Tmpfs": ["x"]}}', "must be an object"),
        ('{"HostConfig": []}', "must be an object"),
        ('{"HostConfig": {"CapAdd": {"x": 1}}}', "must be a string or an array"),
        ('{"HostConfig": {"PidMode": "\\ud800"}}', "unpaired surrogate"),
    ],
)
def test_values_go_cannot_decode_into_the_field_are_refused(body: str, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(body.encode(), dockertypes.CONTAINER_CREATE)


def test_int64_bounds_are_go_s() -> None:
    assert host('{"HostConfig": {"ShmSize": 9223372036854775807}}') == {"ShmSize": 2**63 - 1}
    assert host('{"HostConfig": {"ShmSize": -9223372036854775808}}') == {"ShmSize": -(2**63)}
    assert host('{"HostConfig": {"ShmSize": -0}}') == {"ShmSize": 0}


# --- JSON syntax: one strict JSON value, like Go's decoder --------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"HostConfig": {"Privileged": true}} {"x": 1}',  # a second value after the first
        b'{"Image": "a"}x',
        b'\xef\xbb\xbf{"Image": "a"}',  # byte-order mark
        b'{"ShmSize": NaN}',
        b'{"ShmSize": Infinity}',
        b'{"ShmSize": -Infinity}',
        b'{"Image": "a", /* comment */ "Cmd": []}',
        b"{'Image': 'a'}",
        b'{"Image": "a",}',
        b'{"Cmd": ["a",]}',
        b'{"ShmSize": 01}',
        b'{"ShmSize": \xd9\xa1}',  # ARABIC-INDIC DIGIT ONE: a digit to Python's re, not to JSON
        b'{"ShmSize": +1}',
        b'{"Image": "a\x01"}',  # raw control character in a string
        b'{"Privil\xffeged": true}',  # not UTF-8
        b'{"Image": "\\x41"}',  # not a JSON escape
        b"",
        b"   ",
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_text_that_is_not_exactly_one_json_value_is_refused(body: bytes) -> None:
    with pytest.raises(DecodeError):
        parse(body)


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"null", b"1", b"true"])
def test_the_body_must_be_an_object(body: bytes) -> None:
    with pytest.raises(DecodeError, match="must be a JSON object"):
        decode(body, dockertypes.CONTAINER_CREATE)


def test_parse_keeps_every_pair_in_order() -> None:
    value = parse(b'{"a": 1, "A": 2, "a": 3, "f": 1.50, "e": 1E2}')
    assert isinstance(value, Pairs) and [k for k, _ in value] == ["a", "A", "a", "f", "e"]
    assert value[3][1] == "1.50" and value[4][1] == "1E2"  # numbers with a fraction stay literal


def test_whitespace_is_json_s_only() -> None:
    assert host('{\n\t"HostConfig"\r\n :\t{ "Privileged" \n:\ttrue } }') == {"Privileged": True}
    with pytest.raises(DecodeError):
        parse('{"Image":\u00a0"a"}'.encode())  # no-break space is not JSON whitespace


# --- The canonical form ---------------------------------------------------------------------------


def test_encode_is_ascii_canonical_and_decodes_back_to_the_same_value() -> None:
    body = (
        '{"image": "t\u00e9st", "hostconfig": {"bind\u017f": ["v:/\u2603"], "shmsize": 5},'
        ' "Labels": {"k\u00e9y": "v"}, "Env": ["A=\\u0042"]}'
    )
    value = decode(body.encode(), dockertypes.CONTAINER_CREATE)
    canonical = encode(value)
    assert canonical.isascii() and b" " not in canonical
    assert canonical == (
        b'{"Env":["A=B"],"HostConfig":{"Binds":["v:/\\u2603"],"ShmSize":5},'
        b'"Image":"t\\u00e9st","Labels":{"k\\u00e9y":"v"}}'
    )
    assert decode(canonical, dockertypes.CONTAINER_CREATE) == value


def test_generic_types_behave_like_their_go_counterparts() -> None:
    assert Slice(Int(8)).decode([1, None, 3], "x") == [1, 0, 3]
    assert Map(Slice(String())).decode(Pairs([("k", None)]), "x") == {"k": None}
    assert Struct(("A", Int())).decode(None, "x") is ABSENT
