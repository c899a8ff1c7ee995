import json
from typing import Any

from django import template

from config import jsontext
from registry.mcp.review import visible

register = template.Library()

# A text of the run with its hidden characters spelled out as <U+XXXX>: raw, a right-to-left
# override or a zero-width character would show the auditor other text than the run holds.
register.filter("visible", visible)


@register.filter
def pretty(value: Any) -> str:
    """Indented JSON for a <pre>, its hidden characters spelled out (`visible`); the
    template escapes it."""
    return json.dumps(
        jsontext.strings_mapped(value, visible),
        indent=2,
        ensure_ascii=False,
        sort_keys=True,
        default=str,
    )
