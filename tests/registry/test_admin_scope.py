"""What staff of one tenant may choose, change and revoke in the admin: only their tenant's
objects (and platform-wide ones where a row may use them), never another tenant's; what a
published definition is known by never changes; a refusal or a filter no date can hold is an
answer, not a server error."""

from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission

from config.credentials import credential_value
from config.errors import PermissionDenied, ValidationFailed
from evaluations.models import EvalSuite
from registry.choices import Role
from registry.models import AgentConfig, ApiToken, Membership, Policy, RolloutFlag, ToolVersion
from registry.services import skills
from registry.services.common import registry_object_save
from registry.services.tenancy import membership_add
from tests.conftest import _member
from tests.registry.factories import UserFactory
from tests.registry.test_admin import TOOL_VERSIONS, tool_version_form


@pytest.fixture
def tenant_admin(acme):
    """tina: acme's tenant admin, staff, not a platform admin."""
    return _member("tina", acme, Role.ADMIN, is_staff=True)


def offered(response, field: str) -> set:
    return set(response.context["adminform"].form.fields[field].queryset)


def test_an_agent_config_offers_only_its_tenant_s_objects_and_platform_wide_ones(
    client, tenant_admin, world
):
    client.force_login(tenant_admin)

    response = client.get(f"/admin/registry/agentconfig/{world.weekly_reporter.pk}/change/")

    assert response.status_code == 200
    assert offered(response, "policy") == {world.strict}
    assert offered(response, "model_config") == {world.acme_gpt, world.offline_planner}
    assert offered(response, "skills") == {world.weekly_summary}


def test_an_eval_case_names_a_suite_of_its_own_tenant_only(client, publisher, world):
    ours = EvalSuite.objects.create(tenant=world.acme, key="ours", name="Ours", kind="task")
    EvalSuite.objects.create(tenant=world.globex, key="theirs", name="Theirs", kind="task")
    EvalSuite.objects.create(tenant=None, key="platform", name="Platform", kind="task")
    client.force_login(publisher)

    response = client.get("/admin/evaluations/evalcase/add/")

    assert offered(response, "suite") == {ours}


def test_a_skill_version_pins_only_tool_versions_its_publisher_may_see(client, publisher, world):
    client.force_login(publisher)

    response = client.get(f"/admin/registry/skillversion/{world.weekly_summary_1_1.pk}/change/")

    [pins] = response.context["inline_admin_formsets"]
    offered_versions = set(pins.formset.empty_form.fields["tool_version"].queryset)
    assert world.mail_send_1 not in offered_versions
    assert world.project_search_1 in offered_versions


def test_a_tenant_admin_lists_and_revokes_only_its_tenant_s_tokens(client, tenant_admin, world):
    client.force_login(tenant_admin)

    listed = client.get("/admin/registry/apitoken/")
    client.post(
        "/admin/registry/apitoken/",
        {"action": "revoke", "_selected_action": [world.erin_token.pk, world.dave_token.pk]},
    )

    assert set(listed.context["cl"].result_list) == {world.dave_token}
    assert ApiToken.objects.get(pk=world.erin_token.pk).revoked_at is None
    assert ApiToken.objects.get(pk=world.dave_token.pk).revoked_at is not None


def test_a_permission_to_view_tokens_reaches_no_other_tenant_s_token(client, publisher, world):
    publisher.user_permissions.add(Permission.objects.get(codename="view_apitoken"))
    client.force_login(publisher)

    response = client.post(
        "/admin/registry/apitoken/",
        {"action": "revoke", "_selected_action": [world.erin_token.pk]},
    )

    assert response.status_code == 403
    assert ApiToken.objects.get(pk=world.erin_token.pk).revoked_at is None


def test_a_tool_with_a_published_version_keeps_its_name(client, publisher, world):
    tool = world.project_search
    client.force_login(publisher)

    page = client.get(f"/admin/registry/tool/{tool.pk}/change/")
    client.post(
        f"/admin/registry/tool/{tool.pk}/change/",
        {"name": "renamed_search", "namespace": "core", "tenant": world.acme.pk},
    )

    assert "name" not in page.context["adminform"].form.fields
    tool.refresh_from_db()
    assert tool.name == "project_search"
    assert ToolVersion.objects.get(pk=world.project_search_1.pk).qualified_name == (
        "project_search@1.0.0"
    )
    tool.name = "renamed_search"
    with pytest.raises(ValidationFailed):
        registry_object_save(instance=tool, actor=publisher)


