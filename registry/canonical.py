"""The one way a document is hashed: sha256 of its canonical JSON (RFC 8785), so the same
content gives the same hash whatever its key order. Capability snapshots, frozen Business
Action payloads, MCP tool definitions and evaluated skill content are hashed with it."""

import hashlib
from typing import Any

import rfc8785


def canonical_hash(document: Any) -> str:
    return hashlib.sha256(rfc8785.dumps(document)).hexdigest()
