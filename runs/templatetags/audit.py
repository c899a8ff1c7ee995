import json
from typing import Any

from django import template

register = template.Library()


@register.filter
def pretty(value: Any) -> str:
    """Indented JSON for a <pre>; the template escapes it."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
