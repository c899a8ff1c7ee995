"""What the OpenAPI document says of request text matches what the API does with it."""

import re
import sys

import pytest
from django.conf import settings
from django.test import Client

from config.schema import NOT_BLANK


def test_text_is_blank_to_the_schema_exactly_when_the_api_strips_it_to_nothing():
    # explicit characters only: \s, \w and \d mean other sets in a client's ECMA regex
    assert not re.search(r"\\[sSwWdD]", NOT_BLANK)
    not_blank = re.compile(NOT_BLANK)
    disagree = [
        hex(code)
        for code in range(sys.maxunicode + 1)
        if bool(not_blank.fullmatch(chr(code))) == chr(code).isspace()
    ]

    assert disagree == []


@pytest.mark.parametrize("version", ["2.0", "a\r\nb", 'x"; filename="other.exe'])
def test_the_schema_is_of_the_api_s_one_version_whatever_version_is_asked(db, version):
    response = Client().get("/api/schema/", {"version": version, "format": "json"})

    assert response.status_code == 200
    assert response.json()["info"]["version"] == settings.SPECTACULAR_SETTINGS["VERSION"]
    assert response.headers["Content-Disposition"] == (
        'inline; filename="Agent Governance Platform API.json"'
    )
