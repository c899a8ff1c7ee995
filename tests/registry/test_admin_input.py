"""Odd input in the admin's JSON fields is a form error, and an empty one the field's default:
never a value PostgreSQL refuses (a server error) or a page that cannot be drawn."""

import json
import threading

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    SolarSchedule,
)

from evaluations.models import EvalCase, EvalSuite
from registry.admin.base import SelectionKeysMixin
from registry.models import ModelConfig, Policy, ToolVersion
from registry.services import common
from tests.registry.factories import skill_content
from tests.registry.test_admin import tool_version_form

CASE_ADD = "/admin/evaluations/evalcase/add/"


def case_form(suite: EvalSuite, **overrides) -> dict:
    return {
        "suite": suite.pk,
        "key": "week",
        "title": "The weekly summary",
        "messages": '["Summarise this week."]',
        "metadata": "{}",
        "session_state": "{}",
        "fixture": "{}",
        "expected": '{"sections": ["progress"]}',
        "forbidden": "{}",
        **overrides,
    }


@pytest.fixture
def suite(acme) -> EvalSuite:
    return EvalSuite.objects.create(tenant=acme, key="weekly", name="Weekly", kind="task")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"t": NaN}', "Numbers must be finite."),
        ('{"t": 1e400}', "Numbers must be finite."),
        ('{"t": "a\\u0000b"}', "NUL characters are not allowed."),
        ('["\\ud800"]', "Strings must be valid Unicode (no unpaired surrogates)."),
        ("[" * 5000 + "]" * 5000, "Enter a valid JSON."),
    ],
    ids=["nan", "infinity", "nul", "surrogate", "deep"],
)
def test_json_postgresql_would_refuse_is_a_form_error(
    client, platform_admin, suite, value, message
):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite, expected=value))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["expected"] == [message]
    assert not EvalCase.objects.exists()


# An integer longer than Python converts from text (4,300 digits by default).
TOO_LONG_INTEGER = "1" * 5000


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("input_schema", '{"type": "object", "maximum": ' + TOO_LONG_INTEGER + "}"),
        ("rate_limit", '{"per_seconds": 60, "requests": ' + TOO_LONG_INTEGER + "}"),
        ("adapter_config", "[" + TOO_LONG_INTEGER + "]"),
    ],
    ids=["input-schema", "rate-limit", "adapter-config"],
)
def test_an_integer_too_long_to_read_is_a_form_error_kept_as_typed(
    client, publisher, world, field, value
):
    # given a publisher adding a version of their tool
    client.force_login(publisher)
    counts = ToolVersion.objects.count(), ToolVersion.history.count()
    data = tool_version_form(world.project_search, **{field: value})

    # when a JSON field holds an integer of 5,000 digits
    response = client.post("/admin/registry/toolversion/add/", data)

    # then the form says so next to the field and shows the text typed, and nothing is saved
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert form.errors[field] == ["Integers must lie within ±9007199254740991."]
    assert form[field].value() == value
    assert (ToolVersion.objects.count(), ToolVersion.history.count()) == counts


@pytest.mark.parametrize("empty", ["", "null"])
def test_an_empty_json_field_takes_its_default(client, platform_admin, suite, empty):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite, metadata=empty, forbidden=empty))

    assert response.status_code == 302, response.context["adminform"].form.errors
    case = EvalCase.objects.get()
    assert (case.metadata, case.forbidden) == ({}, {})


def test_a_choice_that_is_not_even_an_id_is_a_form_error(client, platform_admin, world):
    client.force_login(platform_admin)
    membership = world.alice_membership

    response = client.post(
        f"/admin/registry/membership/{membership.pk}/change/",
        {"user": "abc", "tenant": world.acme.pk, "role": membership.role},
    )

    assert response.status_code == 200
    assert "user" in response.context["adminform"].form.errors


@pytest.mark.parametrize("pin", ["abc", "99999999", "00000000-0000-0000-0000-000000000000"])
def test_a_skill_pin_that_is_not_a_tool_version_is_a_form_error(client, publisher, world, pin):
    draft = world.weekly_summary_1_1
    dependency = draft.tool_dependencies.get()
    client.force_login(publisher)
    data = {
        "version": draft.version,
        **{
            field: json.dumps(value) if not isinstance(value, str) else value
            for field, value in skill_content().items()
        },
        "tool_dependencies-TOTAL_FORMS": "1",
        "tool_dependencies-INITIAL_FORMS": "1",
        "tool_dependencies-MIN_NUM_FORMS": "0",
        "tool_dependencies-MAX_NUM_FORMS": "1000",
        "tool_dependencies-0-id": str(dependency.pk),
        "tool_dependencies-0-skill_version": str(draft.pk),
        "tool_dependencies-0-tool_version": pin,
    }

    response = client.post(f"/admin/registry/skillversion/{draft.pk}/change/", data)

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {}
    [pins] = response.context["inline_admin_formsets"]
    assert list(pins.formset.errors[0]) == ["tool_version"]
    assert list(draft.tool_dependencies.values_list("tool_version", flat=True)) == [
        world.project_search_1.pk
    ]


@pytest.mark.parametrize(
    ("changelist", "action", "selected"),
    [
        ("/admin/registry/toolversion/", "publish", "abc"),
        ("/admin/registry/toolversion/", "compare", "\x00"),
        ("/admin/registry/policy/", "delete_selected", "00000000-0000-0000-0000-000000000000"),
    ],
)
def test_an_action_on_a_selection_that_is_not_even_an_id_changes_nothing(
    client, platform_admin, world, changelist, action, selected
):
    client.force_login(platform_admin)
    draft = world.project_search_2
    body = {"action": action, "index": "0", "_selected_action": [str(draft.pk), selected]}

    response = client.post(changelist, body, follow=True)

    assert response.status_code == 200
    assert [str(message) for message in response.context["messages"]] == [
        "The selection names no item of this list. No items have been changed."
    ]
    draft.refresh_from_db()
    assert draft.status == "draft"
    assert Policy.objects.count() == 2


