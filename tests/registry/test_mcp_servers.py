"""Who may use and register MCP servers."""

import pytest
from django.urls import reverse
from django.utils import timezone

from registry.models import McpRemoteTool, McpServer, McpToolDefinition
from registry.selectors import mcp_server_of, mcp_server_usable
from registry.services import tools
from tests.registry.factories import TenantFactory

pytestmark = pytest.mark.django_db


def server(**values) -> McpServer:
    return McpServer.objects.create(
        name=values.pop("name", "projects"),
        transport=McpServer.Transport.STREAMABLE_HTTP,
        url="http://127.0.0.1:8765/mcp",
        **values,
    )


def test_a_platform_server_serves_only_the_tenants_granted_to_it(acme, globex):
    platform = server()
    platform.granted_tenants.add(acme)

    assert mcp_server_usable(server=platform, tenant=acme)
    assert not mcp_server_usable(server=platform, tenant=globex)
    platform.is_enabled = False
    assert not mcp_server_usable(server=platform, tenant=acme)


def test_a_tenants_own_server_serves_only_that_tenant(acme, globex):
    own = server(tenant=acme)

    assert mcp_server_usable(server=own, tenant=acme)
    assert not mcp_server_usable(server=own, tenant=globex)
    assert not mcp_server_usable(server=None, tenant=acme)


def test_an_evaluation_sandbox_uses_the_servers_its_tenant_may_and_no_other(acme, globex):
    sandbox = TenantFactory(slug="eval-sandbox")
    sandbox.sandbox_of = acme
    sandbox.save(update_fields=["sandbox_of"])
    own, granted = server(tenant=acme), server(name="granted")
    granted.granted_tenants.add(acme)
    others, not_granted = server(tenant=globex), server(name="not-granted")
    not_granted.granted_tenants.add(globex)

    assert mcp_server_usable(server=own, tenant=sandbox)
    assert mcp_server_usable(server=granted, tenant=sandbox)
    assert not mcp_server_usable(server=others, tenant=sandbox)
    assert not mcp_server_usable(server=not_granted, tenant=sandbox)


def server_form_as(client, publisher, tenant) -> dict:
    """Log `publisher` into the admin (as staff); the add form of a server of `tenant`, with
    no inline rows."""
    publisher.is_staff = True
    publisher.save()
    client.force_login(publisher)
    return {
        "tenant": tenant.pk,
        "name": "projects",
        "args": "[]",
        "env": "{}",
        "timeout_s": 10,
        "is_enabled": "on",
        **{
            f"{prefix}-{field}": value
            for prefix in ("remote_tools", "prompts", "resources")
            for field, value in (("TOTAL_FORMS", 0), ("INITIAL_FORMS", 0))
        },
    }


def test_a_publisher_registers_an_http_server_but_no_stdio_command(client, publisher, acme):
    form = server_form_as(client, publisher, acme)
    add = reverse("admin:registry_mcpserver_add")

    refused = client.post(add, {**form, "transport": "stdio", "command": "/bin/sh"})
    accepted = client.post(
        add, {**form, "transport": "streamable_http", "url": "http://127.0.0.1:8765/mcp"}
    )

    assert refused.status_code == 200
    assert "Only platform admins may register stdio servers" in refused.content.decode()
    assert accepted.status_code == 302
    created = McpServer.objects.get()
    assert (created.transport, created.tenant, created.created_by) == (
        "streamable_http",
        acme,
        publisher,
    )
    assert created.history.first().history_user == publisher


def test_a_tenants_http_server_sends_only_a_credential_granted_to_the_tenant(
    client, publisher, acme, settings
):
    # given a publisher of acme in the admin, and one credential granted to acme
    settings.TENANT_CREDENTIALS = {"acme": ["ACME_PROJECTS_TOKEN"]}
    form = server_form_as(client, publisher, acme) | {
        "transport": "streamable_http",
        "url": "http://127.0.0.1:8765/mcp",
    }
    add = reverse("admin:registry_mcpserver_add")

    # when they name the platform's secret key as its bearer token, then the granted one
    refused = client.post(add, {**form, "credential_ref": "SECRET_KEY"})
    accepted = client.post(add, {**form, "credential_ref": "ACME_PROJECTS_TOKEN"})

    # then only the granted credential is accepted
    assert refused.status_code == 200
    assert "The credential SECRET_KEY is not granted to tenant acme" in refused.content.decode()
    assert accepted.status_code == 302
    assert McpServer.objects.get().credential_ref == "ACME_PROJECTS_TOKEN"


def test_an_http_server_s_url_carries_no_secret(client, publisher, acme):
    form = server_form_as(client, publisher, acme) | {"transport": "streamable_http"}
    add = reverse("admin:registry_mcpserver_add")

    with_password = client.post(add, {**form, "url": "https://ci:ghp_s3cret@mcp.example/mcp"})
    with_token = client.post(add, {**form, "url": "https://mcp.example/mcp?access_token=s3cret"})

    assert [response.status_code for response in (with_password, with_token)] == [200, 200]
    assert with_password.context["adminform"].form.errors["url"] == [
        "A URL names no user or password; name the environment variable that holds the secret "
        "in credential_ref instead."
    ]
    assert with_token.context["adminform"].form.errors["url"] == [
        "The query parameter access_token looks like a credential; name the environment "
        "variable that holds the secret in credential_ref instead."
    ]
    assert not McpServer.objects.exists()


