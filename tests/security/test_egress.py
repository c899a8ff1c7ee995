"""No tool, model provider or MCP server call reaches the addresses the platform does not call
(EGRESS_DENIED_NETWORKS: by default where clouds serve instance metadata and credentials),
whatever a publisher configured, and whatever name points there."""

import socket
import threading
import time

import pytest

from registry.choices import Risk
from registry.errors import McpServerUnavailable
from registry.models import McpServer
from registry.services.common import registry_object_save
from registry.services.mcp import mcp_server_discover
from runs.loop import ModelTemporarilyUnavailable, run_execute
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

# A name that answers an allowed address when first resolved and the local servers' address,
# which the tests deny, on every later resolution (DNS rebinding). The allowed address is on
# the loopback network too, so that nothing leaves the machine: no server listens there.
REBINDING_HOST = "rebinding.test"
ALLOWED, DENIED = "127.0.0.2", "127.0.0.1"


@pytest.fixture
def rebinding(monkeypatch, settings) -> list[str]:
    """The resolver answers REBINDING_HOST as above; what it answered, in order."""
    settings.EGRESS_DENIED_NETWORKS = [f"{DENIED}/32"]
    resolve = socket.getaddrinfo
    answered: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if (host.decode() if isinstance(host, bytes) else host) != REBINDING_HOST:
            return resolve(host, port, *args, **kwargs)
        answered.append(DENIED if answered else ALLOWED)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answered[-1], int(port or 0)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answered


# A name whose resolver does not answer until the test ends (at most this long).
SLOW_HOST = "slow-resolver.test"
RESOLVER_HANG_MAX_SECONDS = 30


@pytest.fixture
def slow_resolver(monkeypatch):
    """The resolver answers SLOW_HOST (with an allowed address) only when the test ends."""
    resolve = socket.getaddrinfo
    released = threading.Event()

    def getaddrinfo(host, port, *args, **kwargs):
        if (host.decode() if isinstance(host, bytes) else host) != SLOW_HOST:
            return resolve(host, port, *args, **kwargs)
        released.wait(RESOLVER_HANG_MAX_SECONDS)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ALLOWED, int(port or 0)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    released.set()


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


def test_an_http_tool_connects_to_the_address_it_checked(report_service, rebinding):
    # given a service whose name answers an allowed address first, then a denied one
    url = report_service.url.replace(DENIED, REBINDING_HOST)

    with pytest.raises(ToolFailed) as failed:
        http_call(report_tool(url), call_context(), {"project_id": "apollo"})

    # then the call went to the allowed address it checked, where nothing answers, and never
    # to the address the name answered next
    assert failed.value.category == ErrorCategory.UPSTREAM_ERROR
    assert str(failed.value) == "The service could not be reached."
    assert rebinding == [ALLOWED]
    assert report_service.requests == []


def test_a_name_with_any_denied_address_is_refused(report_service, monkeypatch, settings):
    # given a service whose name answers an allowed and a denied address at once
    settings.EGRESS_DENIED_NETWORKS = [f"{DENIED}/32"]
    resolve = socket.getaddrinfo
    answer = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in (ALLOWED, DENIED)
    ]
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *args, **kwargs: (
            answer if host == REBINDING_HOST else resolve(host, *args, **kwargs)
        ),
    )
    url = report_service.url.replace(DENIED, REBINDING_HOST)

    with pytest.raises(ToolFailed) as refused:
        http_call(report_tool(url), call_context(), {"project_id": "apollo"})

    assert str(refused.value) == f"{REBINDING_HOST} is at {DENIED}, {REFUSED}."
    assert refused.value.category == ErrorCategory.PERMISSION_DENIED
    assert (refused.value.retryable, refused.value.may_have_side_effect) == (False, False)
    assert report_service.requests == []


