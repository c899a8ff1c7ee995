"""The registry admin through the test client: scope by role, lifecycle actions that call the
services, content validation in forms, frozen published versions, history and diffs."""

import json
import re
import threading
from collections import Counter
from decimal import Decimal
from html import escape

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from guardian.shortcuts import get_group_perms

from registry.choices import ApprovalRule, Risk, Role, VersionStatus
from registry.models import (
    AgentConfig,
    ApiToken,
    ModelConfig,
    Policy,
    RolloutFlag,
    Tool,
    ToolVersion,
)
from registry.services import common, skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue, definition_grant, membership_add
from registry.services.tools import TOOL_CONTENT_FIELDS
from tests.locks import until, waiting_on_locks
from tests.registry.factories import (
    PASSWORD,
    TenantFactory,
    UserFactory,
    skill_content,
    tool_content,
    valid_input_schema,
)

TOOL_VERSIONS = "/admin/registry/toolversion/"


# --- helpers -------------------------------------------------------------------------------


def messages_of(response) -> list[tuple[str, str]]:
    return [(message.level_tag, str(message)) for message in response.context["messages"]]


def listed_pks(response) -> set:
    return {row.pk for row in response.context["cl"].result_list}


def run_action(client, action: str, *versions, url: str = TOOL_VERSIONS, follow: bool = True):
    return client.post(
        url,
        {"action": action, "_selected_action": [str(version.pk) for version in versions]},
        follow=follow,
    )


def tool_version_form(tool=None, **overrides) -> dict:
    """What the add/change form of a tool version posts, with JSON fields as text."""
    data = {
        "version": "1.1.0",
        "description": "Reads a project's status and its milestones.",
        "when_not_to_use": "Not for people.",
        "returns": "Tasks and milestones.",
        "input_schema": json.dumps(valid_input_schema()),
        "result_contract": "{}",
        "risk": Risk.READ,
        "timeout_s": "10",
        "retry_policy": "{}",
        "rate_limit": "{}",
        "concurrency_cap": "4",
        "circuit_breaker": "{}",
        "approval_rule": ApprovalRule.NONE,
        "data_classification": "internal",
        "adapter_kind": "python",
        "adapter_config": json.dumps({"handler": "examples.handlers.project_search"}),
    }
    if tool is not None:
        data["tool"] = str(tool.pk)
    data.update(overrides)
    return data


def query_shapes(queries: CaptureQueriesContext) -> Counter:
    """How often each statement ran, its parameters blanked out: a query per row shows up."""
    return Counter(
        re.sub(r"'[^']*'|\b\d+\b", "?", query["sql"]) for query in queries.captured_queries
    )


def history_rows(version) -> int:
    return type(version).history.filter(id=version.pk).count()


# --- every changelist, its filters and search, every add form ------------------------------

ALL_ROWS = {
    "tenant": ["acme", "globex"],
    "membership": ["alice_membership", "dave_membership", "erin_membership", "gus_membership"],
    "apitoken": ["dave_token", "erin_token"],
    "tool": ["project_search", "mail_send"],
    "toolversion": ["project_search_1", "project_search_2", "mail_send_1"],
    "skill": ["weekly_summary"],
    "skillversion": ["weekly_summary_1", "weekly_summary_1_1"],
    "modelconfig": ["offline_planner", "acme_gpt"],
    "agentconfig": ["weekly_reporter", "globex_helper"],
    "policy": ["strict", "lenient"],
    "rolloutflag": ["canary_flag", "paused_flag"],
}


@pytest.mark.parametrize(("model_name", "expected"), ALL_ROWS.items())
def test_changelist_lists_every_row_for_platform_admin(
    client, platform_admin, world, model_name, expected
):
    client.force_login(platform_admin)

    response = client.get(f"/admin/registry/{model_name}/")

    assert response.status_code == 200
    assert listed_pks(response) == {getattr(world, name).pk for name in expected}


FILTERED = [
    ("tenant", "q=glob", ["globex"]),
    ("membership", "q=erin", ["erin_membership"]),
    ("membership", "role__exact=publisher", ["dave_membership", "gus_membership"]),
    ("membership", "tenant__id__exact={acme}", ["alice_membership", "dave_membership"]),
    ("apitoken", "q=erin", ["erin_token"]),
    ("apitoken", "tenant__id__exact={acme}", ["dave_token"]),
    ("tool", "q=project", ["project_search"]),
    ("tool", "tenant__id__exact={globex}", ["mail_send"]),
    ("toolversion", "q=project", ["project_search_1", "project_search_2"]),
    ("toolversion", "status__exact=published", ["project_search_1", "mail_send_1"]),
    ("toolversion", "status__exact=draft", ["project_search_2"]),
    ("toolversion", "risk__exact=external_side_effect", ["mail_send_1"]),
    ("toolversion", "tool__tenant__id__exact={acme}", ["project_search_1", "project_search_2"]),
    ("toolversion", "q=project&status__exact=published", ["project_search_1"]),
    ("toolversion", "q=nothing-matches-this", []),
    ("skill", "q=weekly", ["weekly_summary"]),
    ("skillversion", "status__exact=draft", ["weekly_summary_1_1"]),
    ("skillversion", "q=1.1", ["weekly_summary_1_1"]),
    ("modelconfig", "provider__exact=offline", ["offline_planner"]),
    ("modelconfig", "q=gpt", ["acme_gpt"]),
    ("agentconfig", "q=weekly", ["weekly_reporter"]),
    ("agentconfig", "tenant__id__exact={globex}", ["globex_helper"]),
    ("policy", "allow_self_approval__exact=1", ["lenient"]),
    ("policy", "q=strict", ["strict"]),
    ("rolloutflag", "q=canary", ["canary_flag"]),
    ("rolloutflag", "is_active__exact=0", ["paused_flag"]),
]


