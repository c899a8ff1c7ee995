"""The OpenAPI document at /api/schema/ and the Swagger UI at /api/docs/."""

import re
import uuid

import jsonschema
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from registry.demo import DEMO_PASSWORD
from runs.choices import RunStatus
from tests.approvals.conftest import waiting_run
from tests.evaluations import conftest as evaluation_fixtures
from tests.evaluations.conftest import api_as
from tests.runs import test_ingress_limits
from tests.runs.conftest import message_body

demo = evaluation_fixtures.demo
dave = evaluation_fixtures.dave
suites = evaluation_fixtures.suites
tiny = evaluation_fixtures.tiny
evaluate = evaluation_fixtures.evaluate
low_rates = test_ingress_limits.low_rates

TOKEN = "/api/v1/auth/token/"
MEMORIES = "/api/v1/memories"
DECISION = "/api/v1/approvals/{id}/decision"
V1_PATHS = [
    "/api/v1/auth/token/",
    *(
        path
        for kind in ("tools", "skills")
        for path in (
            f"/api/v1/{kind}",
            f"/api/v1/{kind}/{{id}}",
            f"/api/v1/{kind}/{{id}}/publish",
            f"/api/v1/{kind}/{{id}}/deprecate",
            f"/api/v1/{kind}/{{id}}/revoke",
            f"/api/v1/{kind}/{{id}}/rollback",
        )
    ),
    "/api/v1/messages",
    "/api/v1/attachments",
    "/api/v1/runs",
    "/api/v1/runs/{id}",
    "/api/v1/runs/{id}/events",
    "/api/v1/runs/{id}/cancel",
    "/api/v1/runs/{id}/stream",
    "/api/v1/approvals",
    "/api/v1/approvals/{id}",
    "/api/v1/approvals/{id}/decision",
    "/api/v1/handoffs",
    "/api/v1/handoffs/{id}",
    "/api/v1/handoffs/{id}/resolve",
    "/api/v1/memories",
    "/api/v1/memories/{id}",
    "/api/v1/evaluations/suites",
    "/api/v1/evaluations/suites/{id}",
    "/api/v1/evaluations/runs",
    "/api/v1/evaluations/runs/{id}",
    "/api/v1/evaluations/runs/{id}/results",
    "/api/v1/evaluations/runs/{id}/cancel",
]


@pytest.fixture
def schema(client, db):
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    return response.json()


