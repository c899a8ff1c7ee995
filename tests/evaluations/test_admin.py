"""What the admin refuses to save in an evaluation's definition: a threshold no eval run
could be measured against, a case the runner would misread."""

import pytest

from evaluations.models import EvalCase, EvalSuite, EvalThreshold

THRESHOLD_ADD = "/admin/evaluations/evalthreshold/add/"


@pytest.fixture
def suite(acme) -> EvalSuite:
    return EvalSuite.objects.create(
        tenant=acme, key="weekly", name="Weekly", kind="task", skill_name="weekly-summary"
    )


def threshold_form(suite: EvalSuite, **overrides) -> dict:
    return {
        "tenant": suite.tenant_id,
        "skill_name": "weekly-summary",
        "suite": suite.pk,
        "metric": "injection_success_rate",
        "comparator": "<=",
        "value": "0.05",
        **overrides,
    }


@pytest.mark.parametrize(
    ("metric", "comparator", "value"),
    [
        ("injection_success_rate", "<=", "5"),
        ("case_pass_rate", ">=", "90"),
        ("completion_rate", ">=", "-0.1"),
    ],
)
def test_a_rate_threshold_outside_zero_to_one_is_refused_naming_the_metric(
    client, platform_admin, suite, metric, comparator, value
):
    client.force_login(platform_admin)

    response = client.post(
        THRESHOLD_ADD, threshold_form(suite, metric=metric, comparator=comparator, value=value)
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "value": [f"{metric} is a rate, a fraction from 0 to 1 (0.05 for 5%), not {float(value)}."]
    }
    assert not EvalThreshold.objects.exists()


def test_a_negative_latency_threshold_is_refused(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(
        THRESHOLD_ADD, threshold_form(suite, metric="latency_p95_ms", value="-1")
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "value": ["latency_p95_ms is never negative, not -1.0."]
    }
    assert not EvalThreshold.objects.exists()


def test_an_unknown_metric_is_refused(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(THRESHOLD_ADD, threshold_form(suite, metric="injection_rate"))

    assert response.status_code == 200
    assert list(response.context["adminform"].form.errors) == ["metric"]
    assert not EvalThreshold.objects.exists()


@pytest.mark.parametrize(
    ("metric", "value"),
    [("injection_success_rate", "0.05"), ("case_pass_rate", "1"), ("latency_p95_ms", "2500")],
)
def test_a_threshold_in_the_metric_s_range_is_saved(client, platform_admin, suite, metric, value):
    client.force_login(platform_admin)

    response = client.post(THRESHOLD_ADD, threshold_form(suite, metric=metric, value=value))

    assert response.status_code == 302, response.context["adminform"].form.errors
    threshold = EvalThreshold.objects.get()
    assert (threshold.metric, threshold.value) == (metric, float(value))


CASE_ADD = "/admin/evaluations/evalcase/add/"


def case_form(suite: EvalSuite, **overrides) -> dict:
    return {
        "suite": suite.pk,
        "key": "week",
        "title": "The weekly summary",
        "messages": '["Summarise this week."]',
        "metadata": '{"project_id": "apollo"}',
        "session_state": "{}",
        "fixture": '{"projects": [{"key": "apollo", "leads": [["dir-1", "Li", "", 1]]}]}',
        "expected": '{"status": "WAITING_APPROVAL"}',
        "forbidden": "{}",
        **overrides,
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("messages", '"Summarise this week."', "'Summarise this week.' is not of type 'array'"),
        ("messages", "[]", "This field is required."),
        (
            "fixture",
            '{"projects": [{"name": "No key"}]}',
            "projects/0: 'key' is a required property",
        ),
        (
            "fixture",
            '{"faults": {"project_search": "SLOW"}}',
            "faults/project_search: 'SLOW' is not one of",
        ),
        ("expected", '{"status": "DONE"}', "status: 'DONE' is not one of"),
    ],
)
def test_a_malformed_case_is_a_form_error_on_its_field(
    client, platform_admin, suite, field, value, message
):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite, **{field: value}))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field]
    assert errors[field][0].startswith(message)
    assert not EvalCase.objects.exists()


def test_a_case_of_an_attack_suite_without_a_vector_is_a_form_error(client, platform_admin, suite):
    EvalSuite.objects.filter(pk=suite.pk).update(kind="attack")
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "vector": ["A case of an attack suite says where its payload hides."]
    }


def test_a_well_formed_case_is_saved(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite))

    assert response.status_code == 302, response.context["adminform"].form.errors
    assert EvalCase.objects.get().messages == ["Summarise this week."]
