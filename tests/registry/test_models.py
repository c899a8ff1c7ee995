import pytest
from django.db import IntegrityError, transaction

from registry.choices import VersionStatus
from registry.errors import InvalidStatusTransition, VersionImmutable
from registry.models import SkillToolDependency, Tool, ToolVersion
from registry.services import skills, tools
from registry.services.tenancy import tenant_create


@pytest.fixture
def published(make_tool_version, publisher):
    return tools.tool_version_publish(tool_version=make_tool_version(), actor=publisher)


def test_saving_a_changed_published_row_raises(published):
    published.description = "Edited behind the service's back."

    with pytest.raises(VersionImmutable) as refused:
        published.save()

    assert refused.value.details == {"fields": ["description"]}
    assert ToolVersion.objects.get(pk=published.pk).description != published.description


def test_changing_a_published_schema_in_place_raises(published):
    published.input_schema["properties"]["extra"] = {"type": "string"}

    with pytest.raises(VersionImmutable):
        published.save()


@pytest.mark.parametrize("value", [0, 0.0])
def test_a_published_schema_value_of_another_json_type_raises(published, value):
    # Python finds 0 == 0.0 == False; the stored document, the model and the schema's hash do not.
    published.input_schema["additionalProperties"] = value

    with pytest.raises(VersionImmutable) as refused:
        published.save()

    assert refused.value.details == {"fields": ["input_schema"]}
    assert ToolVersion.objects.get(pk=published.pk).input_schema["additionalProperties"] is False


def test_bulk_update_of_published_content_is_refused(published):
    with pytest.raises(VersionImmutable):
        ToolVersion.objects.filter(pk=published.pk).update(description="bulk edit")

    assert ToolVersion.objects.get(pk=published.pk).description == published.description


def test_bulk_status_change_is_refused(published):
    with pytest.raises(InvalidStatusTransition):
        ToolVersion.objects.filter(pk=published.pk).update(status=VersionStatus.DRAFT)


def test_a_published_version_cannot_be_deleted(published):
    with pytest.raises(VersionImmutable):
        published.delete()
    with pytest.raises(VersionImmutable):
        ToolVersion.objects.filter(pk=published.pk).delete()

    assert ToolVersion.objects.filter(pk=published.pk).exists()


def test_a_draft_may_be_edited_and_deleted(make_tool_version):
    draft = make_tool_version()
    draft.description = "Better words."
    draft.save()

    draft.delete()

    assert not ToolVersion.objects.filter(pk=draft.pk).exists()


def test_a_status_may_not_go_backwards(published):
    published.status = VersionStatus.DRAFT

    with pytest.raises(InvalidStatusTransition):
        published.save()


def test_the_tool_pins_of_a_published_skill_are_frozen(
    published, make_tool_version, make_skill_version, publisher
):
    skill_version = make_skill_version(tool_versions=[published])
    skills.skill_version_publish(skill_version=skill_version, actor=publisher)
    other = tools.tool_version_publish(
        tool_version=make_tool_version(name="directory_lookup"), actor=publisher
    )

    with pytest.raises(VersionImmutable):
        SkillToolDependency.objects.create(skill_version=skill_version, tool_version=other)
    with pytest.raises(VersionImmutable):
        skill_version.tool_dependencies.get().delete()

    assert list(skill_version.tool_dependencies.values_list("tool_version", flat=True)) == [
        published.pk
    ]


def test_the_tool_pins_of_a_published_skill_are_frozen_in_bulk_too(
    published, make_tool_version, make_skill_version, publisher
):
    skill_version = make_skill_version(tool_versions=[published])
    skills.skill_version_publish(skill_version=skill_version, actor=publisher)
    draft = make_skill_version(version="1.1.0")
    other = tools.tool_version_publish(
        tool_version=make_tool_version(name="directory_lookup"), actor=publisher
    )
    pins = SkillToolDependency.objects.filter(skill_version=skill_version)

    with pytest.raises(VersionImmutable):
        pins.update(tool_version=other)
    with pytest.raises(VersionImmutable):
        pins.update(skill_version=draft)
    with pytest.raises(VersionImmutable):
        pins.delete()
    with pytest.raises(VersionImmutable):
        SkillToolDependency.objects.bulk_create(
            [SkillToolDependency(skill_version=skill_version, tool_version=other)]
        )
    moved = skill_version.tool_dependencies.get()
    moved.skill_version = draft
    with pytest.raises(VersionImmutable):
        moved.save()

    assert list(skill_version.tool_dependencies.values_list("tool_version", flat=True)) == [
        published.pk
    ]
    assert not draft.tool_dependencies.exists()


def test_the_tool_pins_of_a_draft_skill_change_in_bulk(
    published, make_tool_version, make_skill_version
):
    draft = make_skill_version(tool_versions=[published])
    other = make_tool_version(name="directory_lookup")
    pins = SkillToolDependency.objects.filter(skill_version=draft)

    pins.update(tool_version=other)
    assert list(draft.tool_dependencies.values_list("tool_version", flat=True)) == [other.pk]
    pins.delete()
    assert not draft.tool_dependencies.exists()


def test_a_version_number_is_unique_per_tool(published):
    with pytest.raises(IntegrityError), transaction.atomic():
        ToolVersion.objects.create(
            tool=published.tool, version=published.version, description="duplicate"
        )


def test_tool_names_are_unique_per_owner_including_platform_wide(acme):
    globex = tenant_create(actor=None, slug="globex", name="Globex")
    Tool.objects.create(tenant=None, name="web_fetch")
    Tool.objects.create(tenant=acme, name="web_fetch")
    Tool.objects.create(tenant=globex, name="web_fetch")

    with pytest.raises(IntegrityError), transaction.atomic():
        Tool.objects.create(tenant=None, name="web_fetch")
    with pytest.raises(IntegrityError), transaction.atomic():
        Tool.objects.create(tenant=acme, name="web_fetch")
