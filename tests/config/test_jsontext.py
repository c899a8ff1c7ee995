"""The JSON text a run's writes are made of."""

import json
from decimal import Decimal
from uuid import UUID

import pytest

from config import jsontext


def test_text_is_compact_and_keys_sort_on_request():
    assert jsontext.dumps({"b": [1, None], "a": "x"}) == '{"b":[1,null],"a":"x"}'
    assert jsontext.dumps({"b": 1, "a": 2}, sort_keys=True) == '{"a":2,"b":1}'


def test_values_the_standard_library_writes_read_back_the_same():
    value = {
        "name": "Zoë 张",
        "id": UUID(int=7),
        1: "key made text",
        "nested": [{"ok": True, "ratio": 0.25}],
    }

    assert json.loads(jsontext.dumps(value)) == json.loads(json.dumps(value, default=str))


@pytest.mark.parametrize(
    "value",
    [{"count": 2**70}, {"text": "half a pair \ud800"}, json.loads("[" * 300 + "]" * 300)],
    ids=["integer beyond 64 bits", "lone surrogate", "deep nesting"],
)
def test_a_value_orjson_refuses_is_written_by_the_standard_library(value):
    text = jsontext.dumps(value)

    assert text == json.dumps(value, separators=(",", ":"))
    assert json.loads(text) == value


def test_a_type_json_lacks_goes_through_default_or_is_refused():
    assert jsontext.dumps({"cost": Decimal("0.10")}, default=str) == '{"cost":"0.10"}'
    with pytest.raises(TypeError, match="Decimal"):
        jsontext.dumps({"cost": Decimal("0.10")})


def _levels(count: int) -> list:
    value: list = []
    for _ in range(count - 1):
        value = [value]
    return value


def test_depth_is_counted_in_objects_and_arrays_at_any_depth():
    assert not jsontext.deeper_than({"a": [1, {"b": "text"}]}, limit=3)
    assert jsontext.deeper_than({"a": [1, {"b": []}]}, limit=3)
    assert not jsontext.deeper_than(_levels(jsontext.MAX_DEPTH))
    assert jsontext.deeper_than(_levels(jsontext.MAX_DEPTH + 1))
    # deeper than the interpreter could recurse
    assert jsontext.deeper_than(_levels(100_000))


@pytest.mark.parametrize(
    "text",
    ["not json", "[" * (jsontext.MAX_DEPTH + 1) + "]" * (jsontext.MAX_DEPTH + 1), "[" * 5000],
)
def test_json_from_outside_that_is_not_json_or_nests_too_deep_is_a_value_error(text):
    with pytest.raises(ValueError):
        jsontext.loads_bounded(text)


def test_json_from_outside_within_the_depth_reads_as_json_postgresql_stores():
    text = "[" * jsontext.MAX_DEPTH + "]" * jsontext.MAX_DEPTH
    assert jsontext.loads_bounded(text) == json.loads(text)
    assert jsontext.loads_bounded('{"a\\u0000": ["\\ud800", NaN]}') == {"a\ufffd": ["\ufffd", None]}


def test_storable_json_keeps_what_postgresql_stores_and_cuts_what_nests_deeper():
    assert jsontext.storable({"a\x00": ["b\ud800", 1.5, float("inf"), True, None]}) == {
        "a\ufffd": ["b\ufffd", 1.5, None, True, None]
    }
    kept = jsontext.storable(_levels(jsontext.MAX_DEPTH + 1))
    for _ in range(jsontext.MAX_DEPTH - 1):
        [kept] = kept
    assert kept == [jsontext.TOO_DEEP]