@pytest.mark.parametrize(("model_name", "query", "expected"), FILTERED)
def test_changelist_filters_and_search_return_the_matching_rows(
    client, platform_admin, world, model_name, query, expected
):
    client.force_login(platform_admin)

    response = client.get(
        f"/admin/registry/{model_name}/?" + query.format(acme=world.acme.pk, globex=world.globex.pk)
    )

    assert response.status_code == 200
    assert listed_pks(response) == {getattr(world, name).pk for name in expected}


@pytest.mark.parametrize("model_name", [name for name in ALL_ROWS if name != "apitoken"])
def test_add_form_renders_for_platform_admin(client, platform_admin, world, model_name):
    client.force_login(platform_admin)

    response = client.get(f"/admin/registry/{model_name}/add/")

    assert response.status_code == 200
    assert response.context["add"] is True


def test_api_tokens_are_not_added_in_the_admin(client, platform_admin, world):
    client.force_login(platform_admin)

    response = client.get("/admin/registry/apitoken/add/")

    assert response.status_code == 403
    assert ApiToken.objects.count() == 2


def _more_rows(model_name: str, index: int, *, admin_user, publisher, acme, make_tool_version):
    """Two more rows of `model_name` (and what they need), to show list pages do not do a
    query per row."""

    def save(instance):
        return registry_object_save(instance=instance, actor=admin_user)

    if model_name in {"tenant", "membership", "apitoken"}:
        user = UserFactory(username=f"extra{index}")
        tenant = TenantFactory(slug=f"extra{index}")
        membership_add(actor=admin_user, user=user, tenant=tenant, role=Role.MEMBER)
        api_token_issue(username=user.username, password=PASSWORD)
        return
    tool_version = make_tool_version(name=f"extra_tool_{index}")
    tools.tool_version_publish(tool_version=tool_version, actor=publisher)
    skill_version = skills.skill_version_create(
        actor=publisher,
        tenant=acme,
        name=f"extra-skill-{index}",
        version="1.0.0",
        tool_versions=[tool_version],
        **skill_content(),
    )
    skill_version = skills.skill_version_publish(skill_version=skill_version, actor=publisher)
    tenant = TenantFactory(slug=f"extra{index}")
    model = save(
        ModelConfig(tenant=tenant, name=f"extra{index}", provider="offline", model_name="m")
    )
    policy = save(Policy(tenant=tenant, name=f"extra{index}"))
    save(AgentConfig(tenant=tenant, name=f"extra{index}", model_config=model, policy=policy))
    save(
        RolloutFlag(
            key=f"extra{index}",
            skill=skill_version.skill,
            skill_version=skill_version,
            percentage=5,
        )
    )


@pytest.mark.parametrize("model_name", ALL_ROWS)
def test_changelist_query_count_does_not_grow_with_rows(
    client, platform_admin, publisher, acme, world, make_tool_version, model_name
):
    client.force_login(platform_admin)
    url = f"/admin/registry/{model_name}/"
    with CaptureQueriesContext(connection) as before:
        assert client.get(url).status_code == 200

    for index in (1, 2):
        _more_rows(
            model_name,
            index,
            admin_user=platform_admin,
            publisher=publisher,
            acme=acme,
            make_tool_version=make_tool_version,
        )
    with CaptureQueriesContext(connection) as after:
        response = client.get(url)

    assert response.status_code == 200
    assert len(response.context["cl"].result_list) == len(ALL_ROWS[model_name]) + 2
    assert query_shapes(after) == query_shapes(before)


# --- scope: who sees what ------------------------------------------------------------------


def test_publisher_sees_own_tenant_tool_versions_only(client, publisher, world):
    client.force_login(publisher)

    response = client.get(TOOL_VERSIONS)

    assert response.status_code == 200
    assert listed_pks(response) == {world.project_search_1.pk, world.project_search_2.pk}


def test_publisher_opening_other_tenant_version_is_sent_to_admin_index(client, publisher, world):
    client.force_login(publisher)
    version = world.mail_send_1

    response = client.get(f"{TOOL_VERSIONS}{version.pk}/change/", follow=True)

    assert response.redirect_chain == [("/admin/", 302)]
    assert messages_of(response) == [
        ("warning", f"tool version with ID “{version.pk}” doesn’t exist. Perhaps it was deleted?")  # noqa: RUF001
    ]
    assert "mail_send" not in response.content.decode()


def test_publisher_cannot_see_other_tenant_version_history_or_diff(client, publisher, world):
    client.force_login(publisher)
    theirs, ours = world.mail_send_1, world.project_search_1

    history = client.get(f"{TOOL_VERSIONS}{theirs.pk}/history/")
    compare = client.get(f"{TOOL_VERSIONS}{ours.pk}/compare/{theirs.pk}/")

    assert history.status_code == 404
    assert compare.status_code == 404


def test_publisher_has_no_access_to_tenant_administration(client, publisher, world):
    client.force_login(publisher)

    responses = {
        name: client.get(f"/admin/registry/{name}/").status_code
        for name in ("tenant", "membership", "policy", "agentconfig", "apitoken")
    }

    assert responses == {
        "tenant": 403,
        "membership": 403,
        "policy": 403,
        "agentconfig": 403,
        "apitoken": 403,
    }


@pytest.mark.parametrize("path", ["", "{pk}/change/", "{pk}/history/", "add/"])
def test_non_staff_member_is_redirected_to_login(client, member, world, path):
    client.force_login(member)
    url = TOOL_VERSIONS + path.format(pk=world.project_search_1.pk)

    response = client.get(url)

    assert response.status_code == 302
    assert response["Location"] == f"/admin/login/?next={url}"


def test_publisher_add_form_offers_only_own_tenant_tools(client, publisher, world):
    client.force_login(publisher)

    response = client.get(f"{TOOL_VERSIONS}add/")

    assert response.status_code == 200
    offered = set(response.context["adminform"].form.fields["tool"].queryset)
    assert offered == {world.project_search}
    assert "mail_send" not in response.content.decode()


