"""Daily cost quotas per tenant: every model turn's cost counts; a run that finds the quota
spent ends BUDGET_EXHAUSTED with a clear reason; other tenants are not affected."""

from decimal import Decimal

import pytest

from registry.models import ModelConfig
from registry.services.common import registry_object_save
from runs import quotas
from runs.loop import run_advance_step, run_execute
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


@pytest.mark.django_db(transaction=True)
def test_a_model_price_changed_while_a_run_is_running_leaves_the_price_it_started_with(demo):
    # given the offline planner at 0.01 / 0.02 per 1k tokens, a run made whole at those
    # prices, and another that has started (its host's steps, before any model turn)
    config = ModelConfig.objects.get(name="offline-planner")
    config.price_per_1k_input, config.price_per_1k_output = Decimal("0.01"), Decimal("0.02")
    registry_object_save(instance=config, actor=demo.admin, reason="priced")
    baseline = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(baseline.pk))
    baseline.refresh_from_db()
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk)) is True
    assert run.capability["model"]["price_per_1k_input"] == "0.010000"
    assert run.capability["model"]["price_per_1k_output"] == "0.020000"

    # when an admin raises the prices a thousandfold, and the run goes on
    config.price_per_1k_input, config.price_per_1k_output = Decimal("10"), Decimal("20")
    registry_object_save(instance=config, actor=demo.admin, reason="repriced")
    run_execute(run_id=str(run.pk))

    # then its turns cost what they cost at its start, in the run and in the tenant's day
    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert baseline.cost > 0
    assert run.cost == baseline.cost
    assert [Decimal(turn["cost"]) for turn in events_of(run, "model.responded")] == [
        Decimal(turn["cost"]) for turn in events_of(baseline, "model.responded")
    ]
    assert quotas.tenant_cost_today(demo.acme.pk) == baseline.cost + run.cost


@pytest.mark.django_db(transaction=True)
def test_a_run_whose_snapshot_pinned_no_prices_pays_the_current_ones(demo):
    # given a run started before snapshots pinned the model's prices
    run = demo_run(demo, project_id="apollo")
    capability = run.capability
    del capability["model"]["price_per_1k_input"], capability["model"]["price_per_1k_output"]
    Run.objects.filter(pk=run.pk).update(capability=capability)
    ModelConfig.objects.filter(name="offline-planner").update(
        price_per_1k_input=Decimal("0.01"), price_per_1k_output=Decimal("0.02")
    )

    # when
    run_execute(run_id=str(run.pk))

    # then it runs, at the model config's prices
    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert run.cost > 0
