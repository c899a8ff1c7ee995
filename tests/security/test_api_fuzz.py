"""API fuzzing with schemathesis against /api/schema/: every operation, with generated
inputs, by token holders of each role: never a 5xx, and every answer conforms to the schema."""

import json

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, Phase, settings
from schemathesis import checks

from config.wsgi import application
from registry.choices import Role
from registry.services.tenancy import api_token_issue, membership_add
from tests.registry.factories import PASSWORD, UserFactory


def _served_schema() -> dict:
    """The document /api/schema/ serves, generated without a request."""
    document = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(document))


schema = schemathesis.openapi.from_dict(_served_schema())
schema.app = application
# Generated inputs only: the coverage phase's hundreds of boundary cases per operation would
# take most of the suite's time budget.
schema.config.phases.coverage.enabled = False


@pytest.fixture
def wsgi(db, settings):
    """Requests go through the WSGI application (host "localhost") and, as Django's test
    client does, keep the test's database connection (the handler would close it after each
    request, inside the test's transaction)."""
    settings.ALLOWED_HOSTS = ["localhost", "testserver"]
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


# What every answer must satisfy: no server error, and the status, content type, headers and
# body the schema documents for it.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
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


@schema.parametrize()
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_input_makes_the_api_fail_or_break_its_schema(case, wsgi, tokens):
    for role, token in tokens.items():
        response = case.call(headers={"Authorization": f"Token {token}"})
        assert response.status_code < 500, f"{role}: {response.status_code}"
        case.validate_response(response, checks=CHECKS)
