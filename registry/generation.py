"""What runs resolve from the registry again and again (the ingress's agent and capability
snapshot, a worker's model config), kept in the process while the registry's generation
(`RegistryGeneration`) stays the one it was resolved under.

A caller reads the generation in a statement of its own request, then asks for a value under
it: one resolved under the same generation is given back, anything else is resolved again.
A value resolved under generation G reflects the registry as of G or later, never earlier,
and is asked for only by requests that read G, that is before the next change was visible
to them; so a request gets what it would have resolved itself a moment before or after,
which a request racing a change could get anyway. Without a generation (another database
than PostgreSQL, no change committed since the tables were emptied, or a transaction that
changed the registry itself) nothing is kept."""

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import BigIntegerField, Value
from django.db.models.expressions import RawSQL

T = TypeVar("T")

# Distinct keys kept under one generation: agents, and snapshots per (agent, actor, roles) of a
# few kilobytes each; past this many, all are dropped and resolved again.
KEPT = 1024


def generation_sql(using: str = DEFAULT_DB_ALIAS) -> RawSQL | Value:
    """The registry's generation as a column of a query: NULL where there is none (another
    database than PostgreSQL), and in a transaction that changed the registry itself (it sees
    what is not committed)."""
    if connections[using].vendor != "postgresql":
        return Value(None, output_field=BigIntegerField())
    return RawSQL(
        "SELECT value FROM registry_registrygeneration WHERE id = 1 "
        "AND current_setting('registry.changed', true) IS DISTINCT FROM 'on'",
        (),
        output_field=BigIntegerField(),
    )


_lock = threading.Lock()
_generation: tuple | None = None
_values: dict[Hashable, object] = {}
_MISSING = object()


def registry_cached(
    generation: int | None, key: Hashable, resolve: Callable[[], T], using: str = DEFAULT_DB_ALIAS
) -> T:
    """`resolve()`, or what it returned for `key` under the same generation of this database.
    What it returns is shared: the caller must not change it."""
    global _generation, _values
    if generation is None:
        return resolve()
    current = (connections[using].settings_dict["NAME"], generation)
    with _lock:
        value = _values.get(key, _MISSING) if _generation == current else _MISSING
    if value is not _MISSING:
        return value  # type: ignore[return-value]
    value = resolve()
    with _lock:
        if _generation != current:
            _generation, _values = current, {}
        elif len(_values) >= KEPT:
            _values.clear()
        _values[key] = value
    return value
