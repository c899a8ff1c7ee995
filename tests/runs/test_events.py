"""The run event log is insert-only: the ORM refuses updates and deletes, the database refuses
a second event with the same seq in a run."""

import pytest
from django.db import IntegrityError, transaction

from runs import events
from runs.errors import EventLogIsAppendOnly
from runs.models import Run, RunEvent
from tests.runs.conftest import event_log


@pytest.fixture
def run(start_run, member, acme_agent) -> Run:
    """A queued run with its first four events."""
    return start_run(member)


def _log_state(run: Run) -> list[tuple]:
    """Every stored field of the run's events, to prove a refused write changed nothing."""
    return list(
        RunEvent.objects.filter(run=run)
        .order_by("seq")
        .values_list("id", "seq", "type", "payload", "created_at")
    )


def test_a_stored_event_cannot_be_saved_again(run):
    before = _log_state(run)
    event = RunEvent.objects.get(run=run, seq=2)
    event.payload = {"message": "rewritten"}
    event.type = "run.finished"

    with pytest.raises(EventLogIsAppendOnly):
        event.save()
    with pytest.raises(EventLogIsAppendOnly):
        event.save(update_fields=["payload"])

    assert _log_state(run) == before


def test_a_stored_event_cannot_be_deleted(run):
    before = _log_state(run)
    event = RunEvent.objects.get(run=run, seq=4)

    with pytest.raises(EventLogIsAppendOnly):
        event.delete()

    assert _log_state(run) == before


@pytest.mark.parametrize(
    "update",
    [
        lambda run: RunEvent.objects.filter(run=run).update(payload={}),
        lambda run: RunEvent.objects.update(type="run.finished"),
        lambda run: RunEvent.objects.all().update(seq=99),
        lambda run: run.events.update(payload={}),
        lambda run: run.events.filter(seq=1).update(payload={}),
    ],
    ids=["filtered", "manager", "all", "related-manager", "related-filtered"],
)
def test_a_queryset_update_is_refused(run, update):
    before = _log_state(run)

    with pytest.raises(EventLogIsAppendOnly):
        update(run)

    assert _log_state(run) == before


@pytest.mark.parametrize(
    "delete",
    [
        lambda run: RunEvent.objects.filter(run=run).delete(),
        lambda run: RunEvent.objects.all().delete(),
        lambda run: run.events.all().delete(),
        lambda run: run.events.filter(seq=4).delete(),
    ],
    ids=["filtered", "all", "related", "related-filtered"],
)
def test_a_queryset_delete_is_refused(run, delete):
    before = _log_state(run)

    with pytest.raises(EventLogIsAppendOnly):
        delete(run)

    assert _log_state(run) == before


def test_a_bulk_update_is_refused(run):
    before = _log_state(run)
    stored = list(RunEvent.objects.filter(run=run))
    for event in stored:
        event.payload = {}

    # bulk_update runs in an atomic block without a savepoint: give it one of its own.
    with pytest.raises(EventLogIsAppendOnly), transaction.atomic():
        RunEvent.objects.bulk_update(stored, ["payload"])

    assert _log_state(run) == before


def test_an_upsert_cannot_rewrite_an_event(run):
    before = _log_state(run)
    existing = RunEvent.objects.get(run=run, seq=1)
    rewritten = RunEvent(id=existing.pk, run=run, seq=1, type="run.finished", payload={"x": 1})

    with pytest.raises(EventLogIsAppendOnly), transaction.atomic():
        RunEvent.objects.bulk_create(
            [rewritten],
            update_conflicts=True,
            unique_fields=["run", "seq"],
            update_fields=["type", "payload"],
        )

    assert _log_state(run) == before


def test_the_base_manager_refuses_updates_and_deletes_too(run):
    # Django reaches rows through the base manager where the default one is not used
    # (related objects, saving): it is the same append-only one.
    before = _log_state(run)

    with pytest.raises(EventLogIsAppendOnly):
        RunEvent._base_manager.filter(run=run, seq=3).update(payload={})
    with pytest.raises(EventLogIsAppendOnly):
        RunEvent._base_manager.filter(run=run).delete()

    assert _log_state(run) == before


def test_update_or_create_cannot_rewrite_an_event(run):
    before = _log_state(run)

    with pytest.raises(EventLogIsAppendOnly):
        RunEvent.objects.update_or_create(run=run, seq=1, defaults={"payload": {}})

    assert _log_state(run) == before


def test_a_new_instance_with_an_existing_id_does_not_overwrite_it(run):
    before = _log_state(run)
    existing = RunEvent.objects.get(run=run, seq=1)
    impostor = RunEvent(id=existing.pk, run=run, seq=1, type="run.finished", payload={"x": 1})

    with pytest.raises(IntegrityError), transaction.atomic():
        impostor.save()

    assert _log_state(run) == before


def test_the_database_refuses_a_second_event_with_the_same_seq(run):
    before = _log_state(run)

    with pytest.raises(IntegrityError), transaction.atomic():
        RunEvent.objects.create(run=run, seq=3, type="run.finished", payload={})

    assert _log_state(run) == before


def test_the_same_seq_in_another_run_is_allowed(run, start_run, member):
    other = start_run(member)

    assert [seq for seq, _ in event_log(other)] == [seq for seq, _ in event_log(run)]
    assert RunEvent.objects.filter(seq=1).count() == 2


def test_the_database_refuses_seq_zero(run):
    before = _log_state(run)

    with pytest.raises(IntegrityError), transaction.atomic():
        RunEvent.objects.create(run=run, seq=0, type="run.finished", payload={})

    assert _log_state(run) == before


def test_writers_number_events_after_the_last_one(run):
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        appended = events.run_finished(locked, status="CANCELLED", reason_code="TEST")
        locked.save(update_fields=["last_event_seq"])

    assert appended.seq == 5
    assert Run.objects.get(pk=run.pk).last_event_seq == 5
    assert event_log(run)[-1] == (5, "run.finished")
    assert RunEvent.objects.get(pk=appended.pk).payload == {
        "status": "CANCELLED",
        "reason_code": "TEST",
        "cancelled_by": None,
    }


def test_a_counter_left_unsaved_collides_instead_of_losing_events(run):
    with transaction.atomic():
        events.run_finished(
            Run.objects.select_for_update().get(pk=run.pk), status="CANCELLED", reason_code="A"
        )
    before = _log_state(run)

    with pytest.raises(IntegrityError), transaction.atomic():
        events.run_finished(
            Run.objects.select_for_update().get(pk=run.pk), status="CANCELLED", reason_code="B"
        )

    assert _log_state(run) == before


def test_a_run_with_events_cannot_be_deleted(run):
    before = _log_state(run)

    with pytest.raises(Exception) as raised, transaction.atomic():
        Run.objects.filter(pk=run.pk).delete()

    assert type(raised.value).__name__ in {"ProtectedError", "RestrictedError"}
    assert Run.objects.filter(pk=run.pk).exists()
    assert _log_state(run) == before