def test_publisher_cannot_add_a_version_to_other_tenant_tool(client, publisher, world):
    client.force_login(publisher)
    count = ToolVersion.objects.count()

    response = client.post(f"{TOOL_VERSIONS}add/", tool_version_form(world.mail_send))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["tool"] == [
        "Select a valid choice. That choice is not one of the available choices."
    ]
    assert ToolVersion.objects.count() == count


def test_publisher_adds_a_tool_of_own_tenant(client, publisher, acme, world):
    client.force_login(publisher)

    response = client.post(
        "/admin/registry/tool/add/",
        {"name": "ticket_search", "namespace": "core", "tenant": acme.pk},
    )

    assert response.status_code == 302
    tool = Tool.objects.get(name="ticket_search")
    assert (tool.tenant, tool.created_by) == (acme, publisher)


def test_publisher_cannot_add_a_platform_wide_tool(client, publisher, world):
    """Platform-wide definitions are for platform admins (`user_may_publish`)."""
    client.force_login(publisher)

    response = client.post(
        "/admin/registry/tool/add/", {"name": "web_search", "namespace": "core", "tenant": ""}
    )

    assert response.status_code == 200
    assert "tenant" in response.context["adminform"].form.errors
    assert not Tool.objects.filter(name="web_search").exists()


# --- lifecycle actions ---------------------------------------------------------------------


def test_publish_action_publishes_the_draft_and_makes_it_current(client, platform_admin, world):
    client.force_login(platform_admin)
    draft = world.project_search_2

    response = run_action(client, "publish", draft)

    assert response.redirect_chain == [(TOOL_VERSIONS, 302)]
    assert messages_of(response) == [("success", "project_search@2.0.0: publish done.")]
    draft.refresh_from_db()
    assert (draft.status, draft.published_by) == (VersionStatus.PUBLISHED, platform_admin)
    assert draft.published_at is not None
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == draft


def test_publisher_publishes_own_tenant_draft(client, publisher, world):
    client.force_login(publisher)

    response = run_action(client, "publish", world.project_search_2)

    assert messages_of(response) == [("success", "project_search@2.0.0: publish done.")]
    world.project_search_2.refresh_from_db()
    assert (world.project_search_2.status, world.project_search_2.published_by) == (
        VersionStatus.PUBLISHED,
        publisher,
    )


def test_publisher_action_on_other_tenant_version_does_nothing(
    client, publisher, globex_publisher, globex, make_tool_version, world
):
    theirs = make_tool_version(name="crm_lookup", actor=globex_publisher, tenant=globex)
    client.force_login(publisher)

    response = run_action(client, "publish", theirs)

    assert response.status_code == 200
    assert messages_of(response) == []
    theirs.refresh_from_db()
    assert theirs.status == VersionStatus.DRAFT
    assert Tool.objects.get(pk=theirs.tool_id).current_version is None


def test_publish_action_refuses_a_version_not_greater_than_a_released_one(
    client, platform_admin, publisher, make_tool_version, world
):
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    late = make_tool_version(version="1.5.0")
    history_before = history_rows(late)
    client.force_login(platform_admin)

    response = run_action(client, "publish", late)

    assert messages_of(response) == [
        (
            "error",
            "1.5.0 must be greater than every released version of project_search; "
            "2.0.0 already exists. version: 1.5.0; existing: 2.0.0",
        )
    ]
    late.refresh_from_db()
    assert (late.status, late.published_at, late.published_by) == (VersionStatus.DRAFT, None, None)
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_2
    assert history_rows(late) == history_before


def test_publish_action_reports_each_selected_version(
    client, platform_admin, publisher, make_tool_version, world
):
    """One refusal does not stop the others; each version gets its own message."""
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    late = make_tool_version(version="1.5.0")
    another = make_tool_version(name="ticket_search", version="0.1.0")
    client.force_login(platform_admin)

    response = run_action(client, "publish", another, late)

    assert sorted(messages_of(response)) == [
        (
            "error",
            "1.5.0 must be greater than every released version of project_search; "
            "2.0.0 already exists. version: 1.5.0; existing: 2.0.0",
        ),
        ("success", "ticket_search@0.1.0: publish done."),
    ]
    statuses = dict(
        ToolVersion.objects.filter(pk__in=[late.pk, another.pk]).values_list("pk", "status")
    )
    assert statuses == {late.pk: VersionStatus.DRAFT, another.pk: VersionStatus.PUBLISHED}


def test_publish_action_on_a_published_version_is_a_no_op(client, platform_admin, world):
    published = world.project_search_1
    history_before = history_rows(published)
    client.force_login(platform_admin)

    response = run_action(client, "publish", published)

    assert messages_of(response) == [("success", "project_search@1.0.0: publish done.")]
    version = ToolVersion.objects.get(pk=published.pk)
    assert (version.published_at, version.published_by) == (
        published.published_at,
        published.published_by,
    )
    assert history_rows(published) == history_before


def test_deprecate_action_moves_current_to_the_previous_release(
    client, platform_admin, publisher, world
):
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    client.force_login(platform_admin)

    response = run_action(client, "deprecate", world.project_search_2)

    assert messages_of(response) == [("success", "project_search@2.0.0: deprecate done.")]
    version = ToolVersion.objects.get(pk=world.project_search_2.pk)
    assert (version.status, version.status_reason) == (
        VersionStatus.DEPRECATED,
        "deprecated in admin",
    )
    assert version.deprecated_at is not None
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_1


def test_deprecate_action_refuses_a_draft(client, platform_admin, world):
    client.force_login(platform_admin)
    draft = world.project_search_2
    history_before = history_rows(draft)

    response = run_action(client, "deprecate", draft)

    assert messages_of(response) == [
        ("error", "project_search@2.0.0 is draft; it cannot become deprecated.")
    ]
    draft.refresh_from_db()
    assert (draft.status, draft.deprecated_at) == (VersionStatus.DRAFT, None)
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_1
    assert history_rows(draft) == history_before


