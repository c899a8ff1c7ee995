"""Daily cost quotas per tenant: every model turn's cost counts; a run that finds the quota
spent ends BUDGET_EXHAUSTED with a clear reason; other tenants are not affected."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from registry.models import ModelConfig
from registry.services.common import registry_object_save
from runs import quotas
from runs.loop import run_advance_step, run_execute
from runs.models import Run, ToolCall
from tests.runs.conftest import demo_run, events_of, read_apollo
from tests.runs.test_loop import budgets, context_tokens, priced_fake_model

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
    # the day is UTC's (TIME_ZONE): it resets at its midnight, which the result says exactly
    tomorrow = (timezone.now() + timedelta(days=1)).date().isoformat()
    assert run.result["output"]["resets_on"] == tomorrow
    assert run.result["output"]["resets_at"] == f"{tomorrow}T00:00:00+00:00"
    assert run.result["output"]["reason"] == (
        f"The tenant's daily model cost quota is spent; it resets at {tomorrow} 00:00 UTC."
    )
    assert events_of(run, "model.requested") == []
    assert not ToolCall.objects.filter(run=run, name="project_search").exists()


def test_a_model_turn_whose_context_alone_would_pass_what_is_left_of_the_quota_is_not_sent(
    demo, fake_model
):
    # given a model at 1.00 per 1k input tokens, a run's cost budget of 10, and acme's quota
    # of 1.00 with half of the first turn's input cost left
    probe = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(probe.pk))
    turn_cost = Decimal(context_tokens(probe)[0]) / 1000
    fake = priced_fake_model(demo, fake_model)
    fake.reply(read_apollo())
    budgets(demo, max_cost=Decimal("10"))
    demo.acme.daily_cost_quota = Decimal("1.00")
    demo.acme.save()
    quotas.tenant_cost_add(demo.acme.pk, Decimal("1.00") - turn_cost / 2)
    spent = quotas.tenant_cost_today(demo.acme.pk)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the turn is not sent (nor paid), and the run ends on the tenant's quota
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("BUDGET_EXHAUSTED", "TENANT_DAILY_COST_QUOTA")
    assert fake.requests == []
    assert run.result["output"]["reason"].startswith(
        "The tenant's daily model cost quota is spent;"
    )
    assert run.result["output"]["daily_cost_quota"] == "1.0000"
    assert run.result["output"]["spent_today"] == f"{spent:.4f}"
    assert run.result["output"]["turn_not_made"] == {"input_tokens": context_tokens(probe)[0]}
    assert (run.steps, run.tokens_used, run.cost) == (0, 0, 0)
    assert quotas.tenant_cost_today(demo.acme.pk) == spent


def test_a_run_goes_on_while_its_turns_fit_in_what_is_left_of_the_quota(demo, fake_model):
    # given a model at 1.00 per 1k input tokens (its output free) that reports no usage (the
    # context builder's estimate counts), a run's cost budget of 10, and acme's quota of 1.00
    # with twice the first turn's input cost left
    probe = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(probe.pk))
    turn_cost = Decimal(context_tokens(probe)[0]) / 1000
    fake = priced_fake_model(demo, fake_model)
    first = read_apollo()
    del first["usage"]
    fake.reply(first)
    budgets(demo, max_cost=Decimal("10"))
    demo.acme.daily_cost_quota = Decimal("1.00")
    demo.acme.save()
    quotas.tenant_cost_add(demo.acme.pk, Decimal("1.00") - 2 * turn_cost)
    spent = quotas.tenant_cost_today(demo.acme.pk)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then its first turn is sent and paid; the second, whose context holds the first's
    # results too, would pass what is left and is not sent
    run = Run.objects.get(pk=run.pk)
    assert len(fake.requests) == 1
    assert run.cost == turn_cost
    assert quotas.tenant_cost_today(demo.acme.pk) == spent + turn_cost
    assert (run.status, run.reason_code) == ("BUDGET_EXHAUSTED", "TENANT_DAILY_COST_QUOTA")
    assert run.result["output"]["turn_not_made"]["input_tokens"] > context_tokens(run)[0]


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
