"""The OpenAPI generator of the API (a module of its own: drf-spectacular reads the API
settings, which name config.api).

What a request body may hold is stated as exactly as the schema language allows, so that a
client, and the API fuzzer, can tell a well-formed request from one the API refuses."""

from typing import Any

from drf_spectacular import openapi
from drf_spectacular.plumbing import append_meta, force_instance
from rest_framework import serializers

from config.api import DocumentField, StrictSerializer

# Text the API trims (str.strip) and refuses when nothing is left must hold a character that
# Python does not count as whitespace (ECMA's \S differs: it keeps \x1c-\x1f and \x85, drops
# \ufeff).
NOT_BLANK = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


class AutoSchema(openapi.AutoSchema):
    def _map_basic_serializer(self, serializer: Any, direction: str) -> dict:
        """In requests, strict serializers refuse any property beyond those listed, and
        required text must hold more than blanks."""
        schema = super()._map_basic_serializer(serializer, direction)
        if direction != "request":
            return schema
        serializer = force_instance(serializer)
        if isinstance(serializer, StrictSerializer):
            schema["additionalProperties"] = False
        for name, field in serializer.fields.items():
            field_schema = schema.get("properties", {}).get(name, {})
            if (
                type(field) is serializers.CharField
                and field.trim_whitespace
                and not field.allow_blank
                and "pattern" not in field_schema
            ):
                field_schema["pattern"] = NOT_BLANK
        return schema

    def _map_serializer_field(
        self, field: Any, direction: str, bypass_extensions: bool = False
    ) -> dict:
        """Documents carry their own JSON Schema."""
        if isinstance(field, DocumentField):
            return append_meta(
                dict(field.document_schema), self._get_serializer_field_meta(field, direction)
            )
        return super()._map_serializer_field(field, direction, bypass_extensions)
