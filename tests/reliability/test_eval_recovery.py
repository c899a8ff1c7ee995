"""An eval run survives a worker restart: the worker is SIGKILLed in the middle of a case;
once the eval run's lease lapses the sweep hands it to a new worker, which finishes the case
it was in (its runs resumed, not started again) and the rest, each result written once."""

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from evaluations.choices import EvalRunStatus
from evaluations.models import EvalRun, EvalSuite
from evaluations.services import eval_run_start
from evaluations.starter import suites_install
from evaluations.tasks import eval_runs_sweep
from registry.models import AgentConfig, SkillVersion
from runs.models import Run
from tests.celery_worker import example_seed, gated_example_publish, wait_until
from tests.reliability.gated_tool import GATE_ENV, calls_file

pytestmark = pytest.mark.django_db(transaction=True)

WAIT_SECONDS = 60


def _eval_run(run_id) -> EvalRun:
    return EvalRun.objects.get(pk=run_id)


def test_an_eval_run_resumes_after_its_worker_is_killed(start_worker, tmp_path):
    example_seed()
    gated_example_publish()
    suites_install()
    gate = tmp_path / "gate"
    gate.touch()
    environment = {GATE_ENV: str(gate), "EVAL_CASE_LEASE_SECONDS": "2"}
    first = start_worker(pool="solo", environment=environment)
    eval_run, _ = eval_run_start(
        actor=get_user_model().objects.get(username="dave"),
        suite=EvalSuite.objects.get(key="weekly-summary-tasks"),
        skill_version=SkillVersion.objects.get(skill__name="weekly-summary", version="3.3.0"),
        agent_config=AgentConfig.objects.get(name="weekly-reporter"),
    )
    wait_until(
        lambda: calls_file(gate).exists(),
        seconds=WAIT_SECONDS,
        what="a case's project_search to be in flight",
        worker=first,
    )

    first.kill()

    stopped = _eval_run(eval_run.pk)
    assert stopped.status == EvalRunStatus.RUNNING
    done_before = stopped.results.count()
    assert done_before < stopped.cases_total
    gate.unlink()
    second = start_worker(pool="solo", environment=environment)
    wait_until(
        lambda: timezone.now() > _eval_run(eval_run.pk).lease_expires_at,
        seconds=10,
        what="the eval run's lease to lapse",
    )

    # The new worker may be taking a step of the interrupted case's run, whose task waited
    # on the queue: the sweep leaves an eval run alone while a case of it is in flight, and
    # hands it over at a later sweep (beat runs it every minute).
    wait_until(
        lambda: eval_runs_sweep() == 1,
        seconds=WAIT_SECONDS,
        what="a sweep to hand the eval run to the new worker",
        worker=second,
    )

    wait_until(
        lambda: _eval_run(eval_run.pk).status == EvalRunStatus.COMPLETED,
        seconds=WAIT_SECONDS,
        what="the eval run to finish on the new worker",
        worker=second,
    )
    finished = _eval_run(eval_run.pk)
    results = list(finished.results.select_related("case"))
    assert len(results) == len({result.case_id for result in results}) == 22
    assert finished.cases_done == 22
    assert {result.case.key: result.failures for result in results if not result.passed} == {}
    # one run per message of each case: the interrupted case's run was resumed
    messages = sum(len(case.messages) for case in finished.suite.cases.all())
    assert Run.objects.filter(tenant=finished.sandbox).count() == messages
    assert eval_runs_sweep() == 0
