import threading

import pytest
from django.db import connection

from registry.choices import VersionStatus
from registry.errors import (
    DependencyUnavailable,
    InvalidStatusTransition,
    PermissionDenied,
    ValidationFailed,
    VersionImmutable,
    VersionNotGreater,
)
from registry.models import SkillToolDependency, SkillVersion, Tool, ToolVersion
from registry.services import lifecycle, skills, tools
from registry.services.tenancy import definition_grant


def _published(make_tool_version, publisher, version: str, **overrides) -> ToolVersion:
    tool_version = make_tool_version(version=version, **overrides)
    return tools.tool_version_publish(tool_version=tool_version, actor=publisher)


def test_publish_makes_the_version_current_and_records_who(make_tool_version, publisher):
    draft = make_tool_version()

    published = tools.tool_version_publish(tool_version=draft, actor=publisher)

    assert published.status == VersionStatus.PUBLISHED
    assert published.published_by == publisher
    assert published.published_at is not None
    assert Tool.objects.get(pk=draft.tool_id).current_version_id == draft.pk


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strin"}, "Not a valid JSON Schema (Draft 2020-12) at type"),
        (
            {"type": "object", "properties": {"x": "text"}, "additionalProperties": False},
            "Not a valid JSON Schema (Draft 2020-12) at properties/x: 'text' is not of type",
        ),
        ({"type": "object"}, '"additionalProperties": false'),
        (
            {"type": "array", "additionalProperties": False},
            '"type": "object"',
        ),
        (
            {"type": "object", "required": ["x"], "additionalProperties": False},
            "Required but not declared in properties: x.",
        ),
        ("not a schema", "must be a JSON object"),
    ],
)
def test_an_invalid_input_schema_is_refused_with_a_readable_message(
    make_tool_version, schema, message
):
    with pytest.raises(ValidationFailed) as refused:
        make_tool_version(input_schema=schema)

    assert any(message in line for line in refused.value.details["input_schema"])
    assert not ToolVersion.objects.exists()


def test_a_published_version_cannot_be_changed_through_the_service(make_tool_version, publisher):
    published = _published(make_tool_version, publisher, "1.0.0")

    with pytest.raises(VersionImmutable):
        tools.tool_version_update(tool_version=published, actor=publisher, description="Changed.")

    published.refresh_from_db()
    assert published.description == "Reads a project's status. Does not change anything."


def test_a_draft_pinning_two_versions_of_one_tool_is_not_published(
    make_tool_version, make_skill_version, publisher
):
    first = _published(make_tool_version, publisher, "1.0.0")
    second = _published(make_tool_version, publisher, "1.1.0")
    draft = make_skill_version(tool_versions=[first])
    SkillToolDependency.objects.create(skill_version=draft, tool_version=second)

    with pytest.raises(ValidationFailed) as refused:
        skills.skill_version_publish(skill_version=draft, actor=publisher)

    assert refused.value.details == {"tool_dependencies": ["The same tool is pinned twice."]}
    draft.refresh_from_db()
    assert draft.status == VersionStatus.DRAFT
    assert draft.skill.current_version is None


def test_a_draft_pinning_two_tools_of_one_name_is_refused(
    make_tool_version, make_skill_version, publisher
):
    core = _published(make_tool_version, publisher, "1.0.0")
    crm = _published(make_tool_version, publisher, "1.0.0", namespace="crm")

    with pytest.raises(ValidationFailed) as refused:
        make_skill_version(tool_versions=[core, crm])

    assert refused.value.details == {
        "tool_dependencies": ["Tools of two namespaces are named project_search; pin one of them."]
    }
    assert not SkillVersion.objects.exists()


def test_semver_must_grow_over_every_released_version(make_tool_version, publisher):
    _published(make_tool_version, publisher, "2.0.0")
    lower = make_tool_version(version="1.9.0")
    equal_later = make_tool_version(version="2.0.0-rc.1")

    with pytest.raises(VersionNotGreater) as refused:
        tools.tool_version_publish(tool_version=lower, actor=publisher)
    with pytest.raises(VersionNotGreater):
        tools.tool_version_publish(tool_version=equal_later, actor=publisher)

    assert refused.value.details == {"version": "1.9.0", "existing": ["2.0.0"]}
    lower.refresh_from_db()
    assert lower.status == VersionStatus.DRAFT
    assert lower.tool.current_version.version == "2.0.0"


def test_a_revoked_version_still_counts_for_semver(make_tool_version, publisher):
    released = _published(make_tool_version, publisher, "1.0.0")
    tools.tool_version_revoke(tool_version=released, actor=publisher, reason="leaks data")

    with pytest.raises(VersionNotGreater):
        tools.tool_version_publish(
            tool_version=make_tool_version(version="1.0.0-fix"), actor=publisher
        )


