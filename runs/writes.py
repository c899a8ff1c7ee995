"""A step's writes in one statement.

While a run holds its rows (`hold`), the events, spans, tool calls and sources a step makes
stay in memory; `run_update` (or `run_insert`, for a run being created) writes them with the
run's own row in one statement, `WITH w0 AS (INSERT ...), w1 AS (INSERT ...) UPDATE runs_run
...`, in the step's transaction: one round trip to PostgreSQL where there were one per table.
Rows of a table keep their order; foreign keys between them are checked when the statement
ends, once all its parts have run (runs 0017). Values are prepared by their fields as `save`
prepares them: `pre_save` where saving computes the value (`auto_now`), then on PostgreSQL
`get_prep_value` for a value JSON does not carry as it is (a string, number, UUID, date,
decimal, list or dict needs none), the rows and the run's JSON columns travelling as compact
JSON text (`config.jsontext`); `get_db_prep_save` elsewhere.
A new row of a model with change history is written with the historical row `save` would add,
made from the values saving computed. An auto-incremented primary key is left to the
database. A run that holds nothing writes each row at once (`insert`), in the same statements.
"""

import functools
from collections.abc import Iterable, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.models import Field
from psycopg.types.json import Jsonb

from config import jsontext
from config.history import creation_record, has_history
from config.queries import prepared_cursor
from runs.models import Run

PENDING = "_pending_rows"
STATEMENTS = "_pending_statements"


def hold(run: Run) -> None:
    """Keep this run's new rows in memory until its row is written."""
    run.__dict__[PENDING] = []
    run.__dict__[STATEMENTS] = []


def holding(run: Run) -> bool:
    return PENDING in run.__dict__


def _by_model(rows: Iterable[models.Model]) -> dict[type[models.Model], list[models.Model]]:
    grouped: dict[type[models.Model], list[models.Model]] = {}
    for row in rows:
        grouped.setdefault(type(row), []).append(row)
    return grouped


@functools.cache
def _positional(model: type[models.Model]) -> tuple[tuple[str, Field], ...]:
    return tuple((field.attname, field) for field in model._meta.concrete_fields)


def new(model: type[models.Model], **values: Any) -> models.Model:
    """A new row of `model` from column values (`run_id`, not `run`): made the way the ORM
    makes a row it reads, by position, without the per-field work of keyword arguments. A
    field not given takes its default, as with keyword arguments."""
    args = [
        values.pop(attname) if attname in values else field.get_default()
        for attname, field in _positional(model)
    ]
    if values:
        raise TypeError(f"{model.__name__} has no column {', '.join(sorted(values))}.")
    return model(*args)


def add(run: Run, rows: Iterable[models.Model]) -> None:
    """New rows of the run: held when the run holds them, inserted at once otherwise."""
    held = run.__dict__.get(PENDING)
    if held is not None:
        held.extend(rows)
        return
    insert(list(rows))


def add_statement(run: Run, sql: str, params: Sequence) -> None:
    """A data-modifying statement of the held step on another table (`UPDATE ...`,
    PostgreSQL), written with the run's row. A step gives each row of another table one
    statement at most: two in one WITH would race for it."""
    run.__dict__[STATEMENTS].append((sql, list(params)))


def pending(run: Run, model: type[models.Model]) -> list[models.Model]:
    """The rows of `model` held for the run and not written yet."""
    return [row for row in run.__dict__.get(PENDING, ()) if type(row) is model]


@functools.cache
def _insert_fields(model: type[models.Model]) -> tuple[list[Field], str, str]:
    """The fields an INSERT of `model` writes, its quoted table name and its column list."""
    fields = [
        field
        for field in model._meta.concrete_fields
        if not field.generated and not (field.primary_key and field.db_returning)
    ]
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    columns = ", ".join(quote(field.column) for field in fields)
    return fields, quote(model._meta.db_table), columns


@functools.cache
def _json_columns(model: type[models.Model]) -> tuple[tuple[Field, str, str, bool], ...]:
    """For each field an INSERT of `model` writes: its column, its attribute, and whether
    saving computes its value (`pre_save` of its own)."""
    fields, _, _ = _insert_fields(model)
    return tuple(
        (field, field.column, field.attname, type(field).pre_save is not Field.pre_save)
        for field in fields
    )


# Values JSON text (with _json_default) carries as they are.
_JSON_READY = frozenset(
    {str, int, float, bool, dict, list, type(None), UUID, datetime, date, Decimal}
)


def _json_row(row: models.Model, columns: tuple[tuple[Field, str, str, bool], ...]) -> dict:
    values = {}
    for field, column, attname, computed in columns:
        value = field.pre_save(row, True) if computed else getattr(row, attname)
        values[column] = value if type(value) in _JSON_READY else field.get_prep_value(value)
    return values


def _json_default(value: Any) -> str:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID | Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not a column value")


