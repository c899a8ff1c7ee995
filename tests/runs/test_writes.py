"""A step's rows, made from column values and written with the run's row."""

import importlib

import pytest
from django.db import connection, transaction

from evaluations.choices import SuiteKind
from evaluations.models import EvalSuite
from registry.models import Tenant
from runs import events, writes
from runs.loop import run_execute
from runs.models import Run, RunEvent, Source, Span, ToolCall
from tests.runs.conftest import demo_run


def test_a_row_made_from_columns_takes_the_defaults_keywords_would_give():
    made = writes.new(Source, run_id=None, tool_call_id=None, reference="project:apollo")
    keywords = Source(reference="project:apollo")

    assert made.pk is not None and made.pk != keywords.pk
    assert (made.allowed_use, made.content, made.fetched_at) == (
        keywords.allowed_use,
        keywords.content,
        keywords.fetched_at,
    )
    assert made._state.adding


def test_a_column_the_model_lacks_is_refused():
    with pytest.raises(TypeError, match="no column run"):
        writes.new(RunEvent, run=None, seq=1, type="run.finished", payload={})


def test_a_held_event_is_written_with_the_run_as_it_was_made(start_run, member, acme_agent):
    run = start_run(member)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        writes.hold(locked)
        held = events.run_finished(locked, status="CANCELLED", reason_code="TEST")
        assert not RunEvent.objects.filter(pk=held.pk).exists()
        writes.run_update(locked, fields=["last_event_seq"])

    stored = RunEvent.objects.get(pk=held.pk)
    assert (stored.run_id, stored.seq, stored.payload) == (
        run.pk,
        run.last_event_seq + 1,
        {"status": "CANCELLED", "reason_code": "TEST", "cancelled_by": None},
    )
    assert stored.created_at == held.created_at
    assert not held._state.adding


def test_a_row_with_change_history_is_written_with_its_first_record(db):
    suite = EvalSuite(key="weekly", name="Weekly", kind=SuiteKind.TASK, skill_name="weekly")

    writes.insert([suite])

    stored = EvalSuite.objects.get(pk=suite.pk)
    [record] = stored.history.all()
    tracked = [field.attname for field in EvalSuite._meta.concrete_fields]
    assert record.history_type == "+"
    assert {name: getattr(record, name) for name in tracked} == {
        name: getattr(stored, name) for name in tracked
    }


def test_a_row_with_change_history_and_a_key_the_database_sets_is_left_to_save(db):
    with pytest.raises(TypeError):
        writes.insert([Tenant(slug="initech", name="Initech")])

    assert not Tenant.objects.filter(slug="initech").exists()


def test_json_a_step_writes_reads_back_as_it_was(start_run, member, acme_agent):
    """Held rows and the run's own JSON columns travel as JSON text: values orjson leaves to
    the standard library (an integer beyond 64 bits), text beyond ASCII, decimals and dates
    come back as they were given."""
    run = start_run(member)
    value = {"count": 2**70, "name": "Zoë 张", "cost": "0.10", "nested": [{"ok": True}]}
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        writes.hold(locked)
        held = events.run_finished(locked, status="CANCELLED", reason_code="TEST")
        held.payload = {**held.payload, "value": value}
        locked.state = {**locked.state, "value": value}
        locked.transcript = [*locked.transcript, {"kind": "user", "text": value["name"]}]
        writes.run_update(locked, fields=["state", "transcript", "last_event_seq"])

    stored = Run.objects.get(pk=run.pk)
    assert RunEvent.objects.get(pk=held.pk).payload["value"] == value
    assert stored.state["value"] == value
    assert stored.transcript[-1] == {"kind": "user", "text": "Zoë 张"}


def test_the_foreign_keys_of_a_steps_tables_are_checked_as_each_statement_ends(db):
    """Cheaper than checking them all at commit; Django recreates a foreign key initially
    deferred, so a migration that recreates one of these must set it back (runs 0017)."""
    tables = list(
        importlib.import_module(
            "runs.migrations.0017_hot_foreign_keys_checked_per_statement"
        ).TABLES
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conrelid::regclass::text, conname, condeferrable, condeferred "
            "FROM pg_constraint WHERE contype = 'f' AND conrelid::regclass::text = ANY(%s)",
            [tables],
        )
        constraints = cursor.fetchall()

    assert {table for table, *_ in constraints} == set(tables)
    assert [name for _, name, _, deferred in constraints if deferred] == []
    assert all(deferrable for _, _, deferrable, _ in constraints)


@pytest.mark.parametrize("tokens", [2**32 + 5, -1])
def test_an_integer_outside_its_column_is_refused_not_stored_wrapped(
    start_run, member, acme_agent, tokens
):
    run = start_run(member)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        locked.tokens_used = tokens
        with pytest.raises(ValueError, match="tokens_used"):
            writes.run_update(locked, fields=["tokens_used"])

    assert Run.objects.get(pk=run.pk).tokens_used == 0


def test_the_rows_a_run_writes_get_ids_in_the_order_they_were_made(demo):
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))

    events = RunEvent.objects.filter(run=run)
    assert list(events.order_by("id").values_list("seq", flat=True)) == list(
        events.order_by("seq").values_list("seq", flat=True)
    )
    rows = [run, *events, *Span.objects.filter(run=run), *ToolCall.objects.filter(run=run)]
    rows += [*Source.objects.filter(run=run), run.session]
    assert {row.pk.version for row in rows} == {7}