@pytest.mark.parametrize(
    "changelist",
    [
        "/admin/auth/user/",
        "/admin/auth/group/",
        "/admin/django_celery_beat/periodictask/",
        "/admin/django_celery_beat/clockedschedule/",
        "/admin/django_celery_beat/crontabschedule/",
        "/admin/django_celery_beat/solarschedule/",
        "/admin/django_celery_beat/intervalschedule/",
    ],
)
def test_an_action_of_djangos_and_beats_admins_on_a_selection_that_is_not_even_an_id_changes_nothing(  # noqa: E501
    client, platform_admin, changelist
):
    client.force_login(platform_admin)
    Group.objects.create(name="auditors")
    IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    counts = [
        model.objects.count() for model in (get_user_model(), Group, PeriodicTask, IntervalSchedule)
    ]
    body = {"action": "delete_selected", "index": "0", "_selected_action": "abc"}

    response = client.post(changelist, body, follow=True)

    assert response.status_code == 200
    assert [str(message) for message in response.context["messages"]] == [
        "The selection names no item of this list. No items have been changed."
    ]
    assert counts == [
        model.objects.count() for model in (get_user_model(), Group, PeriodicTask, IntervalSchedule)
    ]


def test_every_admin_of_the_site_refuses_a_selection_that_is_not_even_an_id():
    models = [
        model
        for model, model_admin in admin.site._registry.items()
        if not isinstance(model_admin, SelectionKeysMixin)
    ]

    assert models == []
    assert {ClockedSchedule, CrontabSchedule, SolarSchedule} <= set(admin.site._registry)


@pytest.mark.django_db(transaction=True)
def test_a_name_another_request_saved_since_the_form_checked_it_is_a_form_error(
    client, platform_admin, monkeypatch
):
    # given another admin adding a model named "planner" while this one does
    check = common.full_clean_or_raise
    raced = []

    def check_then_race(instance, **kwargs):
        check(instance, **kwargs)
        if isinstance(instance, ModelConfig) and not raced:
            raced.append(True)
            thread = threading.Thread(target=_another_admin_adds_the_planner)
            thread.start()
            thread.join()

    monkeypatch.setattr(common, "full_clean_or_raise", check_then_race)
    client.force_login(platform_admin)

    # when this admin saves it too
    response = client.post(
        "/admin/registry/modelconfig/add/",
        {
            "name": "planner",
            "provider": "offline",
            "model_name": "offline-planner",
            "parameters": "{}",
            "price_per_1k_input": "0",
            "price_per_1k_output": "0",
            "is_active": "on",
        },
    )

    # then the form says the name is taken, and there is one model of that name
    assert response.status_code == 200
    errors = response.context["adminform"].form.non_field_errors()
    assert "Constraint “modelconfig_unique_platform_name” is violated." in errors
    assert ModelConfig.objects.filter(name="planner").count() == 1


def _another_admin_adds_the_planner() -> None:
    try:
        ModelConfig.objects.create(name="planner", provider="offline", model_name="offline-planner")
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("path", "data", "field"),
    [
        (
            "/admin/django_celery_beat/crontabschedule/add/",
            {
                "minute": "-1",
                "hour": "*",
                "day_of_month": "*",
                "month_of_year": "*",
                "day_of_week": "*",
                "timezone": "UTC",
            },
            "minute",
        ),
        (
            "/admin/django_celery_beat/periodictask/add/",
            {"name": "nightly", "task": "x" * 201, "args": "[]", "kwargs": "{}"},
            "task",
        ),
    ],
    ids=["negative-minute", "overlong-task"],
)
def test_a_schedule_the_beat_admins_refuse_is_a_form_error(
    client, platform_admin, path, data, field
):
    client.force_login(platform_admin)

    response = client.post(path, data)

    assert response.status_code == 200
    assert field in response.context["adminform"].form.errors
    assert not (CrontabSchedule.objects.exists() or PeriodicTask.objects.exists())


@pytest.mark.parametrize(
    "path",
    [
        "/admin/registry/tool/?_to_field=versions",
        "/admin/registry/skillversion/?_popup=1&_to_field=tool_dependencies",
        "/admin/registry/tenant/?_to_field=memberships",
        "/admin/auth/group/?_popup=1&_to_field=tenant",
        "/admin/django_celery_beat/periodictask/?_to_field=scheduled_task",
    ],
)
def test_a_to_field_naming_a_relation_to_the_model_is_a_bad_request(client, platform_admin, path):
    client.force_login(platform_admin)

    response = client.get(path)

    assert response.status_code == 400


@pytest.mark.parametrize(
    "query",
    [
        "app_label=registry&model_name=tenant&field_name=memberships",
        "app_label=registry&model_name=tool&field_name=versions",
        "app_label=auth&model_name=group&field_name=user",
    ],
)
def test_an_autocomplete_naming_a_relation_to_the_model_is_refused(
    client, platform_admin, world, query
):
    client.force_login(platform_admin)

    response = client.get(f"/admin/autocomplete/?{query}&term=a")

    assert response.status_code == 403


def test_an_autocomplete_of_a_form_s_own_field_still_answers(client, platform_admin, world):
    client.force_login(platform_admin)
    query = "app_label=registry&model_name=skilltooldependency&field_name=tool_version"

    response = client.get(f"/admin/autocomplete/?{query}&term=project")

    assert response.status_code == 200
    assert {result["id"] for result in response.json()["results"]} == {
        str(world.project_search_1.pk),
        str(world.project_search_2.pk),
    }
