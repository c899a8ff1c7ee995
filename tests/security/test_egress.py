"""No tool, model provider or MCP server call reaches the addresses the platform does not call
(EGRESS_DENIED_NETWORKS: by default where clouds serve instance metadata and credentials),
whatever a publisher configured, and whatever name points there."""

import pytest

from registry.choices import Risk
from registry.errors import McpServerUnavailable
from registry.models import McpServer
from registry.services.mcp import mcp_server_discover
from runs.loop import run_execute
from runs.models import Run
from runs.tools.adapters import ToolContext, ToolFailed, http_call, mcp_call
from runs.tools.envelope import ErrorCategory
from tests.mcp import conftest as mcp_fixtures
from tests.mcp.conftest import TOKEN_REF
from tests.runs import conftest as runs_fixtures
from tests.runs import test_http_adapter as http_adapter_tests
from tests.runs.conftest import demo_run
from tests.runs.test_http_adapter import call_context, report_tool

demo = runs_fixtures.demo
model_server = runs_fixtures.model_server
fake_model = runs_fixtures.fake_model
report_service = http_adapter_tests.report_service
http_server = mcp_fixtures.http_server
overrides_path = mcp_fixtures.overrides_path
overrides = mcp_fixtures.overrides
projects = mcp_fixtures.projects
published_status = mcp_fixtures.published_status

REFUSED = "an address the platform does not call"


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[::ffff:169.254.169.254]/latest/meta-data/",
        "http://[fe80::1]/",
        "http://100.100.100.200/latest/meta-data/",
    ],
)
def test_an_http_tool_never_calls_a_metadata_address(url):
    with pytest.raises(ToolFailed) as refused:
        http_call(report_tool(url), call_context(), {"project_id": "apollo"})

    assert REFUSED in str(refused.value)
    assert refused.value.category == ErrorCategory.PERMISSION_DENIED
    assert refused.value.retryable is False
    assert refused.value.may_have_side_effect is False


def test_a_name_that_resolves_to_a_denied_address_is_refused_before_any_request(
    report_service, settings
):
    # given a service reached by name, on a network the operator denied
    settings.EGRESS_DENIED_NETWORKS = ["127.0.0.0/8"]
    url = report_service.url.replace("127.0.0.1", "localhost")

    with pytest.raises(ToolFailed) as refused:
        http_call(report_tool(url), call_context(), {"project_id": "apollo"})

    assert "localhost is at 127.0.0.1" in str(refused.value)
    assert report_service.requests == []


@pytest.mark.django_db
@pytest.mark.parametrize("provider", ["openai_compatible", "anthropic"])
def test_a_model_provider_on_a_denied_network_is_never_called(demo, fake_model, settings, provider):
    fake = fake_model(provider)
    settings.EGRESS_DENIED_NETWORKS = ["127.0.0.0/8"]
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_ERROR")
    assert REFUSED in run.result["output"]["model_error"]
    assert fake.requests == []


@pytest.mark.django_db
def test_an_mcp_server_on_a_denied_network_is_never_called(demo, http_server, settings):
    settings.TENANT_CREDENTIALS = {"acme": [TOKEN_REF]}
    settings.EGRESS_DENIED_NETWORKS = ["127.0.0.0/8"]
    server = McpServer.objects.get(tenant=demo.acme, name="projects")
    server.transport = McpServer.Transport.STREAMABLE_HTTP
    server.url = http_server
    server.credential_ref = TOKEN_REF
    server.save()

    with pytest.raises(McpServerUnavailable) as refused:
        mcp_server_discover(server=server, actor=demo.admin)

    assert REFUSED in str(refused.value)


@pytest.mark.django_db
@pytest.mark.parametrize("transport", ["http"])
def test_a_call_refused_for_its_server_s_address_had_no_effect_and_is_not_retried(
    demo, published_status, settings, transport
):
    # given a published MCP tool that changes something, whose server is then on a denied
    # network
    version = published_status()
    version.risk = Risk.EXTERNAL_SIDE_EFFECT
    settings.EGRESS_DENIED_NETWORKS = ["127.0.0.0/8"]
    context = ToolContext(
        run_id="run-1",
        call_id="call-1",
        tenant=demo.acme,
        actor=demo.alice,
        idempotency_key="run-1:call-1",
    )

    with pytest.raises(ToolFailed) as refused:
        mcp_call(version, context, {"project_id": "apollo"})

    assert REFUSED in str(refused.value)
    assert refused.value.category == ErrorCategory.PERMISSION_DENIED
    assert (refused.value.retryable, refused.value.may_have_side_effect) == (False, False)