def test_revoke_action_revokes_and_leaves_no_current_when_none_is_left(
    client, platform_admin, world
):
    client.force_login(platform_admin)

    response = run_action(client, "revoke", world.project_search_1)

    assert messages_of(response) == [("success", "project_search@1.0.0: revoke done.")]
    version = ToolVersion.objects.get(pk=world.project_search_1.pk)
    assert (version.status, version.status_reason) == (VersionStatus.REVOKED, "revoked in admin")
    assert version.revoked_at is not None
    world.project_search.refresh_from_db()
    assert world.project_search.current_version is None


def test_make_current_action_rolls_back_to_an_earlier_release(
    client, platform_admin, publisher, world
):
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    client.force_login(platform_admin)

    response = run_action(client, "make_current", world.project_search_1)

    assert messages_of(response) == [("success", "project_search@1.0.0: rollback done.")]
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_1
    statuses = set(
        ToolVersion.objects.filter(tool=world.project_search).values_list("status", flat=True)
    )
    assert statuses == {VersionStatus.PUBLISHED}


def test_make_current_action_refuses_a_revoked_version(client, platform_admin, publisher, world):
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    tools.tool_version_revoke(tool_version=world.project_search_1, actor=publisher)
    client.force_login(platform_admin)

    response = run_action(client, "make_current", world.project_search_1)

    assert messages_of(response) == [
        (
            "error",
            "Only a published version can be made current; project_search@1.0.0 is revoked. "
            "status: revoked",
        )
    ]
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_2


def test_make_current_action_needs_exactly_one_version(client, platform_admin, publisher, world):
    tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
    client.force_login(platform_admin)

    response = run_action(client, "make_current", world.project_search_1, world.project_search_2)

    assert messages_of(response) == [("error", "Select exactly one version.")]
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_2


def test_skill_version_publish_action_refuses_a_pin_of_a_draft_tool(
    client, platform_admin, make_skill_version, world
):
    draft = make_skill_version(version="2.0.0", tool_versions=[world.project_search_2])
    client.force_login(platform_admin)

    response = run_action(client, "publish", draft, url="/admin/registry/skillversion/")

    [(level, text)] = messages_of(response)
    assert level == "error"
    assert text.startswith(
        "weekly-summary@2.0.0 pins tool versions that cannot be used: "
        "project_search@2.0.0 is draft, not published."
    )
    draft.refresh_from_db()
    assert draft.status == VersionStatus.DRAFT
    world.weekly_summary.refresh_from_db()
    assert world.weekly_summary.current_version == world.weekly_summary_1


def test_skill_version_publish_action_publishes(client, platform_admin, world):
    client.force_login(platform_admin)

    response = run_action(
        client, "publish", world.weekly_summary_1_1, url="/admin/registry/skillversion/"
    )

    assert messages_of(response) == [("success", "weekly-summary@1.1.0: publish done.")]
    world.weekly_summary.refresh_from_db()
    assert world.weekly_summary.current_version == world.weekly_summary_1_1


def skill_version_added(world, pins: list) -> dict:
    """The add form of weekly-summary@3.3.0, a draft pinning these tool versions."""
    content = skill_content(examples=[], instructions="Use the evidence.", workflow="")
    return {
        "skill": str(world.weekly_summary.pk),
        "version": "3.3.0",
        **{
            field: value if isinstance(value, str) else json.dumps(value)
            for field, value in content.items()
        },
        "tool_dependencies-TOTAL_FORMS": str(len(pins)),
        "tool_dependencies-INITIAL_FORMS": "0",
        "tool_dependencies-MIN_NUM_FORMS": "0",
        "tool_dependencies-MAX_NUM_FORMS": "1000",
        **{
            f"tool_dependencies-{index}-tool_version": str(pin.pk) for index, pin in enumerate(pins)
        },
    }


def test_add_skill_version_with_a_pinned_tool_saves_the_draft_and_its_pin(client, publisher, world):
    client.force_login(publisher)

    response = client.post(
        "/admin/registry/skillversion/add/", skill_version_added(world, [world.project_search_1])
    )

    assert response.status_code == 302, response.context["adminform"].form.errors
    version = world.weekly_summary.versions.get(version="3.3.0")
    assert (version.status, version.created_by) == (VersionStatus.DRAFT, publisher)
    assert list(version.tool_dependencies.values_list("tool_version", flat=True)) == [
        world.project_search_1.pk
    ]


@pytest.mark.parametrize(
    ("namespace", "error"),
    [
        (
            "core",
            "A skill version pins one version of each tool. tool_dependencies: The same "
            "tool is pinned twice.",
        ),
        (
            "crm",
            "A skill version pins one tool of each name: a run knows its tools by name. "
            "tool_dependencies: Tools of two namespaces are named project_search; pin one of them.",
        ),
    ],
    ids=["one-tool", "one-name"],
)
def test_add_skill_version_pinning_two_tools_of_one_name_is_a_form_error(
    client, publisher, make_tool_version, world, namespace, error
):
    other = make_tool_version(version="2.1.0", namespace=namespace)
    tools.tool_version_publish(tool_version=other, actor=publisher)
    client.force_login(publisher)

    response = client.post(
        "/admin/registry/skillversion/add/",
        skill_version_added(world, [world.project_search_1, other]),
    )

    assert response.status_code == 200
    [formset] = response.context["inline_admin_formsets"]
    assert formset.formset.non_form_errors() == [error]
    assert not world.weekly_summary.versions.filter(version="3.3.0").exists()


# --- compare -------------------------------------------------------------------------------