def test_a_draft_given_the_number_of_a_released_version_is_refused_on_the_typed_form(
    client, publisher, world
):
    client.force_login(publisher)
    draft = world.project_search_2
    saved = (draft.version, draft.description)
    typed = tool_version_form(version="1.0.0", description="Typed before the refusal.")

    response = client.post(f"{TOOL_VERSIONS}{draft.pk}/change/", typed)

    assert response.status_code == 200
    form = response.context["adminform"].form
    assert form.data["version"] == "1.0.0"
    assert form.data["description"] == "Typed before the refusal."
    [text] = form.non_field_errors()
    assert "already exists" in text
    draft.refresh_from_db()
    assert (draft.version, draft.description) == saved


@pytest.mark.parametrize(
    "path",
    [
        "/admin/registry/tool/?created_at__year=99999",
        "/admin/registry/tool/?created_at__year=-5",
        "/admin/registry/toolversion/?created_at__year=9999&created_at__month=12",
    ],
)
def test_a_date_filter_no_date_can_hold_is_a_wrong_filter(client, platform_admin, world, path):
    client.force_login(platform_admin)

    response = client.get(path)

    assert response.status_code == 302
    assert response.url.endswith("?e=1")


def test_a_tenant_admin_adds_a_member_by_username_without_any_list_of_users(
    client, tenant_admin, world
):
    newcomer = UserFactory(username="zoe")
    client.force_login(tenant_admin)

    page = client.get("/admin/registry/membership/add/")
    response = client.post(
        "/admin/registry/membership/add/",
        {"user": "zoe", "tenant": world.acme.pk, "role": Role.MEMBER},
    )
    shown = client.get(f"/admin/registry/membership/{world.alice_membership.pk}/change/")

    assert page.status_code == 200
    assert "/admin/autocomplete/" not in page.content.decode()
    assert response.status_code == 302
    assert Membership.objects.filter(user=newcomer, tenant=world.acme, role=Role.MEMBER).exists()
    assert 'value="alice"' in shown.content.decode()


def test_object_permission_pages_exist_only_for_platform_admins(client, publisher, world):
    """A tenant's publisher could look up any user or group of the platform by name there,
    and grant rights on a tenant's tool that mean nothing."""
    tool = world.project_search_1.tool
    base = f"/admin/registry/tool/{tool.pk}"
    client.force_login(publisher)

    change_page = client.get(f"{base}/change/")
    pages = [
        client.get(f"{base}/permissions/"),
        client.post(f"{base}/permissions/", {"user": "root", "submit_manage_user": "1"}),
        client.get(f"{base}/permissions/user-manage/{publisher.pk}/"),
        client.get(f"{base}/permissions/group-manage/{world.acme.grant_group.pk}/"),
    ]

    assert change_page.status_code == 200
    assert "permissions/" not in change_page.content.decode()
    assert [page.status_code for page in pages] == [404, 404, 404, 404]


def test_a_tenant_admin_renames_its_tenant_but_changes_nothing_the_platform_decides(
    client, tenant_admin, acme, settings, monkeypatch
):
    # given credentials granted to a slug no tenant holds yet, and a quota set for acme
    monkeypatch.setenv("INITECH_KEY", "initech-provider-secret")
    settings.TENANT_CREDENTIALS = {"initech": ["INITECH_KEY"]}
    acme.daily_cost_quota = Decimal("5")
    acme.save()
    client.force_login(tenant_admin)

    # when its admin posts the tenant with another slug, no quota and inactive
    response = client.post(
        f"/admin/registry/tenant/{acme.pk}/change/",
        {"slug": "initech", "name": "Acme Corp", "daily_cost_quota": "", "max_concurrent_runs": ""},
    )

    # then only the name changed: the slug, the quota and the activity are the platform's
    assert response.status_code == 302
    acme.refresh_from_db()
    assert (acme.name, acme.slug, acme.daily_cost_quota, acme.is_active) == (
        "Acme Corp",
        "acme",
        Decimal("5"),
        True,
    )
    assert credential_value("INITECH_KEY", owner=acme) is None


def test_the_service_refuses_a_tenant_slug_change_by_anyone_but_a_platform_admin(
    tenant_admin, acme
):
    acme.slug = "initech"

    with pytest.raises(PermissionDenied) as refused:
        registry_object_save(instance=acme, actor=tenant_admin)

    assert refused.value.details == {"fields": ["slug"]}
    acme.refresh_from_db()
    assert acme.slug == "acme"


