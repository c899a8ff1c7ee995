"""Identifiers of the rows the data plane writes most (runs, their events, spans, tool calls,
sources and sessions).

They are UUIDs of version 7 (RFC 9562): the time in milliseconds, then random bits (74 of
them, and a counter that keeps the ids one process makes in order). Rows written one after
another get ids that sort one after another, so a primary-key index grows at its right edge
instead of at a random page per row: after a checkpoint, PostgreSQL then logs few whole pages
where random ids made it log one per row. Measured with a million rows already in a table
shaped like the event log (`scripts/bench_ids.py`): about a sixth of the WAL per row. An id
tells when its row was made, as the row's own timestamps do, and is no easier to guess.
"""

import re
import uuid

from django.urls.converters import UUIDConverter
from uuid_utils.compat import uuid7

# The one spelling of an id a URL takes, the pages' (Django's `uuid` path converter) and the
# API's alike: lowercase and hyphenated, as ids are written out. `uuid.UUID` also reads
# uppercase, braces, a `urn:uuid:` prefix and no hyphens, which would give a row as many URLs,
# each its own key to caches, logs and ETags.
_ID_IN_URL = re.compile(UUIDConverter.regex)


def time_ordered_id() -> uuid.UUID:
    """A new version 7 UUID, of the standard library's type."""
    return uuid7()


def is_id_in_url(text: str) -> bool:
    """Whether `text` is an id as a URL spells it (`_ID_IN_URL`)."""
    return _ID_IN_URL.fullmatch(text) is not None