def test_compare_action_redirects_to_the_diff_of_the_two_versions(client, platform_admin, world):
    client.force_login(platform_admin)
    old, new = world.project_search_1, world.project_search_2

    response = run_action(client, "compare", new, old, follow=False)

    assert response.status_code == 302
    assert response["Location"] == f"{TOOL_VERSIONS}{old.pk}/compare/{new.pk}/"


def test_compare_action_with_one_version_shows_an_error(client, platform_admin, world):
    client.force_login(platform_admin)

    response = run_action(client, "compare", world.project_search_1)

    assert response.redirect_chain == [(TOOL_VERSIONS, 302)]
    assert messages_of(response) == [
        ("error", "Select exactly two versions of the same definition.")
    ]


def test_compare_action_refuses_versions_of_different_tools(client, platform_admin, world):
    client.force_login(platform_admin)

    response = run_action(client, "compare", world.project_search_1, world.mail_send_1)

    assert messages_of(response) == [
        ("error", "Select exactly two versions of the same definition.")
    ]


def test_compare_view_shows_the_changed_fields_and_their_diff(
    client, platform_admin, make_tool_version, world
):
    schema = valid_input_schema()
    schema["properties"]["from"] = {"type": "string", "format": "date"}
    new = make_tool_version(
        version="1.1.0", description="Reads a project's risks.", input_schema=schema
    )
    old = world.project_search_1
    client.force_login(platform_admin)

    response = client.get(f"{TOOL_VERSIONS}{old.pk}/compare/{new.pk}/")

    assert response.status_code == 200
    diffs = {diff.field: diff for diff in response.context["diffs"]}
    assert list(diffs) == [
        "version",
        "description",
        "status",
        "published_at",
        "published_by",
        "input_schema",
    ]
    assert diffs["description"].lines[2:] == [
        "@@ -1 +1 @@",
        "-Reads a project's status. Does not change anything.",
        "+Reads a project's risks.",
    ]
    assert [line for line in diffs["input_schema"].lines if line.startswith(("+ ", "- "))] == [
        '+    "from": {',
        '+      "format": "date",',
        '+      "type": "string"',
        "+    },",
    ]
    html = response.content.decode()
    assert "project_search@1.0.0 (published) → project_search@1.1.0 (draft)" in html
    assert '<h3 id="field-description">description</h3>' in html
    assert '<h3 id="field-input_schema">input_schema</h3>' in html
    assert '<h3 id="field-risk">' not in html
    assert (
        '<span class="del">-Reads a project&#x27;s status. Does not change anything.</span>' in html
    )
    assert '<span class="add">+Reads a project&#x27;s risks.</span>' in html


# --- the add form: content validation, history ---------------------------------------------

INVALID_SCHEMAS = [
    (
        '{"type": "strin"}',
        "Not a valid JSON Schema (Draft 2020-12) at type: 'strin' is not valid under any of "
        "the given schemas",
    ),
    (
        '{"type": "object", "properties": {"project_id": {"type": "string"}}}',
        'The input schema must set "additionalProperties": false.',
    ),
    (
        '{"type": "object", "additionalProperties": false, "required": ["project_id"]}',
        "Required but not declared in properties: project_id.",
    ),
    ('["type", "object"]', "The input schema must be a JSON object."),
    ('{"type": "object", "additionalProperties": false', "Enter a valid JSON."),
]


