"""Form fields the admin shares."""

import json
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from config.api import MAX_SAFE_INTEGER, json_problem

# An integer longer than Python reads from text (`sys.get_int_max_str_digits()`, 4,300 digits)
# is far outside what `json_problem` allows: it is said the same way, not with Python's words.
TOO_LONG_INTEGER = f"Integers must lie within ±{MAX_SAFE_INTEGER}."


class StrictJSONFormField(forms.JSONField):
    """A JSON field of an admin form that takes only what PostgreSQL stores and RFC 8785
    hashes (`config.api.json_problem`: no NaN or Infinity, no NUL, no unpaired surrogate,
    bounded nesting), and an empty value or JSON null as the model field's default (`empty`),
    not as a NULL its column refuses. A value shown back keeps its characters, and a surrogate no
    page can carry is shown escaped. Text that Python cannot read (nesting past its recursion
    limit, an integer of thousands of digits) is an invalid value shown as typed, never a
    server error."""

    def __init__(self, *, empty: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.empty = empty

    def to_python(self, value: Any) -> Any:
        if not self.disabled and value in self.empty_values:
            return self.empty
        try:
            converted = super().to_python(value)
        except RecursionError as error:
            raise ValidationError("Enter a valid JSON.", code="invalid") from error
        except ValueError as error:
            # Not a syntax error (Django's field says those): an integer too long to read.
            raise ValidationError(TOO_LONG_INTEGER, code="invalid") from error
        if self.disabled:
            return converted
        if problem := json_problem(converted):
            raise ValidationError(problem, code="invalid")
        return self.empty if converted is None else converted

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except (RecursionError, ValueError):
            return forms.fields.InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> str:
        prepared = super().prepare_value(value)
        try:
            prepared.encode()
        except UnicodeEncodeError:
            return json.dumps(value, cls=self.encoder)
        return prepared
