import uuid

import pytest

from registry.choices import Action, Role
from registry.errors import NotFound
from registry.models import RolloutFlag
from registry.selectors import (
    definitions_visible,
    rollout_bucket,
    rollout_serves,
    skill_version_for_actor,
    skill_versions_served,
    tool_version_resolve,
    tool_versions_visible,
    user_can,
)
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import definition_grant, membership_add
from tests.registry.factories import TenantFactory, UserFactory


def test_rollout_bucketing_is_deterministic():
    actors = [str(uuid.UUID(int=n)) for n in range(100)]

    first = [rollout_bucket(key="weekly-summary-4", actor_id=actor) for actor in actors]
    second = [rollout_bucket(key="weekly-summary-4", actor_id=actor) for actor in actors]
    other_flag = [rollout_bucket(key="another-flag", actor_id=actor) for actor in actors]

    assert first == second
    assert first != other_flag
    assert all(0 <= bucket < 10_000 for bucket in first)


@pytest.fixture
def two_skill_versions(make_skill_version, publisher):
    stable = skills.skill_version_publish(
        skill_version=make_skill_version(version="3.2.0"), actor=publisher
    )
    candidate = skills.skill_version_publish(
        skill_version=make_skill_version(version="3.3.0"), actor=publisher
    )
    skills.skill_rollback(skill_version=stable, actor=publisher)
    stable.skill.refresh_from_db()
    return stable, candidate


@pytest.mark.parametrize("percentage", [5, 25, 50, 90])
def test_rollout_serves_the_target_share_within_3_percent(two_skill_versions, acme, percentage):
    stable, candidate = two_skill_versions
    created = RolloutFlag.objects.create(
        key="weekly-summary-3-3", skill=stable.skill, skill_version=candidate, percentage=percentage
    )
    flag = RolloutFlag.objects.prefetch_related("tenants").get(pk=created.pk)
    actors = [f"user-{n}" for n in range(10_000)]

    served = sum(rollout_serves(flag=flag, tenant=acme, actor_id=actor) for actor in actors)

    assert abs(served / len(actors) - percentage / 100) <= 0.03


def test_an_actor_keeps_its_version_across_runs(two_skill_versions, acme):
    stable, candidate = two_skill_versions
    RolloutFlag.objects.create(
        key="weekly-summary-3-3", skill=stable.skill, skill_version=candidate, percentage=50
    )

    picks = {
        actor: skill_version_for_actor(skill=stable.skill, tenant=acme, actor_id=actor)
        for actor in ("alice", "bob", "carol", "dave")
    }

    for _ in range(3):
        for actor, version in picks.items():
            assert (
                skill_version_for_actor(skill=stable.skill, tenant=acme, actor_id=actor) == version
            )


def test_rollout_to_listed_tenants_only(two_skill_versions, acme, globex):
    stable, candidate = two_skill_versions
    flag = RolloutFlag.objects.create(
        key="acme-first", skill=stable.skill, skill_version=candidate, percentage=100
    )
    flag.tenants.add(acme)

    assert skill_version_for_actor(skill=stable.skill, tenant=acme, actor_id="a") == candidate
    assert skill_version_for_actor(skill=stable.skill, tenant=globex, actor_id="a") == stable


def test_a_rollout_to_listed_tenants_serves_in_their_evaluation_sandboxes(
    two_skill_versions, acme, globex
):
    # given a rollout of the candidate to acme only, and a sandbox of each tenant
    stable, candidate = two_skill_versions
    flag = RolloutFlag.objects.create(
        key="acme-first", skill=stable.skill, skill_version=candidate, percentage=100
    )
    flag.tenants.add(acme)
    sandboxes = {}
    for tenant in (acme, globex):
        sandboxes[tenant] = TenantFactory(slug=f"eval-{tenant.slug}")
        sandboxes[tenant].sandbox_of = tenant
        sandboxes[tenant].save(update_fields=["sandbox_of"])

    # then acme's sandbox is served what acme's users get, globex's what globex's get
    served = {
        tenant: skill_version_for_actor(skill=stable.skill, tenant=sandbox, actor_id="a")
        for tenant, sandbox in sandboxes.items()
    }
    assert served == {acme: candidate, globex: stable}
    assert skill_versions_served(skills=[stable.skill], tenant=sandboxes[acme]) == [
        stable,
        candidate,
    ]


def test_two_tenants_each_roll_out_under_one_key_and_each_run_gets_its_own(
    make_skill_version, publisher, globex_publisher, platform_admin, acme, globex
):
    # given acme and globex, each with a stable and a candidate version of its own skill
    def candidate_of(tenant, actor) -> tuple:
        stable, candidate = (
            skills.skill_version_publish(
                skill_version=make_skill_version(version=version, tenant=tenant, actor=actor),
                actor=actor,
            )
            for version in ("1.0.0", "1.1.0")
        )
        skills.skill_rollback(skill_version=stable, actor=actor)
        stable.skill.refresh_from_db()
        return stable.skill, candidate

    acme_skill, acme_candidate = candidate_of(acme, publisher)
    globex_skill, globex_candidate = candidate_of(globex, globex_publisher)

    # when each rolls its candidate out to everyone under the same key
    for skill, candidate in ((acme_skill, acme_candidate), (globex_skill, globex_candidate)):
        registry_object_save(
            instance=RolloutFlag(
                key="canary", skill=skill, skill_version=candidate, percentage=100
            ),
            actor=platform_admin,
        )

    # then both flags exist, and each tenant's runs get only their own candidate
    assert sorted(RolloutFlag.objects.values_list("tenant__slug", "key")) == [
        ("acme", "canary"),
        ("globex", "canary"),
    ]
    assert skill_version_for_actor(skill=acme_skill, tenant=acme, actor_id="a") == acme_candidate
    assert (
        skill_version_for_actor(skill=globex_skill, tenant=globex, actor_id="a") == globex_candidate
    )
    assert set(skill_versions_served(skills=[acme_skill], tenant=acme)) == {
        acme_skill.current_version,
        acme_candidate,
    }