@pytest.mark.parametrize(("input_schema", "message"), INVALID_SCHEMAS)
def test_add_tool_version_with_invalid_input_schema_shows_the_error_next_to_the_field(
    client, platform_admin, world, input_schema, message
):
    client.force_login(platform_admin)
    counts = ToolVersion.objects.count(), ToolVersion.history.count(), Tool.objects.count()

    response = client.post(
        f"{TOOL_VERSIONS}add/", tool_version_form(world.project_search, input_schema=input_schema)
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["input_schema"] == [message]
    assert (
        f'<ul class="errorlist" id="id_input_schema_error"><li>{escape(message)}</li></ul>'
        in response.content.decode()
    )
    assert (
        ToolVersion.objects.count(),
        ToolVersion.history.count(),
        Tool.objects.count(),
    ) == counts


def test_add_tool_version_with_other_invalid_content_shows_each_error(
    client, platform_admin, world
):
    client.force_login(platform_admin)
    count = ToolVersion.objects.count()

    response = client.post(
        f"{TOOL_VERSIONS}add/",
        tool_version_form(
            world.project_search,
            version="1.1",
            retry_policy='{"max_attempts": 99}',
            adapter_config='{"url": "http://example.com"}',
        ),
    )

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert errors["version"] == ["'1.1' is not a semantic version such as 1.4.0."]
    assert errors["retry_policy"] == ["max_attempts: 99 is greater than the maximum of 10"]
    assert errors["adapter_config"] == [
        "'handler' is a required property",
        "Additional properties are not allowed ('url' was unexpected)",
    ]
    assert ToolVersion.objects.count() == count


@pytest.mark.parametrize("user_fixture", ["platform_admin", "publisher"])
def test_add_valid_draft_creates_it_with_history_of_the_user(request, client, world, user_fixture):
    user = request.getfixturevalue(user_fixture)
    client.force_login(user)

    response = client.post(f"{TOOL_VERSIONS}add/", tool_version_form(world.project_search))

    assert response.status_code == 302
    assert response["Location"] == TOOL_VERSIONS
    version = ToolVersion.objects.get(tool=world.project_search, version="1.1.0")
    assert (version.status, version.created_by, version.description) == (
        VersionStatus.DRAFT,
        user,
        "Reads a project's status and its milestones.",
    )
    assert version.input_schema == valid_input_schema()
    assert version.adapter_config == {"handler": "examples.handlers.project_search"}
    history = list(
        version.history.values_list("history_type", "history_user", "history_change_reason")
    )
    assert history == [("+", user.pk, "draft created")]
    world.project_search.refresh_from_db()
    assert world.project_search.current_version == world.project_search_1


def test_add_tool_version_with_optional_json_fields_left_empty_stores_empty_objects(
    client, platform_admin, world
):
    """retry_policy, rate_limit, circuit_breaker and result_contract are optional (blank)."""
    client.force_login(platform_admin)

    response = client.post(
        f"{TOOL_VERSIONS}add/",
        tool_version_form(
            world.project_search,
            retry_policy="",
            rate_limit="",
            circuit_breaker="",
            result_contract="",
        ),
    )

    assert response.status_code == 302
    version = ToolVersion.objects.get(tool=world.project_search, version="1.1.0")
    assert (
        version.retry_policy,
        version.rate_limit,
        version.circuit_breaker,
        version.result_contract,
    ) == ({}, {}, {}, {})


# --- drafts are editable, published versions are frozen ------------------------------------


def test_draft_change_page_saves_edits_through_the_service(client, publisher, world):
    client.force_login(publisher)
    draft = world.project_search_2
    data = tool_version_form(version="2.0.0", description="Reads a project's milestones.")

    response = client.post(f"{TOOL_VERSIONS}{draft.pk}/change/", data)

    assert response.status_code == 302
    draft.refresh_from_db()
    assert (draft.description, draft.status) == (
        "Reads a project's milestones.",
        VersionStatus.DRAFT,
    )
    latest = draft.history.latest("history_date")
    assert (latest.history_user, latest.history_change_reason) == (publisher, "draft edited")


def test_draft_change_page_refuses_an_invalid_schema(client, publisher, world):
    client.force_login(publisher)
    draft = world.project_search_2
    data = tool_version_form(version="2.0.0", input_schema='{"type": "object"}')

    response = client.post(f"{TOOL_VERSIONS}{draft.pk}/change/", data)

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["input_schema"] == [
        'The input schema must set "additionalProperties": false.'
    ]
    draft.refresh_from_db()
    assert draft.input_schema == valid_input_schema()


CREDENTIAL_REFUSED = (
    "Holds a credential (a key, a token or a password), which every model call of a run "
    "using this version would send to the provider: remove it."
)


def test_add_tool_version_with_a_key_in_its_description_shows_the_error_next_to_the_field(
    client, publisher, world
):
    client.force_login(publisher)
    counts = ToolVersion.objects.count(), ToolVersion.history.count()
    description = "Reads a project's status with the key sk-proj4f9c2a7e1b8d3f6a0c5e."

    response = client.post(
        f"{TOOL_VERSIONS}add/", tool_version_form(world.project_search, description=description)
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["description"] == [CREDENTIAL_REFUSED]
    assert (ToolVersion.objects.count(), ToolVersion.history.count()) == counts


def test_draft_skill_change_page_refuses_a_password_in_its_instructions(client, publisher, world):
    client.force_login(publisher)
    draft = world.weekly_summary_1_1
    data = {
        **skill_version_added(world, []),
        "version": "1.1.0",
        "instructions": "Open the tracker as bot, password=Tr0ub4dor3x, then summarise.",
    }

    response = client.post(f"/admin/registry/skillversion/{draft.pk}/change/", data)

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["instructions"] == [CREDENTIAL_REFUSED]
    draft.refresh_from_db()
    assert draft.instructions == ""


@pytest.mark.django_db(transaction=True)
def test_a_draft_published_while_its_change_page_is_saved_stays_published(
    client, publisher, world, monkeypatch
):
    # given a draft whose change page one publisher saves
    client.force_login(publisher)
    draft = world.project_search_2
    data = tool_version_form(version="2.0.0", description="Reads a project's milestones.")

    # when another publisher publishes it just as the edit is about to be written
    editor = threading.current_thread()
    check_change_allowed = ToolVersion._check_change_allowed

    def publish() -> None:
        try:
            tools.tool_version_publish(tool_version=draft, actor=publisher)
        finally:
            connection.close()

    publishing = threading.Thread(target=publish)

    def published_meanwhile(version: ToolVersion) -> None:
        check_change_allowed(version)
        if threading.current_thread() is editor and not publishing.is_alive():
            publishing.start()
            until(lambda: not publishing.is_alive() or waiting_on_locks())

    monkeypatch.setattr(ToolVersion, "_check_change_allowed", published_meanwhile)
    response = client.post(f"{TOOL_VERSIONS}{draft.pk}/change/", data)
    publishing.join(timeout=10)

    # then the edit and the publish happen one after the other: the edited draft is published
    # and current, never the published row written back to a draft
    assert response.status_code == 302
    draft.refresh_from_db()
    world.project_search.refresh_from_db()
    assert (draft.status, draft.description) == (
        VersionStatus.PUBLISHED,
        "Reads a project's milestones.",
    )
    assert draft.published_at is not None
    assert world.project_search.current_version == draft
    assert [record.history_change_reason for record in draft.history.order_by("history_date")][
        -2:
    ] == ["draft edited", "published"]


@pytest.mark.django_db(transaction=True)
def test_a_tool_s_page_saved_while_a_version_is_published_keeps_the_published_one_current(
    client, publisher, world, monkeypatch
):
    # given the page of a tool whose current version is 1.0.0, read by a publisher who saves it
    client.force_login(publisher)
    tool = world.project_search
    page = f"/admin/registry/tool/{tool.pk}/change/"
    data = {"tenant": world.acme.pk, "namespace": "core", "name": "project_search"}

    # when another publisher publishes 2.0.0 after the page's row was read, before it is saved
    editor = threading.current_thread()
    clean = Tool.clean
    published = []

    def publish() -> None:
        try:
            tools.tool_version_publish(tool_version=world.project_search_2, actor=publisher)
        finally:
            connection.close()

    def published_meanwhile(definition: Tool) -> None:
        clean(definition)
        if threading.current_thread() is editor and not published:
            published.append(True)
            publishing = threading.Thread(target=publish)
            publishing.start()
            publishing.join(timeout=10)

    monkeypatch.setattr(Tool, "clean", published_meanwhile)
    response = client.post(page, data)

    # then the save writes what the page changes, never the current version it read: 2.0.0
    # stays current, and the tool's history says so
    assert response.status_code == 302
    assert published == [True]
    tool.refresh_from_db()
    assert tool.current_version == world.project_search_2
    latest = tool.history.latest("history_date")
    assert (latest.current_version_id, latest.history_change_reason) == (
        world.project_search_2.pk,
        "saved in admin",
    )


@pytest.mark.django_db(transaction=True)
def test_a_tool_renamed_while_its_draft_is_published_keeps_the_name_it_was_published_under(
    client, publisher, world, make_tool_version, monkeypatch
):
    # given a tool whose only version is a draft, renamed on its page by a publisher
    draft = make_tool_version(name="risk_search")
    tool = draft.tool
    client.force_login(publisher)
    data = {"tenant": world.acme.pk, "namespace": "core", "name": "risk_lookup"}

    # when another publisher publishes the draft once the save checked the rename, before the
    # renamed row is written
    editor = threading.current_thread()
    checked = common.full_clean_or_raise
    published = []

    def publish() -> None:
        try:
            tools.tool_version_publish(tool_version=draft, actor=publisher)
        finally:
            connection.close()

    def published_meanwhile(instance, **options) -> None:
        checked(instance, **options)
        if threading.current_thread() is editor and isinstance(instance, Tool) and not published:
            published.append(True)
            publishing = threading.Thread(target=publish)
            publishing.start()
            publishing.join(timeout=10)

    monkeypatch.setattr(common, "full_clean_or_raise", published_meanwhile)
    response = client.post(f"/admin/registry/tool/{tool.pk}/change/", data)

    # then the rename is refused on the form, and the published version keeps its name
    assert published == [True]
    assert response.status_code == 200
    assert response.context["adminform"].form.non_field_errors() == [
        "The submitted values are not valid. A definition with a published, "
        "deprecated or revoked version keeps its name, namespace and owner."
    ]
    tool.refresh_from_db()
    assert (tool.name, tool.current_version) == ("risk_search", draft)
    assert ToolVersion.objects.get(pk=draft.pk).qualified_name == "risk_search@1.0.0"


def test_published_version_change_page_shows_content_read_only(client, platform_admin, world):
    client.force_login(platform_admin)
    published = world.project_search_1

    response = client.get(f"{TOOL_VERSIONS}{published.pk}/change/")

    assert response.status_code == 200
    adminform = response.context["adminform"]
    assert set(adminform.form.fields) == set()
    assert {"tool", "version", *TOOL_CONTENT_FIELDS} <= set(adminform.readonly_fields)
    html = response.content.decode()
    assert 'name="description"' not in html
    assert 'name="input_schema"' not in html
    assert f'<div class="readonly">{escape(published.description)}</div>' in html


def test_posting_a_changed_description_to_a_published_version_changes_nothing(
    client, platform_admin, world
):
    client.force_login(platform_admin)
    published = world.project_search_1
    history_before = history_rows(published)
    data = tool_version_form(version="9.9.9", description="Rewritten after publication.")

    response = client.post(f"{TOOL_VERSIONS}{published.pk}/change/", data, follow=True)

    # Either a view-only page that refuses the POST, or a save that saves nothing.
    assert response.status_code == 403
    published.refresh_from_db()
    assert (published.version, published.description, published.status) == (
        "1.0.0",
        "Reads a project's status. Does not change anything.",
        VersionStatus.PUBLISHED,
    )
    assert history_rows(published) == history_before


def test_posting_a_changed_description_to_a_published_skill_version_changes_nothing(
    client, platform_admin, world
):
    client.force_login(platform_admin)
    published = world.weekly_summary_1
    pin = published.tool_dependencies.get()
    history_before = history_rows(published)
    data = {
        "description": "Rewritten after publication.",
        "triggers": '["anything"]',
        "tool_dependencies-TOTAL_FORMS": "1",
        "tool_dependencies-INITIAL_FORMS": "1",
        "tool_dependencies-MIN_NUM_FORMS": "0",
        "tool_dependencies-MAX_NUM_FORMS": "0",
        "tool_dependencies-0-id": str(pin.pk),
        "tool_dependencies-0-skill_version": str(published.pk),
    }

    response = client.post(
        f"/admin/registry/skillversion/{published.pk}/change/", data, follow=True
    )

    assert response.status_code == 403
    published.refresh_from_db()
    assert (published.description, published.triggers, published.status) == (
        "Summarises a project's week.",
        ["project weekly status"],
        VersionStatus.PUBLISHED,
    )
    assert list(published.tool_dependencies.values_list("tool_version", flat=True)) == [
        world.project_search_1.pk
    ]
    assert history_rows(published) == history_before


def test_reverting_a_published_version_to_its_draft_history_changes_nothing(
    client, platform_admin, world
):
    """simple-history's revert form must not be a way around the frozen content."""
    client.force_login(platform_admin)
    published = world.project_search_1
    draft_record = published.history.earliest("history_date")
    history_before = history_rows(published)
    data = tool_version_form(world.project_search, version="1.0.0", description="Reverted.")

    response = client.post(
        f"{TOOL_VERSIONS}{published.pk}/history/{draft_record.history_id}/", data, follow=True
    )

    assert response.status_code == 403
    published.refresh_from_db()
    assert (published.description, published.status) == (
        "Reads a project's status. Does not change anything.",
        VersionStatus.PUBLISHED,
    )
    assert history_rows(published) == history_before


# --- history and object permissions --------------------------------------------------------


def test_history_page_lists_the_publish_with_the_acting_user(
    client, platform_admin, publisher, world
):
    client.force_login(platform_admin)
    draft = world.project_search_2
    run_action(client, "publish", draft)

    response = client.get(f"{TOOL_VERSIONS}{draft.pk}/history/")

    assert response.status_code == 200
    records = [
        (record.history_change_reason, record.history_user.username)
        for record in response.context["page_obj"]
    ]
    assert records == [("published", "root"), ("draft created", "dave")]
    html = response.content.decode()
    assert f'<a href="/admin/auth/user/{platform_admin.pk}/change/">root</a>' in html
    assert f'<a href="/admin/auth/user/{publisher.pk}/change/">dave</a>' in html


@pytest.mark.parametrize(
    ("url", "name"),
    [
        (f"{TOOL_VERSIONS}abc/history/", "tool version"),
        ("/admin/registry/policy/abc/history/", "policy"),
        ("/admin/approvals/businessaction/abc/history/", "business action"),
    ],
)
def test_a_history_page_of_an_id_that_is_no_key_says_the_object_does_not_exist(
    client, platform_admin, world, url, name
):
    client.force_login(platform_admin)

    response = client.get(url, follow=True)

    assert response.redirect_chain == [("/admin/", 302)]
    assert messages_of(response) == [
        ("warning", f"{name} with ID “abc” doesn’t exist. Perhaps it was deleted?")  # noqa: RUF001
    ]


@pytest.mark.parametrize(
    "path",
    [
        "{tool_versions}{pk}/history/xyz/",
        "{tool_versions}abc/history/1/",
        "/admin/registry/policy/abc/history/1/",
        "/admin/approvals/businessaction/abc/history/1/",
    ],
)
def test_a_history_record_of_an_id_that_is_no_key_is_not_found(client, platform_admin, world, path):
    client.force_login(platform_admin)
    url = path.format(tool_versions=TOOL_VERSIONS, pk=world.project_search_1.pk)

    response = client.get(url)

    assert response.status_code == 404


def test_object_permissions_page_of_a_tool_renders_for_platform_admin(
    client, platform_admin, acme, world
):
    platform_tool = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    ).tool
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=acme)
    client.force_login(platform_admin)

    response = client.get(f"/admin/registry/tool/{platform_tool.pk}/permissions/")

    assert response.status_code == 200
    assert response.context["object"] == platform_tool
    assert dict(response.context["groups_perms"]) == {acme.grant_group: ["use_tool"]}
    assert "tenant:acme" in response.content.decode()


