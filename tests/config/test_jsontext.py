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