def test_a_stdio_server_s_arguments_carry_no_secret(client, platform_admin, acme):
    # given a platform admin's add form of a platform-wide stdio server
    form = server_form_as(client, platform_admin, acme) | {
        "tenant": "",
        "transport": "stdio",
        "command": "/usr/bin/projects-mcp",
    }
    add = reverse("admin:registry_mcpserver_add")

    # when its arguments hold a key, a password or a token, then only where the secret is
    with_key = client.post(add, {**form, "args": '["serve", "--api-key=sk-live-4f9c2a7e1b3d5"]'})
    with_password = client.post(add, {**form, "args": '["--password=hunter2"]'})
    with_token = client.post(add, {**form, "args": '["--token", "ghp_4f9c2a7e1b3d5a6c"]'})
    with_bare_key = client.post(add, {**form, "args": '["serve", "sk-live-4f9c2a7e1b3d5"]'})
    accepted = client.post(
        add,
        {
            **form,
            "args": '["--token-file", "/run/secrets/projects", "--max-tokens", "100"]',
            "env": '{"PROJECTS_TOKEN": "PROJECTS_TOKEN"}',
        },
    )

    # then the arguments holding a secret are refused on the field, by name, not by value
    pointer = (
        "looks like a credential; give the process the secret in env instead, as VARIABLE: "
        "SECRET_REFERENCE, the host's environment variable that holds it."
    )
    refused = (with_key, with_password, with_token, with_bare_key)
    assert [response.status_code for response in refused] == [200, 200, 200, 200]
    assert [response.context["adminform"].form.errors["args"] for response in refused] == [
        [f"The argument --api-key {pointer}"],
        [f"The argument --password {pointer}"],
        [f"The argument --token {pointer}"],
        [f"The argument #2 {pointer}"],
    ]
    assert accepted.status_code == 302
    assert McpServer.objects.get().args == [
        "--token-file",
        "/run/secrets/projects",
        "--max-tokens",
        "100",
    ]


def test_a_server_s_url_and_arguments_carry_no_secret_under_a_look_alike_name(
    client, platform_admin, acme
):
    # given a platform admin's add forms of an HTTP and of a stdio server
    form = server_form_as(client, platform_admin, acme) | {"tenant": ""}
    add = reverse("admin:registry_mcpserver_add")
    http = form | {"transport": "streamable_http"}
    stdio = form | {"transport": "stdio", "command": "/usr/bin/projects-mcp"}

    # when a secret's name is written with letters of another script (Cyrillic a, er, dze,
    # Greek omicron) or with a character that shows nothing (a zero-width non-joiner)
    with_token = client.post(add, {**http, "url": "https://mcp.example/mcp?\u0430ccess_token=s3"})
    with_key = client.post(add, {**http, "url": "https://mcp.example/mcp?api\u200ckey=s3cret"})
    with_password = client.post(add, {**stdio, "args": '["--\u0440\u0430ssword=hunter2"]'})
    with_secret = client.post(add, {**stdio, "args": '["--client-\u0455ecret", "s3cr3t"]'})
    with_token_option = client.post(add, {**stdio, "args": '["--t\u03bfken", "abc123"]'})

    # then each is refused on its field, naming the parameter or option as it was typed
    pointer = (
        "looks like a credential; give the process the secret in env instead, as VARIABLE: "
        "SECRET_REFERENCE, the host's environment variable that holds it."
    )
    assert [response.status_code for response in (with_token, with_key)] == [200, 200]
    assert [
        response.context["adminform"].form.errors["url"] for response in (with_token, with_key)
    ] == [
        [
            "The query parameter \u0430ccess_token looks like a credential; name the environment "
            "variable that holds the secret in credential_ref instead."
        ],
        [
            "The query parameter api\u200ckey looks like a credential; name the environment "
            "variable that holds the secret in credential_ref instead."
        ],
    ]
    refused = (with_password, with_secret, with_token_option)
    assert [response.status_code for response in refused] == [200, 200, 200]
    assert [response.context["adminform"].form.errors["args"] for response in refused] == [
        [f"The argument --\u0440\u0430ssword {pointer}"],
        [f"The argument --client-\u0455ecret {pointer}"],
        [f"The argument --t\u03bfken {pointer}"],
    ]
    assert not McpServer.objects.exists()


def test_a_server_a_published_tool_calls_keeps_its_name(client, publisher, acme, make_tool_version):
    # given acme's server "projects", serving the tool a published version was made from
    projects = server(tenant=acme)
    definition = McpToolDefinition.objects.create(
        server=projects,
        remote_name="status",
        definition_hash="a" * 64,
        definition={"name": "status"},
        proposed_risk="read",
    )
    McpRemoteTool.objects.create(
        server=projects, remote_name="status", current=definition, last_seen_at=timezone.now()
    )
    status = make_tool_version(
        name="status",
        namespace="projects",
        adapter_kind="mcp",
        adapter_config={"server": "projects", "remote_name": "status", "definition_hash": "a" * 64},
    )
    tools.tool_version_publish(tool_version=status, actor=publisher)
    form = server_form_as(client, publisher, acme) | {
        "transport": "streamable_http",
        "url": "http://127.0.0.1:8765/mcp",
    }

    # when its publisher renames the server
    response = client.post(
        reverse("admin:registry_mcpserver_change", args=[projects.pk]),
        {**form, "name": "projects-old"},
    )

    # then the form refuses it, and the published version still calls its server
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["name"] == [
        "Tool versions released from this server call it by its owner and name "
        "(registry.selectors.mcp_server_of): they no longer change."
    ]
    assert mcp_server_of(status) == projects
    assert McpServer.objects.get().name == "projects"
