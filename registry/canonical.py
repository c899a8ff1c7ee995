"""The one way a document is hashed: sha256 of its canonical JSON (RFC 8785), so the same
content gives the same hash whatever its key order. Capability snapshots, frozen Business
Action payloads, MCP tool definitions and evaluated skill content are hashed with it."""

import hashlib
from typing import Any

import rfc8785


def canonical_hash(document: Any) -> str:
    return hashlib.sha256(rfc8785.dumps(document)).hexdigest()


# The largest integer RFC 8785 hashes (an IEEE 754 double holds every integer up to it).
SAFE_INTEGER = 2**53 - 1


def _numbers(document: Any) -> list[float]:
    pending, found = [document], []
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, list):
            pending += value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.append(value)
    return found


def is_hashable(document: Any) -> bool:
    """Whether `document`, once stored, can be hashed. PostgreSQL keeps a JSON number as a
    decimal and gives 1e20 back as the whole number 100000000000000000000, which RFC 8785
    refuses as an integer past 2^53-1: a decimal that large is refused before it is stored."""
    try:
        rfc8785.dumps(document)
    except rfc8785.CanonicalizationError:
        return False
    return all(abs(number) <= SAFE_INTEGER for number in _numbers(document))