@pytest.mark.parametrize(
    "path",
    [
        "{tool}/permissions/user-manage/abc/",
        "{tool}/permissions/group-manage/abc/",
        "abc/permissions/",
    ],
)
def test_object_permissions_pages_of_an_id_that_is_not_even_a_key_are_not_found(
    client, platform_admin, path
):
    platform_tool = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    ).tool
    client.force_login(platform_admin)
    url = "/admin/registry/tool/" + path.format(tool=platform_tool.pk)

    assert client.get(url).status_code == 404
    assert client.post(url, {"permissions": ["use_tool"]}).status_code == 404


def test_publisher_cannot_open_object_permissions_of_a_platform_wide_tool(
    client, platform_admin, publisher, world
):
    platform_tool = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    ).tool
    client.force_login(publisher)

    response = client.get(f"/admin/registry/tool/{platform_tool.pk}/permissions/")

    assert response.status_code == 404


def test_a_grant_of_a_tenant_s_own_tool_to_another_tenant_is_refused_as_doing_nothing(
    client, platform_admin, world
):
    # given acme's own project_search: only acme's agents may use it, whatever is granted
    client.force_login(platform_admin)
    url = (
        f"/admin/registry/tool/{world.project_search.pk}/permissions/"
        f"group-manage/{world.globex.grant_group.pk}/"
    )

    # when the platform admin ticks its use for globex's grant group
    response = client.post(url, {"permissions": ["use_tool"]}, follow=True)

    # then the page says why nothing is granted, and nothing is
    (message,) = response.context["messages"]
    assert (message.level_tag, str(message)) == (
        "error",
        "Only platform-wide definitions are granted; this one belongs to a tenant. "
        "definition: acme/core/project_search",
    )
    assert "use_tool" not in get_group_perms(world.globex.grant_group, world.project_search)