def test_a_version_that_is_not_semver_is_refused(make_tool_version):
    with pytest.raises(ValidationFailed) as refused:
        make_tool_version(version="v2")

    assert "version" in refused.value.details


def test_publishing_twice_is_a_no_op(make_tool_version, publisher):
    published = _published(make_tool_version, publisher, "1.0.0")
    first_published_at = published.published_at

    again = tools.tool_version_publish(tool_version=published, actor=publisher)

    assert again.published_at == first_published_at
    assert again.history.count() == published.history.count()


def test_only_a_publisher_of_the_owner_tenant_may_publish(make_tool_version, member):
    draft = make_tool_version()

    with pytest.raises(PermissionDenied):
        tools.tool_version_publish(tool_version=draft, actor=member)

    draft.refresh_from_db()
    assert draft.status == VersionStatus.DRAFT


def test_deprecate_moves_current_to_the_highest_remaining_published(make_tool_version, publisher):
    first = _published(make_tool_version, publisher, "1.0.0")
    second = _published(make_tool_version, publisher, "1.1.0")

    tools.tool_version_deprecate(tool_version=second, actor=publisher, reason="slow")

    second.refresh_from_db()
    assert second.status == VersionStatus.DEPRECATED
    assert second.status_reason == "slow"
    assert Tool.objects.get(pk=first.tool_id).current_version_id == first.pk


def test_revoke_of_the_only_version_leaves_no_current(make_tool_version, publisher):
    only = _published(make_tool_version, publisher, "1.0.0")

    tools.tool_version_revoke(tool_version=only, actor=publisher, reason="unsafe")

    only.refresh_from_db()
    assert only.status == VersionStatus.REVOKED
    assert only.revoked_at is not None
    assert Tool.objects.get(pk=only.tool_id).current_version is None


def test_a_revoked_version_can_never_be_used_again(make_tool_version, publisher):
    revoked = _published(make_tool_version, publisher, "1.0.0")
    tools.tool_version_revoke(tool_version=revoked, actor=publisher)

    with pytest.raises(InvalidStatusTransition):
        tools.tool_rollback(tool_version=revoked, actor=publisher)
    with pytest.raises(InvalidStatusTransition):
        tools.tool_version_publish(tool_version=revoked, actor=publisher)
    with pytest.raises(InvalidStatusTransition):
        tools.tool_version_deprecate(tool_version=revoked, actor=publisher)

    assert Tool.objects.get(pk=revoked.tool_id).current_version is None


def test_deprecating_a_draft_is_an_illegal_transition(make_tool_version, publisher):
    draft = make_tool_version()

    with pytest.raises(InvalidStatusTransition) as refused:
        tools.tool_version_deprecate(tool_version=draft, actor=publisher)

    assert refused.value.details == {"from": "draft", "to": "deprecated"}


def test_rollback_makes_an_earlier_published_version_current(make_tool_version, publisher):
    first = _published(make_tool_version, publisher, "1.0.0")
    second = _published(make_tool_version, publisher, "2.0.0")
    assert Tool.objects.get(pk=first.tool_id).current_version_id == second.pk

    tools.tool_rollback(tool_version=first, actor=publisher)

    tool = Tool.objects.get(pk=first.tool_id)
    assert tool.current_version_id == first.pk
    assert tool.history.first().history_change_reason == "rolled back to 1.0.0"
    assert tool.history.first().history_user == publisher
    second.refresh_from_db()
    assert second.status == VersionStatus.PUBLISHED


def test_rollback_to_a_deprecated_version_is_refused(make_tool_version, publisher):
    first = _published(make_tool_version, publisher, "1.0.0")
    _published(make_tool_version, publisher, "2.0.0")
    tools.tool_version_deprecate(tool_version=first, actor=publisher)

    with pytest.raises(InvalidStatusTransition):
        tools.tool_rollback(tool_version=first, actor=publisher)