@pytest.mark.django_db
@pytest.mark.parametrize("provider", ["openai_compatible", "anthropic"])
def test_a_model_provider_is_called_only_at_the_address_checked(
    demo, fake_model, rebinding, provider
):
    # given the agent moved to a model config of the provider by a name that answers an
    # allowed address first, then a denied one
    fake = fake_model(provider)
    config = demo.agent.model_config
    config.pk, config._state.adding = None, True
    config.name = f"{config.name}-by-name"
    config.base_url = config.base_url.replace(DENIED, REBINDING_HOST)
    demo.agent.model_config = registry_object_save(
        instance=config, actor=demo.admin, reason="provider by name"
    )
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="provider by name")
    run = demo_run(demo, project_id="apollo")

    # then the turn went to the allowed address it checked, where nothing answers (a failure
    # the run's task tries again), and never to the address the name answered next
    with pytest.raises(ModelTemporarilyUnavailable, match="could not be reached"):
        run_execute(run_id=str(run.pk))

    assert fake.requests == []
    assert rebinding == [ALLOWED]


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


@pytest.mark.django_db
def test_an_mcp_server_is_connected_to_only_at_the_address_checked(demo, report_service, rebinding):
    # given an MCP server whose name answers an allowed address first, then a denied one
    server = McpServer.objects.get(tenant=demo.acme, name="projects")
    server.transport = McpServer.Transport.STREAMABLE_HTTP
    server.url = report_service.url.replace(DENIED, REBINDING_HOST)
    server.credential_ref = ""
    server.save()

    with pytest.raises(McpServerUnavailable) as refused:
        mcp_server_discover(server=server, actor=demo.admin)

    # then the connection was refused for the address the name answered when it was made
    assert report_service.requests == []
    assert f"{REBINDING_HOST} is at {DENIED}, {REFUSED}." in str(refused.value)
    assert rebinding == [ALLOWED, DENIED]


@pytest.fixture
def proxy_environment(report_service, monkeypatch) -> str:
    """The environment names the report service as the HTTP proxy (it answers what it is
    asked, as a forward proxy would pass it on); returns the proxy's URL."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    proxy = report_service.url.rsplit("/", 1)[0]
    monkeypatch.setenv("HTTP_PROXY", proxy)
    return proxy


def test_an_http_tool_goes_through_the_environment_s_proxy(report_service, proxy_environment):
    # given a service the platform reaches only through the proxy (its name resolves nowhere)
    url = "http://reports.internal.test/report"

    http_call(report_tool(url), call_context(), {"project_id": "apollo"})

    [request] = report_service.requests
    assert request["path"] == url


def test_a_host_no_proxy_names_is_called_directly(report_service, proxy_environment, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")

    http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    [request] = report_service.requests
    assert request["path"] == "/report"


def test_a_call_through_the_proxy_to_a_denied_address_is_refused(
    report_service, proxy_environment, settings
):
    settings.EGRESS_DENIED_NETWORKS = ["169.254.0.0/16"]

    with pytest.raises(ToolFailed) as refused:
        http_call(
            report_tool("http://169.254.169.254/latest/meta-data/"),
            call_context(),
            {"project_id": "apollo"},
        )

    assert REFUSED in str(refused.value)
    assert refused.value.category == ErrorCategory.PERMISSION_DENIED
    assert report_service.requests == []


def test_a_name_not_resolved_within_the_tools_timeout_fails_the_call_then(
    report_service, slow_resolver
):
    # given a tool that changes something, whose service's name server does not answer
    tool = report_tool(report_service.url.replace(DENIED, SLOW_HOST), timeout_s=1)
    tool.risk = Risk.INTERNAL_WRITE

    started = time.monotonic()
    with pytest.raises(ToolFailed) as failed:
        http_call(tool, call_context(), {"project_id": "apollo"})
    elapsed = time.monotonic() - started

    # then the call failed TIMEOUT within its second, having sent nothing
    assert 1 <= elapsed < 2
    assert failed.value.category == ErrorCategory.TIMEOUT
    assert str(failed.value) == "The service could not be reached in time."
    assert (failed.value.retryable, failed.value.may_have_side_effect) == (True, False)
    assert report_service.requests == []
