"""Hot read queries, compiled to SQL once per process.

Building and compiling a queryset costs the client about as much CPU as the round trip it
makes: a quarter of a millisecond for a filter with a join or two, a third of a governed
run's CPU in all. The reads on a run's path are the same few queries with other values, so
`PreparedQuery` compiles its queryset once, with a marker for each parameter, and afterwards
sends the same SQL text with the caller's values. Rows come back as the ORM would give them
(model instances with their `select_related` rows and annotations, tuples, flat values or
dicts), through the compiler's own converters.

On PostgreSQL the SQL goes through `prepared_cursor`: its parameters are bound by the
server, so the text is the same whatever the values, and the server parses and plans it once
per connection. Elsewhere (the embedded SQLite default) the queryset is built and run as
usual, since values there are prepared per backend and that path is not the hot one.
"""

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import QuerySet
from django.db.models.query import (
    FlatValuesListIterable,
    ModelIterable,
    ValuesIterable,
    ValuesListIterable,
    get_related_populators,
)
from django.db.models.sql.compiler import SQLCompiler
from django.db.transaction import TransactionManagementError

# A marker per parameter kind: a value no caller passes, found among the compiled parameters.
_MARKERS: dict[type, Callable[[int], Any]] = {
    uuid.UUID: lambda index: uuid.UUID(int=(0x5EED << 112) | index),
    int: lambda index: 2_000_000_000 + index,
    str: lambda index: f"\x1fprepared-parameter-{index}",
    datetime: lambda index: datetime(1901, 2, 3, tzinfo=UTC) + timedelta(microseconds=index),
    date: lambda index: date(1901, 2, 3) + timedelta(days=index),
    # A PostgreSQL array: for `= ANY(%s)` in a RawSQL of the queryset.
    list: lambda index: [f"\x1fprepared-parameter-{index}"],
}


# Where a connection keeps its server-binding cursor: (driver connection, logged, cursor).
_KEPT_CURSOR = "_prepared_cursor"


