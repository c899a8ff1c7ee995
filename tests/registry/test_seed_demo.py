"""`manage.py seed_demo`: the running example's content, loaded once and idempotent after."""

from decimal import Decimal
from io import StringIO

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.core.management import call_command

from registry.choices import ApprovalRule, DataClassification, Risk, VersionStatus
from registry.models import (
    AgentConfig,
    McpServer,
    Membership,
    Policy,
    Skill,
    SkillVersion,
    Tenant,
    ToolVersion,
)

User = get_user_model()

DEMO_USERNAMES = ["admin", "alice", "bob", "carol", "dave", "erin"]
DEMO_LOGINS = "demo logins (agents-demo): admin, alice, bob, carol, dave, erin"

PROJECT_SEARCH_SCHEMA = {
    "type": "object",
    "properties": {
        "project_id": {"type": "string"},
        "from": {"type": "string", "format": "date"},
        "to": {"type": "string", "format": "date"},
    },
    "required": ["project_id", "from", "to"],
    "additionalProperties": False,
}
DIRECTORY_LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {
        "project_id": {"type": "string"},
        "role": {"type": "string", "enum": ["研发负责人"]},
    },
    "required": ["project_id", "role"],
    "additionalProperties": False,
}
MAIL_SEND_SCHEMA = {
    "type": "object",
    "properties": {
        "to": {"type": "array", "items": {"type": "string"}},
        "subject": {"type": "string"},
        "body": {"type": "string"},
        "approved_draft_hash": {"type": "string"},
    },
    "required": ["to", "subject", "body", "approved_draft_hash"],
    "additionalProperties": False,
}


def seed() -> list[str]:
    out = StringIO()
    call_command("seed_demo", stdout=out)
    return out.getvalue().splitlines()


def registry_row_counts() -> dict[str, int]:
    """Rows of every registry table, history tables included, and of users."""
    counts = {
        model._meta.label: model.objects.count()
        for model in apps.get_app_config("registry").get_models()
    }
    counts["auth.User"] = User.objects.count()
    return counts


@pytest.fixture
def seeded(db):
    return seed()


def test_first_run_reports_everything_it_created(seeded):
    assert seeded == [
        "created user admin",
        "created tenant acme",
        "created tenant globex",
        "created user alice",
        "created user bob",
        "created user carol",
        "created user dave",
        "created user erin",
        "created tool project_search@2.0.0",
        "created tool directory_lookup@1.0.0",
        "created tool mail_send@1.0.0",
        "created skill weekly-summary@3.2.0",
        "created model config offline-planner",
        "created policy approval-before-side-effects",
        "created agent config weekly-reporter",
        "created MCP server projects",
        "created model config adversarial-planner",
        "created project acme/apollo",
        "created project acme/hermes",
        "created project acme/zephyr",
        "created project acme/atlas",
        "created project globex/portal",
        DEMO_LOGINS,
    ]


def test_acme_gets_the_example_mcp_server_registered_but_nothing_from_it_published(seeded):
    server = McpServer.objects.get()
    assert (server.tenant.slug, server.name, server.transport) == ("acme", "projects", "stdio")
    assert server.args == ["-m", "examples.mcp_server"]
    assert (server.health, server.last_discovered_at) == ("unknown", None)
    assert not ToolVersion.objects.filter(adapter_kind="mcp").exists()


def test_second_run_creates_nothing_and_says_so(seeded):
    before = {
        "users": User.objects.count(),
        "tenants": Tenant.objects.count(),
        "tool versions": ToolVersion.objects.count(),
        "skill versions": SkillVersion.objects.count(),
        "tool version history": ToolVersion.history.count(),
    }

    output = seed()

    after = {
        "users": User.objects.count(),
        "tenants": Tenant.objects.count(),
        "tool versions": ToolVersion.objects.count(),
        "skill versions": SkillVersion.objects.count(),
        "tool version history": ToolVersion.history.count(),
    }
    assert after == before
    assert {key: value for key, value in after.items() if key != "users"} == {
        "tenants": 2,
        "tool versions": 3,
        "skill versions": 1,
        "tool version history": 6,
    }
    assert User.objects.filter(username__in=DEMO_USERNAMES).count() == 6
    assert output == ["demo data already present; nothing changed", DEMO_LOGINS]