def test_an_inactive_or_revoked_rollout_serves_current(two_skill_versions, acme, publisher):
    stable, candidate = two_skill_versions
    flag = RolloutFlag.objects.create(
        key="everyone", skill=stable.skill, skill_version=candidate, percentage=100
    )
    flag.is_active = False
    flag.save()
    assert skill_version_for_actor(skill=stable.skill, tenant=acme, actor_id="a") == stable

    flag.is_active = True
    flag.save()
    skills.skill_version_revoke(skill_version=candidate, actor=publisher)

    assert skill_version_for_actor(skill=stable.skill, tenant=acme, actor_id="a") == stable


@pytest.mark.parametrize(
    ("role", "allowed", "denied"),
    [
        (Role.MEMBER, {Action.REGISTRY_VIEW, Action.RUN_CREATE}, {Action.REGISTRY_PUBLISH}),
        (Role.PUBLISHER, {Action.REGISTRY_PUBLISH}, {Action.APPROVAL_DECIDE, Action.RUN_CREATE}),
        (Role.APPROVER, {Action.APPROVAL_DECIDE}, {Action.REGISTRY_PUBLISH}),
        (
            Role.AUDITOR,
            {Action.RUN_VIEW_ALL, Action.REGISTRY_VIEW_UNPUBLISHED},
            {Action.APPROVAL_DECIDE, Action.RUN_CREATE},
        ),
        (Role.ADMIN, set(Action.values), set()),
    ],
)
def test_roles_grant_their_actions_in_their_tenant_only(acme, globex, role, allowed, denied):
    user = UserFactory()
    membership_add(actor=None, user=user, tenant=acme, role=role)

    for action in allowed:
        assert user_can(user=user, action=action, tenant=acme)
        assert not user_can(user=user, action=action, tenant=globex)
    for action in denied:
        assert not user_can(user=user, action=action, tenant=acme)


def test_a_user_may_hold_roles_in_several_tenants(acme, globex):
    user = UserFactory()
    membership_add(actor=None, user=user, tenant=acme, role=Role.PUBLISHER)
    membership_add(actor=None, user=user, tenant=globex, role=Role.APPROVER)

    assert user_can(user=user, action=Action.REGISTRY_PUBLISH, tenant=acme)
    assert not user_can(user=user, action=Action.REGISTRY_PUBLISH, tenant=globex)
    assert user_can(user=user, action=Action.APPROVAL_DECIDE, tenant=globex)


def test_an_inactive_tenant_allows_nothing(acme, publisher):
    acme.is_active = False
    acme.save()

    assert not user_can(user=publisher, action=Action.REGISTRY_VIEW, tenant=acme)


def test_platform_tools_are_visible_only_to_granted_tenants(
    make_tool_version, platform_admin, acme, globex, member
):
    version = make_tool_version(name="web_fetch", actor=platform_admin, tenant=None)
    tools.tool_version_publish(tool_version=version, actor=platform_admin)
    assert not definitions_visible(model=type(version.tool), tenant=acme).exists()

    definition_grant(actor=platform_admin, definition=version.tool, tenant=acme)

    assert list(tool_versions_visible(user=member, tenant=acme)) == [version]
    assert not definitions_visible(model=type(version.tool), tenant=globex).exists()

    definition_grant(actor=platform_admin, definition=version.tool, tenant=acme, granted=False)
    assert not tool_versions_visible(user=member, tenant=acme).exists()


def test_a_tenants_own_tool_shadows_the_platforms_of_the_same_name_when_resolving(
    make_tool_version, platform_admin, publisher, acme, globex
):
    # given acme's own web_fetch 1.0.0, and a platform-wide web_fetch 1.5.0 and 2.0.0 granted
    # to both tenants
    own = tools.tool_version_publish(
        tool_version=make_tool_version(name="web_fetch", version="1.0.0"), actor=publisher
    )
    for version in ("1.5.0", "2.0.0"):
        platform = make_tool_version(
            name="web_fetch", version=version, actor=platform_admin, tenant=None
        )
        platform = tools.tool_version_publish(tool_version=platform, actor=platform_admin)
    for tenant in (acme, globex):
        definition_grant(actor=platform_admin, definition=platform.tool, tenant=tenant)

    # then acme's pins resolve within its own tool only, whatever versions the platform's has
    assert tool_version_resolve(tenant=acme, reference="web_fetch@1") == own
    assert tool_version_resolve(tenant=acme, reference="web_fetch") == own
    with pytest.raises(NotFound) as raised:
        tool_version_resolve(tenant=acme, reference="web_fetch@2")
    assert raised.value.message == (
        "No published version of acme/core/web_fetch matches 'web_fetch@2'."
    )
    # and a tenant with no tool of that name, or the platform, gets the platform's
    platform_1_5 = platform.tool.versions.get(version="1.5.0")
    assert tool_version_resolve(tenant=globex, reference="web_fetch@1") == platform_1_5
    assert tool_version_resolve(tenant=globex, reference="web_fetch") == platform
    assert tool_version_resolve(tenant=None, reference="web_fetch") == platform
    # and globex's own web_fetch with a draft only hides nothing: no run can have it
    make_tool_version(name="web_fetch", version="3.0.0", actor=platform_admin, tenant=globex)
    assert tool_version_resolve(tenant=globex, reference="web_fetch@1") == platform_1_5