@contextmanager
def prepared_cursor(connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
    """A cursor whose statements PostgreSQL prepares: parameters bound by the server (the ORM's
    cursors bind them into the text), so psycopg prepares a statement once it has run
    `prepare_threshold` times on the connection (DB_PREPARE_THRESHOLD) and the server skips
    parsing and planning it from then on. The ORM makes it, with the driver's cursor class
    switched for the one it uses under `server_side_binding`, and the connection keeps it
    for its next statement (a new one after a reconnect, when query logging is switched, or
    while it is in use). While queries are logged (DEBUG, a test counting them), nothing is
    prepared: Django logs a prepared statement without its SQL. Elsewhere, the usual cursor."""
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            yield cursor
        return
    connection.ensure_connection()
    driver = connection.connection
    kept = connection.__dict__.pop(_KEPT_CURSOR, None)
    if kept is None or kept[0] is not driver or kept[1] != connection.queries_logged:
        from django.db.backends.postgresql.base import ServerBindingCursor

        driver.prepare_threshold = (
            None
            if connection.queries_logged
            else connection.settings_dict["OPTIONS"].get("prepare_threshold", 5)
        )
        factory, driver.cursor_factory = driver.cursor_factory, ServerBindingCursor
        try:
            kept = (driver, connection.queries_logged, connection.cursor())
        finally:
            driver.cursor_factory = factory
    try:
        yield kept[2]
    except BaseException:
        kept[2].close()
        raise
    connection.__dict__[_KEPT_CURSOR] = kept


def _coerce(kind: type, value: Any) -> Any:
    """The value as the kind the SQL was compiled for (a run id may come as a string)."""
    if isinstance(value, kind):
        return value
    return uuid.UUID(str(value)) if kind is uuid.UUID else kind(value)


@dataclass(frozen=True)
class _Plan:
    sql: str
    # For each SQL parameter: the caller's parameter name, or None and a constant.
    slots: tuple[tuple[str | None, Any], ...]
    compiler: SQLCompiler
    # The compiler's converters of the selected columns, found once.
    converters: dict
    iterable: type
    locks: bool
    # Values: the names of the columns. Instances: their fields' slice of the row, the
    # attribute names, and what fills the `select_related` rows.
    names: tuple[str, ...] = ()
    fields: slice | None = None
    attnames: tuple[str, ...] = ()
    populators: tuple = ()
    # Instances: each annotation's attribute name and column.
    annotations: tuple[tuple[str, int], ...] = ()


class PreparedQuery:
    """A read query whose SQL is compiled once: `build(**markers)` returns the queryset,
    `parameters` name the kind (`uuid.UUID`, `int`, `str`, `datetime`, `date`, `list`) of
    each. Each argument must reach the SQL as a parameter unchanged (an equality or a range
    lookup, not `__in` or a transform); the first use refuses a queryset where one does not."""

    def __init__(self, build: Callable[..., QuerySet], **parameters: type) -> None:
        unsupported = {name for name, kind in parameters.items() if kind not in _MARKERS}
        if unsupported:
            raise ImproperlyConfigured(f"No marker for parameters {sorted(unsupported)}.")
        self._build = build
        self._parameters = parameters
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()

    def __call__(self, using: str = DEFAULT_DB_ALIAS, **values: Any) -> list:
        connection = connections[using]
        if connection.vendor != "postgresql":
            return list(self._build(**values).using(using))
        plan = self._plans.get(using) or self._plan(using)
        if plan.locks and connection.get_autocommit():
            raise TransactionManagementError(
                "select_for_update cannot be used outside of a transaction."
            )
        coerced = {name: _coerce(kind, values[name]) for name, kind in self._parameters.items()}
        params = [coerced[name] if name else constant for name, constant in plan.slots]
        with prepared_cursor(connection) as cursor:
            cursor.execute(plan.sql, params)
            rows = cursor.fetchall()
        if plan.compiler.has_extra_select:
            rows = [row[: plan.compiler.col_count] for row in rows]
        return self._objects(plan, using, rows)

    def first(self, using: str = DEFAULT_DB_ALIAS, **values: Any) -> Any:
        """The first row, or None: for a queryset sliced to one row."""
        found = self(using, **values)
        return found[0] if found else None

    def _plan(self, using: str) -> _Plan:
        with self._lock:
            if using in self._plans:
                return self._plans[using]
            markers = {
                name: _MARKERS[kind](index)
                for index, (name, kind) in enumerate(self._parameters.items())
            }
            queryset = self._build(**markers).using(using)
            if queryset._iterable_class not in (
                ModelIterable,
                ValuesListIterable,
                FlatValuesListIterable,
                ValuesIterable,
            ):
                raise ImproperlyConfigured(f"Cannot prepare {queryset._iterable_class.__name__}.")
            compiler = queryset.query.get_compiler(using=using)
            sql, params = compiler.as_sql()
            columns = [column[0] for column in compiler.select[: compiler.col_count]]
            if compiler.has_composite_fields(columns):
                raise ImproperlyConfigured("Cannot prepare a query of composite fields.")
            slots = []
            for param in params:
                name = next(
                    (
                        name
                        for name, marker in markers.items()
                        if type(param) is type(marker) and param == marker
                    ),
                    None,
                )
                slots.append((name, None if name else param))
            missing = set(markers) - {name for name, _ in slots}
            if missing:
                raise ImproperlyConfigured(
                    f"Parameters {sorted(missing)} do not reach the SQL unchanged: {sql}"
                )
            plan = _Plan(
                sql=sql,
                slots=tuple(slots),
                compiler=compiler,
                converters=compiler.get_converters(columns),
                iterable=queryset._iterable_class,
                locks=queryset.query.select_for_update,
                **self._shape(queryset, compiler, using),
            )
            self._plans[using] = plan
            return plan

    @staticmethod
    def _shape(queryset: QuerySet, compiler: SQLCompiler, using: str) -> dict:
        if queryset._iterable_class is not ModelIterable:
            query = queryset.query
            return {"names": (*query.extra_select, *query.values_select, *query.annotation_select)}
        if queryset._known_related_objects:
            raise ImproperlyConfigured("Cannot prepare instances with known related objects.")
        select, klass_info = compiler.select, compiler.klass_info
        start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
        return {
            "fields": slice(start, end),
            "attnames": tuple(column[0].target.attname for column in select[start:end]),
            "populators": tuple(get_related_populators(klass_info, select, using)),
            "annotations": tuple(compiler.annotation_col_map.items()),
        }

    @staticmethod
    def _objects(plan: _Plan, using: str, rows: list) -> list:
        converted = (
            map(tuple, plan.compiler.apply_converters(rows, plan.converters))
            if plan.converters
            else rows
        )
        if plan.iterable is FlatValuesListIterable:
            return [row[0] for row in converted]
        if plan.iterable is ValuesListIterable:
            return list(converted)
        if plan.iterable is ValuesIterable:
            return [dict(zip(plan.names, row, strict=True)) for row in converted]
        model = plan.compiler.klass_info["model"]
        objects = []
        for row in converted:
            instance = model.from_db(using, plan.attnames, row[plan.fields])
            for populator in plan.populators:
                populator.populate(row, instance)
            for name, column in plan.annotations:
                setattr(instance, name, row[column])
            objects.append(instance)
        return objects