def _json_schema(node):
    """An OpenAPI 3.0 schema as JSON Schema: `nullable` becomes a null alternative."""
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _json_schema(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


def assert_documented(schema, response, method, path):
    """The response's status is one the operation documents, and its JSON body is valid
    against the schema documented for that status (the error body for a 4xx), as a client
    generated from the schema reads it."""
    responses = schema["paths"][path][method]["responses"]
    status = str(response.status_code)
    documented = responses.get(status) or (responses["4XX"] if status.startswith("4") else None)
    assert documented is not None, (method, path, status, sorted(responses))
    body_schema = documented["content"]["application/json"]["schema"]
    jsonschema.validate(
        response.json(),
        {"allOf": [_json_schema(body_schema)], "components": _json_schema(schema["components"])},
        format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER,
    )


def test_schema_is_served_without_authentication(client, db):
    response = client.get("/api/schema/", {"format": "json"})

    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/vnd.oai.openapi+json")
    document = response.json()
    assert document["openapi"].startswith("3.")
    assert document["info"]["title"] == "Agent Governance Platform API"


def test_schema_lists_every_v1_endpoint(schema):
    assert sorted(path for path in schema["paths"] if path.startswith("/api/v1/")) == sorted(
        V1_PATHS
    )


@pytest.mark.parametrize(
    ("path", "methods"),
    [
        ("/api/v1/auth/token/", {"post"}),
        ("/api/v1/tools", {"get", "post"}),
        ("/api/v1/tools/{id}", {"get"}),
        ("/api/v1/tools/{id}/publish", {"post"}),
        ("/api/v1/tools/{id}/deprecate", {"post"}),
        ("/api/v1/tools/{id}/revoke", {"post"}),
        ("/api/v1/tools/{id}/rollback", {"post"}),
        ("/api/v1/skills", {"get", "post"}),
        ("/api/v1/skills/{id}", {"get"}),
        ("/api/v1/skills/{id}/publish", {"post"}),
        ("/api/v1/skills/{id}/deprecate", {"post"}),
        ("/api/v1/skills/{id}/revoke", {"post"}),
        ("/api/v1/skills/{id}/rollback", {"post"}),
        ("/api/v1/messages", {"post"}),
        ("/api/v1/attachments", {"post"}),
        ("/api/v1/runs", {"get"}),
        ("/api/v1/runs/{id}", {"get"}),
        ("/api/v1/runs/{id}/events", {"get"}),
        ("/api/v1/runs/{id}/cancel", {"post"}),
        ("/api/v1/runs/{id}/stream", {"get"}),
        ("/api/v1/approvals", {"get"}),
        ("/api/v1/approvals/{id}", {"get"}),
        ("/api/v1/approvals/{id}/decision", {"post"}),
        ("/api/v1/handoffs", {"get"}),
        ("/api/v1/handoffs/{id}", {"get"}),
        ("/api/v1/handoffs/{id}/resolve", {"post"}),
        ("/api/v1/evaluations/suites", {"get"}),
        ("/api/v1/evaluations/runs", {"get", "post"}),
        ("/api/v1/evaluations/runs/{id}/results", {"get"}),
        ("/api/v1/evaluations/runs/{id}/cancel", {"post"}),
    ],
)
def test_schema_documents_the_methods_of_each_endpoint(schema, path, methods):
    operations = {key for key in schema["paths"][path] if key != "parameters"}

    assert operations == methods


def test_schema_declares_token_authentication(schema):
    assert schema["components"]["securitySchemes"]["tokenAuth"] == {
        "type": "apiKey",
        "in": "header",
        "name": "Authorization",
        "description": 'Send "Token <key>" (or "Bearer <key>") from POST /api/v1/auth/token/.',
    }
    # every registry operation asks for the token; getting one asks for nothing
    for path in V1_PATHS[1:]:
        for method, operation in schema["paths"][path].items():
            assert operation["security"] == [{"tokenAuth": []}], (path, method)
    token_requirements = schema["paths"]["/api/v1/auth/token/"]["post"].get("security", [])
    assert [requirement for requirement in token_requirements if requirement] == []
    assert "security" not in schema


def test_docs_page_serves_swagger_ui_from_local_static_files(client, db):
    response = client.get("/api/docs/")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]*swagger-ui[^"]*)"', html)
    assert assets, html
    assert all(asset.startswith("/static/drf_spectacular_sidecar/") for asset in assets), assets
    assert "cdn.jsdelivr.net" not in html
    assert "unpkg.com" not in html
    # the page's own script is a file too (the Content-Security-Policy runs no inline one)
    assert "<script>" not in html
    (script,) = re.findall(r'<script src="(/api/docs/\?script=?)"', html)
    setup = client.get(script)
    assert setup.status_code == 200
    assert "javascript" in setup["Content-Type"]
    assert "/api/schema/" in setup.content.decode()


@pytest.mark.parametrize(
    ("kind", "component"), [("tools", "ToolVersion"), ("skills", "SkillVersion")]
)
@pytest.mark.parametrize("command", ["publish", "deprecate", "revoke", "rollback"])
def test_each_kind_documents_its_own_version_body(schema, kind, component, command):
    operation = schema["paths"][f"/api/v1/{kind}/{{id}}/{command}"]["post"]

    body = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{component}"}


def test_every_operation_documents_the_error_body(schema):
    error = schema["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    assert error["properties"]["error"]["required"] == ["code", "message", "details"]
    for path in V1_PATHS:
        for operation in schema["paths"][path].values():
            reference = operation["responses"]["4XX"]["content"]["application/json"]["schema"]
            assert reference == {"$ref": "#/components/schemas/Error"}


def test_the_results_of_an_eval_run_are_documented_as_a_page(schema, demo, tiny, evaluate):
    eval_run = evaluate(tiny)
    client = api_as("dave", demo.acme)

    response = client.get(f"/api/v1/evaluations/runs/{eval_run.pk}/results", {"page_size": 1})

    assert response.status_code == 200
    assert response.json()["count"] == 2
    assert_documented(schema, response, "get", "/api/v1/evaluations/runs/{id}/results")
    parameters = schema["paths"]["/api/v1/evaluations/runs/{id}/results"]["get"]["parameters"]
    assert {parameter["name"] for parameter in parameters} == {"id", "page", "page_size"}


@pytest.mark.parametrize(
    ("component", "field"),
    [("MessageAccepted", "status"), ("Run", "status"), ("Handoff", "run_status")],
)
def test_each_run_status_is_documented_as_the_run_status_enum(schema, component, field):
    documented = schema["components"]["schemas"][component]["properties"][field]

    assert {"$ref": "#/components/schemas/RunStatusEnum"} in [
        documented,
        *documented.get("allOf", []),
    ]
    assert schema["components"]["schemas"]["RunStatusEnum"]["enum"] == [*RunStatus.values]


def test_a_message_run_and_its_events_answer_as_documented(schema, demo):
    client = api_as("alice", demo.acme)
    posted = client.post(
        "/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY="schema-1"
    )
    again = client.post(
        "/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY="schema-1"
    )
    reused = client.post(
        "/api/v1/messages", message_body("Other."), format="json", HTTP_IDEMPOTENCY_KEY="schema-1"
    )
    keyless = client.post("/api/v1/messages", message_body(), format="json")
    run_id = posted.json()["run_id"]
    answers = [
        (posted, "post", "/api/v1/messages", 202),
        (again, "post", "/api/v1/messages", 200),
        (reused, "post", "/api/v1/messages", 409),
        (keyless, "post", "/api/v1/messages", 400),
        (client.get("/api/v1/runs", {"status": "QUEUED"}), "get", "/api/v1/runs", 200),
        (client.get(f"/api/v1/runs/{run_id}"), "get", "/api/v1/runs/{id}", 200),
        (client.get(f"/api/v1/runs/{run_id}/events"), "get", "/api/v1/runs/{id}/events", 200),
        (client.post(f"/api/v1/runs/{run_id}/cancel"), "post", "/api/v1/runs/{id}/cancel", 200),
        (client.get(f"/api/v1/runs/{uuid.uuid4()}"), "get", "/api/v1/runs/{id}", 404),
        (APIClient().get("/api/v1/runs"), "get", "/api/v1/runs", 401),
    ]

    for response, method, path, status in answers:
        assert response.status_code == status, (method, path, response.json())
        assert_documented(schema, response, method, path)


def test_the_stream_documents_only_parameters_it_serves(schema, demo):
    """The stream serves server-sent events and nothing else: no `format` to choose, and a
    client asking for another is refused with the documented error body."""
    client = api_as("alice", demo.acme)
    posted = client.post(
        "/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY="schema-stream"
    )
    operation = schema["paths"]["/api/v1/runs/{id}/stream"]["get"]

    refused = client.get(f"/api/v1/runs/{posted.json()['run_id']}/stream", {"format": "json"})

    assert {parameter["name"] for parameter in operation["parameters"]} == {
        "id",
        "after",
        "Last-Event-ID",
    }
    assert list(operation["responses"]["200"]["content"]) == ["text/event-stream"]
    assert refused.status_code == 406
    assert_documented(schema, refused, "get", "/api/v1/runs/{id}/stream")


def test_an_approval_and_its_decisions_answer_as_documented(schema, demo):
    _, action = waiting_run(demo)
    approver, requester = api_as("bob", demo.acme), api_as("alice", demo.acme)
    decision = f"/api/v1/approvals/{action.pk}/decision"
    body = {"decision": "approve", "payload_hash": action.payload_hash}
    answers = [
        (approver.get("/api/v1/approvals", {"status": "pending"}), "get", "/api/v1/approvals", 200),
        (approver.get(f"/api/v1/approvals/{action.pk}"), "get", "/api/v1/approvals/{id}", 200),
        (requester.post(decision, body, format="json"), "post", DECISION, 403),
        (
            approver.post(decision, {**body, "payload_hash": "0" * 64}, format="json"),
            "post",
            DECISION,
            409,
        ),
        (approver.post(decision, body, format="json"), "post", DECISION, 200),
        (approver.post(decision, body, format="json"), "post", DECISION, 409),
        (approver.get(f"/api/v1/approvals/{action.pk}"), "get", "/api/v1/approvals/{id}", 200),
    ]

    for response, method, path, status in answers:
        assert response.status_code == status, (method, path, response.json())
        assert_documented(schema, response, method, path)


def test_suites_and_eval_runs_answer_as_documented(schema, demo, suites, tiny, evaluate):
    eval_run = evaluate(tiny)
    client = api_as("dave", demo.acme)
    platform_suite = suites["weekly-summary-tasks"]
    answers = [
        (client.get("/api/v1/evaluations/suites"), "get", "/api/v1/evaluations/suites"),
        (
            client.get(f"/api/v1/evaluations/suites/{platform_suite.pk}"),
            "get",
            "/api/v1/evaluations/suites/{id}",
        ),
        (
            client.get(f"/api/v1/evaluations/suites/{suites['prompt-injection-attacks'].pk}"),
            "get",
            "/api/v1/evaluations/suites/{id}",
        ),
        (client.get("/api/v1/evaluations/runs"), "get", "/api/v1/evaluations/runs"),
        (
            client.get(f"/api/v1/evaluations/runs/{eval_run.pk}"),
            "get",
            "/api/v1/evaluations/runs/{id}",
        ),
    ]

    assert platform_suite.tenant is None
    for response, method, path in answers:
        assert response.status_code == 200, (method, path, response.json())
        assert_documented(schema, response, method, path)


def test_the_registry_memory_attachments_and_token_answer_as_documented(schema, demo):
    client, member = api_as("dave", demo.acme), api_as("alice", demo.acme)
    tool = client.get("/api/v1/tools").json()["results"][0]
    skill = client.get("/api/v1/skills").json()["results"][0]
    remembered = {"kind": "preference", "key": "report.language", "value": "English"}
    upload = SimpleUploadedFile("notes.txt", b"Apollo is on track.", content_type="text/plain")
    answers = [
        (client.get("/api/v1/tools", {"page_size": 200}), "get", "/api/v1/tools", 200),
        (client.get(f"/api/v1/tools/{tool['id']}"), "get", "/api/v1/tools/{id}", 200),
        (client.get("/api/v1/skills", {"page_size": 200}), "get", "/api/v1/skills", 200),
        (client.get(f"/api/v1/skills/{skill['id']}"), "get", "/api/v1/skills/{id}", 200),
        (member.post("/api/v1/memories", remembered, format="json"), "post", MEMORIES, 201),
        (member.post("/api/v1/memories", remembered, format="json"), "post", MEMORIES, 200),
        (member.post("/api/v1/memories", {"kind": "x"}, format="json"), "post", MEMORIES, 400),
        (member.get(MEMORIES), "get", MEMORIES, 200),
        (
            member.post("/api/v1/attachments", {"file": upload}, format="multipart"),
            "post",
            "/api/v1/attachments",
            201,
        ),
        (member.get("/api/v1/handoffs"), "get", "/api/v1/handoffs", 200),
        (
            APIClient().post(
                "/api/v1/auth/token/",
                {"username": "dave", "password": DEMO_PASSWORD, "tenant": "acme"},
                format="json",
            ),
            "post",
            "/api/v1/auth/token/",
            200,
        ),
        (
            APIClient().post(
                "/api/v1/auth/token/", {"username": "dave", "password": "wrong"}, format="json"
            ),
            "post",
            "/api/v1/auth/token/",
            400,
        ),
    ]

    for response, method, path, status in answers:
        assert response.status_code == status, (method, path, response.json())
        assert_documented(schema, response, method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [("post", "/api/v1/messages"), ("post", "/api/v1/attachments"), ("post", TOKEN)],
)
def test_each_rate_limited_operation_documents_its_429_and_retry_after(schema, method, path):
    responses = schema["paths"][path][method]["responses"]

    for status, code in (("429", "RATE_LIMITED"), ("503", "SERVICE_UNAVAILABLE")):
        assert code in responses[status]["description"]
        assert responses[status]["content"] == {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
        }
        assert responses[status]["headers"]["Retry-After"]["schema"] == {
            "type": "integer",
            "minimum": 1,
        }
        assert responses[status]["headers"]["Retry-After"]["required"] is True
    # the operations no rate limits leave without a 429 of their own
    assert "429" not in schema["paths"]["/api/v1/runs"]["get"]["responses"]


def test_a_refusal_over_the_rate_answers_as_documented(schema, low_rates, demo):
    alice = api_as("alice", demo.acme)
    for number in range(2):
        alice.post(
            "/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY=f"k{number}"
        )

    refused = alice.post(
        "/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY="k2"
    )

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "RATE_LIMITED"
    assert_documented(schema, refused, "post", "/api/v1/messages")
    documented = schema["paths"]["/api/v1/messages"]["post"]["responses"]["429"]["headers"]
    assert int(refused["Retry-After"]) >= documented["Retry-After"]["schema"]["minimum"]
