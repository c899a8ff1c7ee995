"""Daily cost quotas per tenant: every model turn's cost counts; a run that finds the quota
spent ends BUDGET_EXHAUSTED with a clear reason; other tenants are not affected."""

from decimal import Decimal

import pytest

from registry.models import ModelConfig
from runs import quotas
from runs.loop import run_execute
from runs.models import Run, ToolCall
from tests.runs.conftest import demo_run, events_of

pytestmark = pytest.mark.django_db


def test_the_cost_of_each_model_turn_counts_toward_the_tenants_day(demo):
    ModelConfig.objects.filter(name="offline-planner").update(
        price_per_1k_input=Decimal("0.01"), price_per_1k_output=Decimal("0.02")
    )
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.cost > 0
    assert quotas.tenant_cost_today(demo.acme.pk) == run.cost
    assert quotas.tenant_cost_today(demo.globex.pk) == 0


def test_a_run_that_finds_the_quota_spent_ends_budget_exhausted_before_any_model_turn(demo):
    demo.acme.daily_cost_quota = Decimal("1.00")
    demo.acme.save()
    quotas.tenant_cost_add(demo.acme.pk, Decimal("1.25"))
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("BUDGET_EXHAUSTED", "TENANT_DAILY_COST_QUOTA")
    assert run.result["output"]["daily_cost_quota"] == "1.0000"
    assert run.result["output"]["spent_today"] == "1.2500"
    assert run.result["output"]["reason"] == "The tenant's daily model cost quota is spent."
    assert events_of(run, "model.requested") == []
    assert not ToolCall.objects.filter(run=run, name="project_search").exists()


def test_below_the_quota_runs_go_on(demo):
    demo.acme.daily_cost_quota = Decimal("1.00")
    demo.acme.save()
    quotas.tenant_cost_add(demo.acme.pk, Decimal("0.50"))
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    assert Run.objects.get(pk=run.pk).status == "WAITING_APPROVAL"


@pytest.mark.django_db(transaction=True)
def test_a_model_price_changed_between_two_runs_is_the_one_the_second_pays(demo):
    first = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(first.pk))

    ModelConfig.objects.filter(name="offline-planner").update(
        price_per_1k_input=Decimal("0.01"), price_per_1k_output=Decimal("0.02")
    )
    second = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(second.pk))

    assert Run.objects.get(pk=first.pk).cost == 0
    assert Run.objects.get(pk=second.pk).cost > 0
