"""A tenant's concurrency cap with a real worker: with two worker processes free, a tenant
capped at one run has its second run wait in the queue until the first pauses."""

import pytest

from registry.models import Tenant
from runs.choices import RunStatus
from tests.celery_worker import (
    alice_client,
    example_post,
    example_seed,
    gated_example_publish,
    run_status,
    wait_until,
)
from tests.reliability.gated_tool import GATE_ENV, calls_file

pytestmark = pytest.mark.django_db(transaction=True)

WAIT_SECONDS = 30


def test_a_tenant_at_its_cap_has_its_other_runs_wait_their_turn(start_worker, tmp_path):
    example_seed()
    gated_example_publish()
    Tenant.objects.filter(slug="acme").update(max_concurrent_runs=1)
    gate = tmp_path / "gate"
    gate.touch()
    worker = start_worker(pool="prefork", concurrency=2, environment={GATE_ENV: str(gate)})
    client = alice_client()
    run_ids = [example_post(client).json()["run_id"] for _ in range(2)]
    wait_until(
        lambda: calls_file(gate).exists(),
        seconds=WAIT_SECONDS,
        what="the first run's project_search to be in flight",
        worker=worker,
    )

    # The other run's task comes back while the first holds the tenant's one slot.
    wait_until(
        lambda: worker.tasks_received() >= 4,
        seconds=WAIT_SECONDS,
        what="the waiting run to ask for its turn again",
        worker=worker,
    )
    [in_flight] = calls_file(gate).read_text().splitlines()
    waiting = next(run_id for run_id in run_ids if not in_flight.startswith(run_id))
    assert run_status(waiting) == RunStatus.QUEUED
    assert "waits: its tenant has 1 runs advancing" in worker.output()

    gate.unlink()

    for run_id in run_ids:
        wait_until(
            lambda run_id=run_id: run_status(run_id) == RunStatus.WAITING_APPROVAL,
            seconds=WAIT_SECONDS,
            what="both runs to reach their approval",
            worker=worker,
        )
    assert len(calls_file(gate).read_text().splitlines()) == 2