def test_a_skill_is_not_rolled_back_to_a_version_pinning_a_revoked_tool_version(
    make_tool_version, make_skill_version, publisher
):
    # given 1.0.0 pinning project_search 1.0.0, since revoked, and 1.1.0 current on 2.0.0
    revoked = _published(make_tool_version, publisher, "1.0.0")
    current = _published(make_tool_version, publisher, "2.0.0")
    earlier = skills.skill_version_publish(
        skill_version=make_skill_version(tool_versions=[revoked]), actor=publisher
    )
    later = skills.skill_version_publish(
        skill_version=make_skill_version(version="1.1.0", tool_versions=[current]),
        actor=publisher,
    )
    tools.tool_version_revoke(tool_version=revoked, actor=publisher, reason="leaks data")

    # when the skill is rolled back to 1.0.0
    with pytest.raises(DependencyUnavailable) as refused:
        skills.skill_rollback(skill_version=earlier, actor=publisher)

    # then it is refused for the revoked pin, and 1.1.0 stays current
    assert refused.value.details == {
        "tool_dependencies": {"project_search@1.0.0": "is revoked, not deprecated or published"}
    }
    later.skill.refresh_from_db()
    assert later.skill.current_version_id == later.pk


@pytest.mark.parametrize("retire", ["deprecate", "revoke"])
def test_retiring_a_skill_s_current_version_does_not_fall_back_to_one_pinning_a_revoked_tool(
    make_tool_version, make_skill_version, publisher, retire
):
    # given 1.0.0 pinning project_search 1.0.0, since revoked, and 1.1.0 current on 2.0.0
    revoked = _published(make_tool_version, publisher, "1.0.0")
    current = _published(make_tool_version, publisher, "2.0.0")
    skills.skill_version_publish(
        skill_version=make_skill_version(tool_versions=[revoked]), actor=publisher
    )
    later = skills.skill_version_publish(
        skill_version=make_skill_version(version="1.1.0", tool_versions=[current]),
        actor=publisher,
    )
    tools.tool_version_revoke(tool_version=revoked, actor=publisher, reason="leaks data")

    # when 1.1.0 is retired, which would make 1.0.0 current as a rollback would
    getattr(skills, f"skill_version_{retire}")(skill_version=later, actor=publisher)

    # then 1.0.0 is not made current, as a rollback to it is refused, and history says why
    later.skill.refresh_from_db()
    assert later.skill.current_version is None
    assert later.skill.history.first().history_change_reason == (
        f"1.1.0 {retire}d; 1.0.0 not made current: it pins tool versions that cannot be "
        "used (project_search@1.0.0 is revoked, not deprecated or published)"
    )


def test_a_skill_is_rolled_back_to_a_version_pinning_a_deprecated_tool_version(
    make_tool_version, make_skill_version, publisher
):
    deprecated = _published(make_tool_version, publisher, "1.0.0")
    current = _published(make_tool_version, publisher, "2.0.0")
    earlier = skills.skill_version_publish(
        skill_version=make_skill_version(tool_versions=[deprecated]), actor=publisher
    )
    skills.skill_version_publish(
        skill_version=make_skill_version(version="1.1.0", tool_versions=[current]),
        actor=publisher,
    )
    tools.tool_version_deprecate(tool_version=deprecated, actor=publisher)

    skills.skill_rollback(skill_version=earlier, actor=publisher)

    earlier.skill.refresh_from_db()
    assert earlier.skill.current_version_id == earlier.pk


def test_history_rows_carry_the_acting_user_and_reason(make_tool_version, publisher):
    draft = make_tool_version()
    tools.tool_version_publish(tool_version=draft, actor=publisher)
    tools.tool_version_revoke(tool_version=draft, actor=publisher, reason="bad data")

    rows = list(
        draft.history.order_by("history_date").values_list(
            "history_type", "status", "history_user__username", "history_change_reason"
        )
    )

    assert rows == [
        ("+", "draft", "dave", "draft created"),
        ("~", "published", "dave", "published"),
        ("~", "revoked", "dave", "revoked: bad data"),
    ]


def test_a_skill_may_pin_only_published_tool_versions(
    make_tool_version, make_skill_version, publisher
):
    published = _published(make_tool_version, publisher, "1.0.0")
    draft_tool = make_tool_version(name="directory_lookup")
    skill_version = make_skill_version(tool_versions=[published, draft_tool])

    with pytest.raises(DependencyUnavailable) as refused:
        skills.skill_version_publish(skill_version=skill_version, actor=publisher)

    assert refused.value.details == {
        "tool_dependencies": {"directory_lookup@1.0.0": "is draft, not published"}
    }
    skill_version.refresh_from_db()
    assert skill_version.status == VersionStatus.DRAFT


@pytest.mark.parametrize("retire", [tools.tool_version_revoke, tools.tool_version_deprecate])
def test_a_skill_cannot_be_published_on_a_retired_tool_version(
    make_tool_version, make_skill_version, publisher, retire
):
    pinned = _published(make_tool_version, publisher, "1.0.0")
    skill_version = make_skill_version(tool_versions=[pinned])
    retire(tool_version=pinned, actor=publisher)

    with pytest.raises(DependencyUnavailable):
        skills.skill_version_publish(skill_version=skill_version, actor=publisher)


