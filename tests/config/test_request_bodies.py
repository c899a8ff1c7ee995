import json

import pytest

from registry.models import ToolVersion
from tests.registry.factories import tool_content


def _tool_body(**overrides) -> dict:
    body = {"name": "project_search", "version": "1.0.0", **tool_content(), **overrides}
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            json.dumps(_tool_body(description="nul \u0000 inside")),
            "NUL characters are not allowed.",
        ),
        (
            json.dumps(_tool_body(result_contract={"k\u0000": 1})),
            "NUL characters are not allowed.",
        ),
        (
            json.dumps(_tool_body(result_contract=json.loads("[" * 40 + "]" * 40))),
            "JSON nested deeper than 32 levels.",
        ),
        ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than 32 levels."),
    ],
    ids=["nul-in-value", "nul-in-key", "deep", "absurdly-deep"],
)
def test_bodies_postgres_cannot_store_are_refused(api, publisher, acme, body, message):
    client = api.as_user(publisher, acme)

    response = client.post("/api/v1/tools", body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {"code": "VALIDATION_ERROR", "message": message, "details": {}}
    }
    assert not ToolVersion.objects.exists()