def test_a_tenant_admin_adds_a_rollout_key_another_tenant_uses_but_not_one_of_its_own(
    client, tenant_admin, world, make_skill_version, globex_publisher
):
    # given acme's flag weekly-summary-canary, and globex's flag "globex-canary"
    globex_version = skills.skill_version_publish(
        skill_version=make_skill_version(tenant=world.globex, actor=globex_publisher),
        actor=globex_publisher,
    )
    registry_object_save(
        instance=RolloutFlag(
            key="globex-canary",
            skill=globex_version.skill,
            skill_version=globex_version,
            percentage=10,
        ),
        actor=globex_publisher,
    )
    client.force_login(tenant_admin)
    form = {
        "skill": world.weekly_summary.pk,
        "skill_version": world.canary_flag.skill_version_id,
        "percentage": 20,
        "is_active": "on",
    }
    add = "/admin/registry/rolloutflag/add/"

    # when acme's tenant admin adds a flag under each key
    own = client.post(add, {**form, "key": "weekly-summary-canary"})
    globex_s = client.post(add, {**form, "key": "globex-canary"})

    # then acme's own key is refused on the field, and globex's is acme's to use too
    assert own.status_code == 200
    assert own.context["adminform"].form.errors["key"] == [
        "This tenant already has a rollout flag with this key."
    ]
    assert globex_s.status_code == 302
    assert sorted(RolloutFlag.objects.values_list("tenant__slug", "key", "percentage")) == [
        ("acme", "globex-canary", 20),
        ("acme", "weekly-summary-canary", 10),
        ("acme", "weekly-summary-paused", 0),
        ("globex", "globex-canary", 10),
    ]


def test_a_policy_agents_run_under_keeps_its_tenant(client, tenant_admin, world):
    # given tina, an admin of acme and of globex, and acme's agent running under acme's policy
    membership_add(actor=None, user=tenant_admin, tenant=world.globex, role=Role.ADMIN)
    spare = registry_object_save(
        instance=Policy(tenant=world.acme, name="spare"), actor=tenant_admin
    )
    client.force_login(tenant_admin)
    page = f"/admin/registry/policy/{world.strict.pk}/change/"
    data = {
        "tenant": world.globex.pk,
        "name": "strict",
        "approval_required_risks": '["external_side_effect"]',
        "human_queue_risks": "[]",
        "approver_roles": '["approver"]',
        "approval_ttl_seconds": "86400",
        "max_data_classification": "confidential",
    }

    # when she moves that policy to globex on its page
    response = client.post(page, data)

    # then the move is refused next to the tenant: acme's agent would run under a policy
    # globex's admins change. Nothing changed; a policy no agent runs under still moves.
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["tenant"] == [
        "A policy agents run under keeps its tenant: moved, they would run under a policy "
        "another tenant's admins change. Create a policy for the other tenant instead."
    ]
    policy = Policy.objects.get(pk=world.strict.pk)
    assert (policy.tenant, policy.approval_required_risks) == (
        world.acme,
        ["external_side_effect", "destructive", "financial"],
    )
    assert AgentConfig.objects.get(pk=world.weekly_reporter.pk).policy.tenant == world.acme
    spare.tenant = world.globex
    registry_object_save(instance=spare, actor=tenant_admin)
    assert Policy.objects.get(pk=spare.pk).tenant == world.globex


def test_an_agent_saved_with_a_policy_moved_meanwhile_is_refused(tenant_admin, world):
    # given tina, an admin of acme and of globex, saving a new acme agent with acme's spare
    # policy as she read it, while that policy (no agent ran under it yet) moved to globex
    membership_add(actor=None, user=tenant_admin, tenant=world.globex, role=Role.ADMIN)
    spare = registry_object_save(
        instance=Policy(tenant=world.acme, name="spare"), actor=tenant_admin
    )
    agent = AgentConfig(
        tenant=world.acme, name="spare-reporter", model_config=world.acme_gpt, policy=spare
    )
    moved = Policy.objects.get(pk=spare.pk)
    moved.tenant = world.globex
    registry_object_save(instance=moved, actor=tenant_admin)

    # when the agent is saved
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=agent, actor=tenant_admin)

    # then it is refused: acme's agent would run under a policy globex's admins change
    assert refused.value.details["policy"] == ["This policy belongs to another tenant."]
    assert not AgentConfig.objects.filter(name="spare-reporter").exists()