def test_a_skill_cannot_pin_another_tenants_tool(
    make_tool_version, make_skill_version, publisher, globex, globex_publisher
):
    foreign = make_tool_version(name="globex_search", actor=globex_publisher, tenant=globex)
    tools.tool_version_publish(tool_version=foreign, actor=globex_publisher)
    skill_version = make_skill_version(tool_versions=[foreign])

    with pytest.raises(DependencyUnavailable) as refused:
        skills.skill_version_publish(skill_version=skill_version, actor=publisher)

    assert refused.value.details["tool_dependencies"] == {
        "globex_search@1.0.0": "is not available to acme"
    }


@pytest.mark.parametrize(
    "url",
    ["https://bot:s3cret@fetch.internal/api", "https://fetch.internal/api?token=s3cret"],
    ids=["password", "secret-parameter"],
)
def test_an_http_tool_s_url_carries_no_secret(make_tool_version, platform_admin, url):
    with pytest.raises(ValidationFailed) as refused:
        make_tool_version(
            name="web_fetch",
            actor=platform_admin,
            tenant=None,
            adapter_kind="http",
            adapter_config={"url": url},
        )

    [refusal] = refused.value.details["adapter_config"]
    assert refusal.endswith(
        "name the environment variable that holds the secret in credential_ref instead."
    )
    assert not ToolVersion.objects.exists()


def test_a_granted_platform_tool_may_be_pinned(
    make_tool_version, make_skill_version, publisher, platform_admin, acme
):
    platform_tool = make_tool_version(
        name="web_fetch",
        actor=platform_admin,
        tenant=None,
        adapter_kind="http",
        adapter_config={"url": "https://fetch.internal/api", "credential_ref": "FETCH_TOKEN"},
    )
    tools.tool_version_publish(tool_version=platform_tool, actor=platform_admin)
    skill_version = make_skill_version(tool_versions=[platform_tool])

    with pytest.raises(DependencyUnavailable):
        skills.skill_version_publish(skill_version=skill_version, actor=publisher)
    definition_grant(actor=platform_admin, definition=platform_tool.tool, tenant=acme)
    skills.skill_version_publish(skill_version=skill_version, actor=publisher)

    assert SkillVersion.objects.get(pk=skill_version.pk).status == VersionStatus.PUBLISHED


def test_a_tenant_publisher_cannot_manage_a_platform_tool(make_tool_version, publisher):
    with pytest.raises(PermissionDenied):
        make_tool_version(tenant=None, name="platform_only")

    assert not Tool.objects.filter(name="platform_only").exists()


def test_the_same_tool_cannot_be_pinned_twice(make_tool_version, make_skill_version, publisher):
    first = _published(make_tool_version, publisher, "1.0.0")
    second = _published(make_tool_version, publisher, "1.1.0")

    with pytest.raises(ValidationFailed):
        make_skill_version(tool_versions=[first, second])

    assert not SkillVersion.objects.exists()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rules": [{"id": "a", "scope": "skill", "text": "no priority"}]}, "rules"),
        (
            {
                "rules": [
                    {"id": "a", "scope": "skill", "priority": 1, "text": "x"},
                    {"id": "a", "scope": "skill", "priority": 2, "text": "y"},
                ]
            },
            "rules",
        ),
        ({"output_contract": {}}, "output_contract"),
        ({"triggers": []}, "triggers"),
        ({"description": "  "}, "description"),
    ],
)
def test_skill_content_must_follow_the_contract(make_skill_version, overrides, field):
    with pytest.raises(ValidationFailed) as refused:
        make_skill_version(**overrides)

    assert field in refused.value.details


def test_skill_publish_pins_survive_and_skill_becomes_current(
    make_tool_version, make_skill_version, publisher
):
    pinned = _published(make_tool_version, publisher, "2.0.0")
    skill_version = make_skill_version(version="3.2.0", tool_versions=[pinned])

    skills.skill_version_publish(skill_version=skill_version, actor=publisher)

    skill_version.refresh_from_db()
    assert skill_version.skill.current_version_id == skill_version.pk
    assert [d.tool_version_id for d in skill_version.tool_dependencies.all()] == [pinned.pk]


def _another_request_first(monkeypatch, model, create) -> None:
    """Between this request's uniqueness check of a new `model` row and its insert, `create`
    runs in another thread (another connection) and commits, as a concurrent request would."""
    check = tools.full_clean_or_raise
    raced = []

    def check_then_race(instance, **kwargs):
        check(instance, **kwargs)
        if isinstance(instance, model) and not raced:
            raced.append(True)
            thread = threading.Thread(target=_in_own_connection, args=(create,))
            thread.start()
            thread.join()

    monkeypatch.setattr(tools, "full_clean_or_raise", check_then_race)
    monkeypatch.setattr(lifecycle, "full_clean_or_raise", check_then_race)