def test_second_run_writes_no_row_anywhere_in_the_registry(seeded):
    """Nothing changed must hold for the audit trail too: no history row without a change."""
    before = registry_row_counts()

    seed()

    after = registry_row_counts()
    assert {
        label: (before[label], after[label]) for label in before if before[label] != after[label]
    } == {}


def test_tenants_people_and_roles(seeded):
    assert list(Tenant.objects.values_list("slug", "name")) == [
        ("acme", "Acme Corporation"),
        ("globex", "Globex Inc."),
    ]
    assert set(Membership.objects.values_list("user__username", "tenant__slug", "role")) == {
        ("admin", "acme", "admin"),
        ("alice", "acme", "member"),
        ("bob", "acme", "approver"),
        ("carol", "acme", "auditor"),
        ("dave", "acme", "publisher"),
        ("erin", "globex", "member"),
    }
    seeded_users = User.objects.filter(username__in=DEMO_USERNAMES)
    assert set(seeded_users.values_list("username", "is_staff", "is_superuser")) == {
        ("admin", True, True),
        ("alice", False, False),
        ("bob", False, False),
        ("carol", False, False),
        ("dave", True, False),
        ("erin", False, False),
    }
    assert all(user.check_password("agents-demo") for user in seeded_users)


@pytest.mark.parametrize(
    ("name", "version", "risk", "classification", "schema"),
    [
        ("project_search", "2.0.0", Risk.READ, DataClassification.INTERNAL, PROJECT_SEARCH_SCHEMA),
        (
            "directory_lookup",
            "1.0.0",
            Risk.READ_SENSITIVE,
            DataClassification.CONFIDENTIAL,
            DIRECTORY_LOOKUP_SCHEMA,
        ),
        (
            "mail_send",
            "1.0.0",
            Risk.EXTERNAL_SIDE_EFFECT,
            DataClassification.CONFIDENTIAL,
            MAIL_SEND_SCHEMA,
        ),
    ],
)
def test_tools_are_published_and_current(seeded, name, version, risk, classification, schema):
    tool_version = ToolVersion.objects.select_related("tool__tenant", "published_by").get(
        tool__name=name
    )

    assert tool_version.version == version
    assert tool_version.tool.tenant.slug == "acme"
    assert tool_version.status == VersionStatus.PUBLISHED
    assert tool_version.published_by.username == "admin"
    assert tool_version.published_at is not None
    assert tool_version.tool.current_version_id == tool_version.pk
    assert (tool_version.risk, tool_version.data_classification) == (risk, classification)
    assert tool_version.input_schema == schema
    assert tool_version.adapter_kind == "python"
    assert tool_version.adapter_config == {"handler": f"examples.handlers.{name}"}


def test_mail_send_waits_for_an_approved_workflow_snapshot(seeded):
    mail_send = ToolVersion.objects.get(tool__name="mail_send")

    assert mail_send.approval_rule == ApprovalRule.WORKFLOW_SNAPSHOT_REQUIRED
    assert mail_send.is_idempotent is True
    assert mail_send.input_schema["required"] == ["to", "subject", "body", "approved_draft_hash"]
    assert mail_send.input_schema["additionalProperties"] is False
    assert mail_send.retry_policy == {"max_attempts": 1}
    assert mail_send.timeout_s == 15


