"""Odd input in the admin's JSON fields is a form error, and an empty one the field's default:
never a value PostgreSQL refuses (a server error) or a page that cannot be drawn."""

import pytest

from evaluations.models import EvalCase, EvalSuite

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