def _in_own_connection(create) -> None:
    try:
        create()
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_version_a_concurrent_request_created_first_is_refused_as_a_duplicate(
    make_tool_version, monkeypatch
):
    # given a tool, and another request creating its 2.0.0 while this one does
    make_tool_version(version="1.0.0")
    _another_request_first(monkeypatch, ToolVersion, lambda: make_tool_version(version="2.0.0"))

    # when this request creates 2.0.0 too, then it is told the version exists
    with pytest.raises(ValidationFailed) as refused:
        make_tool_version(version="2.0.0")
    assert refused.value.details == {
        "__all__": ["Tool version with this Tool and Version already exists."]
    }
    assert sorted(ToolVersion.objects.values_list("version", flat=True)) == ["1.0.0", "2.0.0"]


@pytest.mark.django_db(transaction=True)
def test_a_tool_a_concurrent_request_created_first_gets_this_request_s_version(
    make_tool_version, monkeypatch
):
    # given another request creating the tool (with 1.0.0) while this one does (with 2.0.0)
    _another_request_first(monkeypatch, Tool, lambda: make_tool_version(version="1.0.0"))

    # when
    created = make_tool_version(version="2.0.0")

    # then there is one tool, with both versions
    assert Tool.objects.count() == 1
    assert created.tool_id == Tool.objects.get().pk
    assert sorted(ToolVersion.objects.values_list("version", flat=True)) == ["1.0.0", "2.0.0"]


def test_a_pre_release_published_after_a_stable_version_does_not_become_current(
    make_tool_version, publisher
):
    stable = _published(make_tool_version, publisher, "2.0.0")

    candidate = _published(make_tool_version, publisher, "2.1.0-rc.1")

    assert candidate.status == VersionStatus.PUBLISHED
    assert Tool.objects.get(pk=stable.tool_id).current_version_id == stable.pk


def test_a_pre_release_is_current_while_no_stable_version_is_published(
    make_tool_version, publisher
):
    first = _published(make_tool_version, publisher, "2.0.0-rc.1")
    second = _published(make_tool_version, publisher, "2.0.0-rc.2")
    assert Tool.objects.get(pk=first.tool_id).current_version_id == second.pk

    stable = _published(make_tool_version, publisher, "2.0.0")

    assert Tool.objects.get(pk=first.tool_id).current_version_id == stable.pk


def test_a_pre_release_does_not_keep_a_rolled_back_tool_off_its_version(
    make_tool_version, publisher
):
    first = _published(make_tool_version, publisher, "1.0.0")
    _published(make_tool_version, publisher, "2.0.0")
    tools.tool_rollback(tool_version=first, actor=publisher)

    _published(make_tool_version, publisher, "2.1.0-rc.1")

    assert Tool.objects.get(pk=first.tool_id).current_version_id == first.pk


@pytest.mark.parametrize("retire", ["deprecate", "revoke"])
def test_retiring_the_current_version_falls_back_to_a_stable_one_over_a_pre_release(
    make_tool_version, publisher, retire
):
    first = _published(make_tool_version, publisher, "1.0.0")
    second = _published(make_tool_version, publisher, "2.0.0")
    _published(make_tool_version, publisher, "2.1.0-rc.1")

    getattr(tools, f"tool_version_{retire}")(tool_version=second, actor=publisher)

    assert Tool.objects.get(pk=first.tool_id).current_version_id == first.pk


def test_retiring_the_only_stable_version_makes_the_highest_pre_release_current(
    make_tool_version, publisher
):
    stable = _published(make_tool_version, publisher, "1.0.0")
    _published(make_tool_version, publisher, "1.1.0-rc.1")
    candidate = _published(make_tool_version, publisher, "1.1.0-rc.2")

    tools.tool_version_revoke(tool_version=stable, actor=publisher)

    assert Tool.objects.get(pk=stable.tool_id).current_version_id == candidate.pk


def test_a_skill_pre_release_does_not_become_current_over_a_stable_version(
    make_skill_version, publisher
):
    stable = skills.skill_version_publish(skill_version=make_skill_version(), actor=publisher)

    candidate = skills.skill_version_publish(
        skill_version=make_skill_version(version="1.1.0-beta.1"), actor=publisher
    )

    assert candidate.status == VersionStatus.PUBLISHED
    stable.skill.refresh_from_db()
    assert stable.skill.current_version_id == stable.pk