def test_weekly_summary_skill_is_published_with_its_full_contract(seeded):
    skill_version = SkillVersion.objects.select_related("skill__tenant").get(
        skill__name="weekly-summary"
    )

    assert (skill_version.version, skill_version.status) == ("3.2.0", VersionStatus.PUBLISHED)
    assert skill_version.skill.tenant.slug == "acme"
    assert skill_version.skill.current_version_id == skill_version.pk
    assert skill_version.triggers == [
        "project weekly status",
        "weekly summary report",
        "项目周报",
        "汇总本周项目状态",
    ]
    assert skill_version.required_inputs == ["project_scope", "date_range", "recipient_role"]
    pinned = {
        dependency.tool_version.pk
        for dependency in skill_version.tool_dependencies.select_related("tool_version")
    }
    assert pinned == set(
        ToolVersion.objects.filter(
            tool__tenant__slug="acme",
            tool__name__in=["project_search", "directory_lookup", "mail_send"],
            status=VersionStatus.PUBLISHED,
        ).values_list("pk", flat=True)
    )
    assert sorted(
        str(dependency.tool_version) for dependency in skill_version.tool_dependencies.all()
    ) == ["directory_lookup@1.0.0", "mail_send@1.0.0", "project_search@2.0.0"]
    assert [(rule["id"], rule["scope"], rule["priority"]) for rule in skill_version.rules] == [
        ("evidence-only", "skill", 100),
        ("single-recipient", "skill", 100),
        ("approval-before-send", "skill", 100),
    ]
    assert all(rule["text"] for rule in skill_version.rules)
    assert skill_version.output_contract == {"sections": ["progress", "risks", "next_steps"]}
    assert skill_version.acceptance_rules == [
        "every risk has a source reference",
        "recipient comes from a versioned directory snapshot",
    ]


def test_agent_binds_the_skill_under_the_approval_policy(seeded):
    agent = AgentConfig.objects.select_related("tenant", "model_config", "policy").get(
        name="weekly-reporter"
    )
    policy = Policy.objects.get(tenant__slug="acme", name="approval-before-side-effects")

    assert agent.tenant.slug == "acme"
    assert list(agent.skills.all()) == [Skill.objects.get(name="weekly-summary")]
    assert agent.policy == policy
    assert (agent.model_config.name, agent.model_config.provider) == (
        "offline-planner",
        "offline",
    )
    assert (agent.max_steps, agent.max_tool_calls, agent.max_cost) == (8, 12, Decimal("0.50"))
    assert "external_side_effect" in policy.approval_required_risks
    assert policy.approval_required_risks == ["external_side_effect", "destructive", "financial"]
    assert policy.approver_roles == ["approver"]
    assert policy.allow_self_approval is False
    assert policy.max_data_classification == DataClassification.CONFIDENTIAL


def test_admin_lists_the_seeded_tools_with_who_published_them(seeded, client):
    assert client.login(username="admin", password="agents-demo")

    response = client.get("/admin/registry/toolversion/")

    assert response.status_code == 200
    rows = response.context["cl"].result_list
    assert sorted((str(row), row.status) for row in rows) == [
        ("directory_lookup@1.0.0", VersionStatus.PUBLISHED),
        ("mail_send@1.0.0", VersionStatus.PUBLISHED),
        ("project_search@2.0.0", VersionStatus.PUBLISHED),
    ]
    for row in rows:
        history = client.get(f"/admin/registry/toolversion/{row.pk}/history/")
        assert history.status_code == 200
        records = [
            (record.history_change_reason, record.history_user.username)
            for record in history.context["page_obj"]
        ]
        assert records == [("published", "admin"), ("draft created", "admin")]
        assert ">admin</a>" in history.content.decode()


def test_demo_publisher_sees_the_seeded_tools_in_the_admin(seeded, client):
    assert client.login(username="dave", password="agents-demo")

    response = client.get("/admin/registry/toolversion/")

    assert response.status_code == 200
    assert sorted(str(row) for row in response.context["cl"].result_list) == [
        "directory_lookup@1.0.0",
        "mail_send@1.0.0",
        "project_search@2.0.0",
    ]
