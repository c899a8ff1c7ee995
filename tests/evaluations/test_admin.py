"""What the admin refuses to save in an evaluation's definition: a threshold no eval run
could be measured against, a case the runner would misread."""

import pytest

from evaluations.models import EvalSuite, EvalThreshold

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
