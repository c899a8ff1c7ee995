"""Thin Celery tasks of evaluations: load by id, call the service."""

from celery import shared_task
from django.conf import settings

from config.celery import task_send
from runs.loop import ModelTemporarilyUnavailable
from runs.tasks import MODEL_RETRIES, RunWaitsItsTurn, model_unavailable_wait


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=MODEL_RETRIES)
def eval_run_advance(self, *, eval_run_id: str) -> None:
    """Run an eval run's remaining cases for a while, then hand the rest to a new task, so no
    task outlives the time limit. Safe to deliver twice or after a crash. A task that raises
    counts against the eval run, which ends FAILED when it keeps raising. A case's run waiting
    for its tenant's turn (the cases' runs count against the tenant's concurrent runs) has the
    task come back a little later, as a run's task does. A case's run whose provider was
    unavailable for a while is retried with the backoff and bound of a run's task: the run
    ends FAILED_RETRYABLE past the bound, and a new task records the case and goes on. Eager
    (the embedded default) runs them all at once."""
    from evaluations.services import eval_run_advance as advance
    from evaluations.services import eval_run_advance_failed, eval_run_lease_through

    seconds = None if settings.CELERY_TASK_ALWAYS_EAGER else settings.EVAL_TASK_SECONDS
    try:
        more = advance(eval_run_id=eval_run_id, seconds=seconds)
    except RunWaitsItsTurn as wait:
        task_send(eval_run_advance, eval_run_id=eval_run_id, countdown=wait.seconds)
        return
    except ModelTemporarilyUnavailable as error:
        countdown = model_unavailable_wait(error, retries=self.request.retries)
        if countdown is None:
            task_send(eval_run_advance, eval_run_id=eval_run_id)
            return
        eval_run_lease_through(eval_run_id=eval_run_id, seconds=countdown)
        raise self.retry(countdown=countdown, exc=error) from error
    except Exception as error:
        eval_run_advance_failed(eval_run_id=eval_run_id, error=error)
        raise
    if more:
        task_send(eval_run_advance, eval_run_id=eval_run_id)


@shared_task(acks_late=True)
def eval_runs_sweep() -> int:
    """Advance again the eval runs whose worker died mid-case; returns how many were sent.
    One sent holds a new lease (`eval_runs_leases_renew`); one the broker did not take stays
    stale, for the next sweep."""
    from evaluations.services import eval_runs_leases_renew, eval_runs_stale

    sent = [
        eval_run_id
        for eval_run_id in eval_runs_stale()
        if task_send(eval_run_advance, eval_run_id=eval_run_id)
    ]
    eval_runs_leases_renew(sent)
    return len(sent)
