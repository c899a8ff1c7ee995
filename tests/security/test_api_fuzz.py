"""API fuzzing with schemathesis against /api/schema/: every operation, with generated
inputs, by token holders of each role: never a 5xx, every answer conforms to the schema, data
the schema calls valid is accepted (or refused only for what no schema can state), data it
calls invalid is refused, and no operation that requires a token answers without one."""

import json
import os

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, given, settings, strategies
from schemathesis import GenerationMode, checks

from config.wsgi import application
from registry.choices import Role
from registry.services.tenancy import api_token_issue, membership_add
from tests.registry.factories import PASSWORD, UserFactory
from tests.security.fuzzing import FUZZ_COUNTS


def _served_schema() -> dict:
    """The document /api/schema/ serves, generated without a request."""
    document = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(document))


schema = schemathesis.openapi.from_dict(_served_schema())
schema.app = application
# Generated inputs only: the coverage phase's hundreds of boundary cases per operation would
# take most of the suite's time budget.
schema.config.phases.coverage.enabled = False
# No JSON string the API reads may hold NUL (PostgreSQL cannot store it): the parser refuses it
# in any field, nested documents included, which a schema cannot say of free-form documents.
schema.config.generation.update(allow_x00=False)


@pytest.fixture
def wsgi(requests_keep_connection, settings):
    """Requests go through the WSGI application (host "localhost"), keeping the test's
    database connection."""
    settings.ALLOWED_HOSTS = ["localhost", "testserver"]


# A well-formed request can still be refused for what the schema cannot state: facts stored in
# the tenant, or a rule across fields. For each operation where that happens: the error codes
# such a refusal may carry, with the detail keys it may name (None: any), and why. Any other
# refusal of schema-valid data is a gap in the schema.
REFUSED_BEYOND_THE_SCHEMA = {
    "GET /api/v1/runs": (
        {"VALIDATION_ERROR": {"created_after", "created_before"}},
        "a created range must not end before it starts",
    ),
    "POST /api/v1/auth/token/": (
        {"VALIDATION_ERROR": {"non_field_errors", "tenant"}},
        "the credentials must be a user's, the tenant one of theirs",
    ),
    "POST /api/v1/attachments": (
        {"UNSUPPORTED_MEDIA_TYPE": None, "VALIDATION_ERROR": {"file"}},
        "the content must show the declared media type (magic bytes); a part without a "
        "file name is no file",
    ),
    "POST /api/v1/evaluations/runs": (
        {"VALIDATION_ERROR": {"suite", "skill_version", "agent_config", "model_config"}},
        "the suite, skill version and configurations must exist in the tenant",
    ),
    "POST /api/v1/memories": (
        {"VALIDATION_ERROR": {"reason"}},
        "a confidential or restricted item needs consent",
    ),
    "POST /api/v1/messages": (
        {"VALIDATION_ERROR": {"parts", "metadata"}},
        "attachments must be the actor's uploads, one text part must hold words, "
        "a project must be one the actor may see",
    ),
    "POST /api/v1/skills": (
        {"VALIDATION_ERROR": {"__all__", "tool_dependencies", "rules"}},
        "the version must be new, pinned tools published and granted, rule ids unique",
    ),
    "POST /api/v1/tools": (
        {"VALIDATION_ERROR": {"__all__", "input_schema", "adapter_config", "risk"}},
        "the version must be new, the input schema valid JSON Schema declaring what it "
        "requires and referring only to itself, the adapter config the one of its adapter "
        "kind, an MCP tool's risk no lower than its server proposes",
    ),
}
ACCEPTED = {*range(200, 400), 401, 403, 404, 409, 429}


@schemathesis.check
def refused_only_beyond_the_schema(ctx, response, case):
    """Schema-valid data is accepted, or refused only as REFUSED_BEYOND_THE_SCHEMA allows."""
    if not case.meta.generation.mode.is_positive or response.status_code in ACCEPTED:
        return None
    allowed, why = REFUSED_BEYOND_THE_SCHEMA[case.operation.label]
    error = response.json()["error"]
    fields = allowed.get(error["code"], set())
    named = set(error["details"])
    assert error["code"] in allowed and (fields is None or named <= fields), (
        f"schema-valid data refused with {response.status_code} {error}; "
        f"only {sorted(allowed)} may refuse it here ({why})"
    )
    return None


# What every answer must satisfy: no server error, and the status, content type, headers and
# body the schema documents for it; the schema's word on valid and invalid data holds; a token
# is required where the schema says so.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
    checks.ignored_auth,
]


@pytest.fixture
def tokens(acme):
    """A token of acme for a user of each role."""
    tokens = {}
    for role in Role:
        user = UserFactory(username=f"fuzz-{role}")
        membership_add(actor=None, user=user, tenant=acme, role=role)
        tokens[role] = api_token_issue(
            username=user.username, password=PASSWORD, tenant_slug=acme.slug
        )[1]
    return tokens


# Cases per operation: 4 keeps the suite inside its time budget; FUZZ_EXAMPLES=50 looks deeper.
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "4"))


OPERATIONS = {result.ok().label: result.ok() for result in schema.get_all_operations()}


# One test per operation, named by it (so that pytest-xdist can tell them apart), drawing valid
# and invalid requests alike.
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_input_makes_the_api_fail_or_break_its_schema(label, wsgi, tokens):
    operation = OPERATIONS[label]
    if label in REFUSED_BEYOND_THE_SCHEMA:
        acceptance = refused_only_beyond_the_schema
    else:
        acceptance = checks.positive_data_acceptance
    cases = strategies.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=cases)
    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        FUZZ_COUNTS[f"op {label}"] += 1
        FUZZ_COUNTS[case.meta.generation.mode.value] += 1
        for role, token in _credentials(case, tokens).items():
            headers = {"Authorization": f"Token {token}"} if token else {}
            response = case.call(headers=headers)
            FUZZ_COUNTS["requests"] += 1
            FUZZ_COUNTS[f"{response.status_code // 100}xx"] += 1
            assert response.status_code < 500, f"{role}: {response.status_code}"
            case.validate_response(response, checks=[*CHECKS, acceptance], headers=headers)

    fuzz()


def _credentials(case, tokens) -> dict:
    """A token of each role; none for a case generated without one on purpose (a negative
    case leaving the token out), which must then be refused."""
    if case.meta.generation.mode.is_negative and "Authorization" not in (case.headers or {}):
        return {"anonymous": None}
    return tokens


def test_every_operation_refused_beyond_the_schema_is_one_the_api_has():
    assert set(REFUSED_BEYOND_THE_SCHEMA) <= set(OPERATIONS)