def _inserts(rows: Sequence[models.Model]) -> list[tuple[str, list]]:
    """One INSERT per model, its values prepared by the fields as `save` prepares them. On
    PostgreSQL the rows travel as one JSON array (`jsonb_populate_recordset`): the statement
    is the same whatever the number of rows, with one parameter, where a VALUES list would
    grow a placeholder per column and row for the driver to parse."""
    db = connections[DEFAULT_DB_ALIAS]
    statements = []
    for model, objects in _by_model(rows).items():
        fields, table, columns = _insert_fields(model)
        for row in objects:
            if row._state.fields_cache:
                row._prepare_related_fields_for_save(operation_name="write")
        if db.vendor == "postgresql":
            columns_of = _json_columns(model)
            values = [_json_row(row, columns_of) for row in objects]
            statements.append(
                (
                    f"INSERT INTO {table} ({columns}) "
                    f"SELECT {columns} FROM jsonb_populate_recordset(NULL::{table}, %s)",
                    [jsontext.dumps(values, default=_json_default)],
                )
            )
            continue
        placeholders = "(" + ", ".join(["%s"] * len(fields)) + ")"
        params = [
            field.get_db_prep_save(field.pre_save(row, True), db)
            for row in objects
            for field in fields
        ]
        statements.append(
            (
                f"INSERT INTO {table} ({columns}) VALUES "
                + ", ".join([placeholders] * len(objects)),
                params,
            )
        )
    return statements


def _with_history(rows: Sequence[models.Model]) -> list[tuple[str, list]]:
    """The inserts of `rows`, then those of the "+" historical records of the rows with change
    history: made once the inserts have set what saving computes (`auto_now`)."""
    inserts = _inserts(rows)
    history = [creation_record(row) for row in rows if has_history(type(row))]
    return [*inserts, *_inserts(history)]


def _written(rows: Sequence[models.Model]) -> None:
    for row in rows:
        row._state.adding = False
        row._state.db = DEFAULT_DB_ALIAS


def _execute(
    main: tuple[str, list], rows: list[models.Model], statements: list[tuple[str, list]]
) -> int:
    """Run the inserts, the statements and `main` as one statement; returns the rows `main`
    touched. A database without data-modifying WITH (SQLite, the embedded default) runs them
    in turn."""
    parts = [*_with_history(rows), *statements]
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor == "postgresql" and parts:
        sql = "".join(
            ("WITH " if index == 0 else ", ") + f"w{index} AS ({part_sql})"
            for index, (part_sql, _) in enumerate(parts)
        )
        params = [param for _, part_params in parts for param in part_params]
        parts, main = [], (f"{sql} {main[0]}", [*params, *main[1]])
    with prepared_cursor(db) as cursor:
        for part_sql, part_params in [*parts, main]:
            cursor.execute(part_sql, part_params)
        count = cursor.rowcount
    _written(rows)
    return count


def insert(rows: Sequence[models.Model]) -> None:
    """Insert new rows now: one statement per model, with the SQL text of a step's write."""
    with prepared_cursor(connections[DEFAULT_DB_ALIAS]) as cursor:
        for sql, params in _with_history(rows):
            cursor.execute(sql, params)
    _written(rows)


def _take(run: Run) -> tuple[list[models.Model], list[tuple[str, list]]]:
    return run.__dict__.pop(PENDING, None) or [], run.__dict__.pop(STATEMENTS, None) or []


def run_insert(run: Run) -> list[models.Model]:
    """Insert the new run with the rows it holds; returns those rows."""
    rows, statements = _take(run)
    [main] = _inserts([run])
    _execute(main, rows, statements)
    _written([run])
    return rows


def _update_value(field: Field, row: models.Model, db: Any) -> Any:
    """The value an UPDATE of `field` writes, prepared as `save` prepares it; a JSON value on
    PostgreSQL is written as `runs.writes` writes JSON (None stays SQL NULL, as with `save`).
    An integer outside its column's range is refused: bound by the server as a binary
    parameter of the column's width, it would be stored wrapped around, without an error."""
    value = field.pre_save(row, False)
    if isinstance(field, models.IntegerField) and type(value) is int:
        low, high = db.ops.integer_field_range(field.get_internal_type())
        if not (low is None or low <= value) or not (high is None or value <= high):
            raise ValueError(f"{field.name} = {value} is outside its column's range.")
    if (
        value is not None
        and db.vendor == "postgresql"
        and isinstance(field, models.JSONField)
        and not field.encoder
        and not hasattr(value, "as_sql")
    ):
        return Jsonb(field.get_prep_value(value), dumps=jsontext.dumps_bytes)
    return field.get_db_prep_save(value, db)


def run_update(run: Run, *, fields: Sequence[str]) -> list[models.Model]:
    """Update the run's `fields` (and `updated_at`) with the rows it holds; returns them."""
    rows, statements = _take(run)
    db = connections[DEFAULT_DB_ALIAS]
    quote = db.ops.quote_name
    targets = [Run._meta.get_field(name) for name in dict.fromkeys([*fields, "updated_at"])]
    main = (
        f"UPDATE {quote(Run._meta.db_table)} SET "
        + ", ".join(f"{quote(field.column)} = %s" for field in targets)
        + f" WHERE {quote(Run._meta.pk.column)} = %s",
        [
            *(_update_value(field, run, db) for field in targets),
            Run._meta.pk.get_db_prep_value(run.pk, db),
        ],
    )
    if _execute(main, rows, statements) != 1:
        raise Run.DoesNotExist(f"Run {run.pk} is gone.")
    return rows