def test_a_platform_admin_sets_a_cache_write_price_beside_the_cached_input_price(
    client, platform_admin
):
    # given a platform admin on a new model's page, which offers both cache prices
    client.force_login(platform_admin)
    page = client.get("/admin/registry/modelconfig/add/").content.decode()
    assert 'name="price_per_1k_cached_input"' in page
    assert 'name="price_per_1k_cache_write"' in page

    # when the admin saves an Anthropic model whose cache writes cost 1.25 times its input
    response = client.post(
        "/admin/registry/modelconfig/add/",
        {
            "name": "claude",
            "provider": "anthropic",
            "model_name": "claude-sonnet",
            "parameters": "{}",
            "price_per_1k_input": "0.003",
            "price_per_1k_cached_input": "0.0003",
            "price_per_1k_cache_write": "0.00375",
            "price_per_1k_output": "0.015",
            "is_active": "on",
        },
    )

    # then the model keeps that price, and a negative one is refused on its field
    assert response.status_code == 302
    config = ModelConfig.objects.get(name="claude")
    assert config.price_per_1k_cache_write == Decimal("0.00375")
    refused = client.post(
        f"/admin/registry/modelconfig/{config.pk}/change/",
        {
            "name": "claude",
            "provider": "anthropic",
            "model_name": "claude-sonnet",
            "parameters": "{}",
            "price_per_1k_input": "0.003",
            "price_per_1k_cache_write": "-1",
            "price_per_1k_output": "0.015",
            "is_active": "on",
        },
    )
    assert refused.status_code == 200
    assert refused.context["adminform"].form.errors["price_per_1k_cache_write"]
    config.refresh_from_db()
    assert config.price_per_1k_cache_write == Decimal("0.00375")
