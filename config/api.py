"""API plumbing shared by every app: the error body, strict JSON parsing and serializers,
pagination."""

import codecs
import json
import logging
import math
import re
from collections import Counter
from typing import Any, ClassVar

import django_filters
import redis
from django import forms
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from django.utils.http import parse_header_parameters
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import exceptions, serializers, status
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.pagination import PageNumberPagination
from rest_framework.parsers import JSONParser
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.settings import api_settings

from config.errors import ApplicationError, ValidationFailed

logger = logging.getLogger(__name__)

# Seconds a client is told to wait when a service the API depends on (Redis) is down.
SERVICE_UNAVAILABLE_RETRY_AFTER = 5

_DRF_CODES: list[tuple[type[exceptions.APIException], str]] = [
    (exceptions.ValidationError, "VALIDATION_ERROR"),
    (exceptions.ParseError, "VALIDATION_ERROR"),
    (exceptions.NotAuthenticated, "AUTHENTICATION_REQUIRED"),
    (exceptions.AuthenticationFailed, "AUTHENTICATION_REQUIRED"),
    (exceptions.PermissionDenied, "PERMISSION_DENIED"),
    (exceptions.NotFound, "NOT_FOUND"),
    (exceptions.MethodNotAllowed, "METHOD_NOT_ALLOWED"),
    (exceptions.NotAcceptable, "NOT_ACCEPTABLE"),
    (exceptions.UnsupportedMediaType, "UNSUPPORTED_MEDIA_TYPE"),
    (exceptions.Throttled, "RATE_LIMITED"),
]


# A qvalue of zero (RFC 9110 §12.4.2): "0", "0.", "0.0" … "0.000".
NO_QUALITY = re.compile(r"0(\.0{0,3})?")


def _media_range(token: str) -> tuple[str, dict[str, str]]:
    """The type/subtype of one range of Accept, lower-cased, and its parameters; a range
    Django cannot parse matches nothing."""
    try:
        media_type, parameters = parse_header_parameters(token)
    except ValueError:
        return "", {}
    return media_type.lower(), parameters


def _is_refusal(parameters: dict[str, str]) -> bool:
    return NO_QUALITY.fullmatch(parameters.get("q", "").strip()) is not None


class ContentNegotiation(DefaultContentNegotiation):
    """A `?format=` the endpoint does not serve is not acceptable (406), as the same format
    asked for by `Accept` is: DRF answers 404, which says the resource is missing. A body
    whose Content-Type is a wildcard (`*/*`, `application/*`, `multipart/*`), which only
    `Accept` may hold, is of no type the endpoint reads (415): DRF matched it to any parser,
    and read such a body as JSON or an upload. A range of `Accept` with a q of 0 says what is
    not acceptable (RFC 9110 §12.5.1), where DRF served what it names as if asked for it:
    `*/*;q=0` alone is a 406, while `application/json, */*;q=0` is still JSON. A Content-Type
    longer than DRF reads (256 characters) of a type the endpoint does read is malformed (400),
    where DRF called a long multipart boundary an unsupported media type (415)."""

    def select_parser(self, request: Any, parsers: list) -> Any:
        content_type = request.content_type or ""
        media_type = parse_header_parameters(content_type)[0]
        if "*" in media_type:
            return None
        if len(content_type) > self.max_media_type_length and any(
            parser.media_type == media_type for parser in parsers
        ):
            raise exceptions.ParseError(
                f"The Content-Type header is longer than {self.max_media_type_length} characters."
            )
        return super().select_parser(request, parsers)

    def get_accept_list(self, request: Any) -> list[str]:
        """The ranges of `Accept` that ask for something: DRF would answer in a range refused
        with q=0 (its parameters too) as readily as in one asked for."""
        return [
            token
            for token in super().get_accept_list(request)
            if not _is_refusal(_media_range(token)[1])
        ]

    def select_renderer(self, request: Any, renderers: list, format_suffix: Any = None) -> Any:
        """As DRF's, among the renderers whose type the client has not refused: one whose most
        specific matching range without parameters but q (`application/json` over
        `application/*` over `*/*`) has q=0."""
        ranges = [_media_range(token) for token in super().get_accept_list(request)]
        acceptable = [
            renderer for renderer in renderers if not self._is_refused(renderer.media_type, ranges)
        ]
        if not acceptable:
            raise exceptions.NotAcceptable(available_renderers=renderers)
        return super().select_renderer(request, acceptable, format_suffix)

    @staticmethod
    def _is_refused(media_type: str, ranges: list[tuple[str, dict[str, str]]]) -> bool:
        main_type, _, sub_type = media_type.lower().partition("/")
        matching = [
            (range_type.count("*"), parameters)
            for range_type, parameters in ranges
            if set(parameters) <= {"q"}
            and range_type in ("*/*", f"{main_type}/*", f"{main_type}/{sub_type}")
        ]
        if not matching:
            return False
        return _is_refusal(min(matching, key=lambda match: match[0])[1])

    def filter_renderers(self, renderers: list, format: str) -> list:
        """The renderers of `format`; refused naming the formats served, not the one asked
        for, which may be kilobytes long."""
        served = [renderer for renderer in renderers if renderer.format == format]
        if not served:
            formats = " or ".join(dict.fromkeys(renderer.format for renderer in renderers))
            raise exceptions.NotAcceptable(f"Only {formats} is served here.")
        return served


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _message_and_details(exc: exceptions.APIException) -> tuple[str, dict[str, Any]]:
    detail = exc.detail
    if isinstance(detail, dict):
        return "The request is not valid.", detail
    if isinstance(detail, list):
        return "The request is not valid.", {"non_field_errors": detail}
    return str(detail), {}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every error as {"error": {"code", "message", "details"}}, always as JSON, even
    where the client negotiated another format (an event stream)."""
    request = context.get("request")
    if request is not None and not isinstance(
        getattr(request, "accepted_renderer", None), JSONRenderer
    ):
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    if isinstance(exc, ApplicationError):
        return Response(error_body(exc.code, exc.message, exc.details), status=exc.http_status)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, RequestDataTooBig):
        return Response(
            error_body("PAYLOAD_TOO_LARGE", "The request body is too large."),
            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
        )
    elif isinstance(exc, redis.RedisError):
        # Rate limits and tool limits cannot be checked: refused, never let through unlimited.
        logger.warning("Redis is unavailable: %s", type(exc).__name__)
        return Response(
            error_body("SERVICE_UNAVAILABLE", "The service is unavailable; retry shortly."),
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": str(SERVICE_UNAVAILABLE_RETRY_AFTER)},
        )
    if not isinstance(exc, exceptions.APIException):
        return None
    code = next(
        (code for kind, code in _DRF_CODES if isinstance(exc, kind)),
        str(exc.default_code).upper(),
    )
    message, details = _message_and_details(exc)
    headers = {}
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        headers["Retry-After"] = str(math.ceil(exc.wait))
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        headers["WWW-Authenticate"] = "Token"
        exc.status_code = status.HTTP_401_UNAUTHORIZED
    return Response(error_body(code, message, details), status=exc.status_code, headers=headers)


MAX_JSON_DEPTH = 32
MAX_SAFE_INTEGER = 2**53 - 1


def string_problem(value: str) -> str | None:
    if "\x00" in value:
        return "NUL characters are not allowed."
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON lets "\ud800" stand alone; no UTF-8 text (PostgreSQL's, RFC 8785's) holds it.
        return "Strings must be valid Unicode (no unpaired surrogates)."
    return None


def json_problem(value: Any, depth: int = 0) -> str | None:
    """Why a parsed body cannot be stored or canonically hashed: nesting too deep, a NUL
    character or an unpaired surrogate in a key or a value, or a number outside what an
    IEEE 754 double holds exactly (RFC 8785)."""
    if depth > MAX_JSON_DEPTH:
        return f"JSON nested deeper than {MAX_JSON_DEPTH} levels."
    if isinstance(value, str):
        return string_problem(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) > MAX_SAFE_INTEGER:
        return f"Integers must lie within ±{MAX_SAFE_INTEGER}."
    if isinstance(value, float) and not math.isfinite(value):
        return "Numbers must be finite."
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((p for item in items if (p := json_problem(item, depth + 1))), None)


def _json_integer(literal: str) -> int:
    """An integer of a JSON body, refused before Python converts one too long for it (whose
    error would name an interpreter setting)."""
    if len(literal.lstrip("-")) > len(str(MAX_SAFE_INTEGER)):
        raise ValueError(f"Integers must lie within ±{MAX_SAFE_INTEGER}.")
    return int(literal)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are each given once: of `{"decision": "approve", "decision":
    "reject"}` a parser keeps the last and another the first, so the body means nothing sure."""
    data = dict(pairs)
    if len(data) < len(pairs):
        counts = Counter(name for name, _ in pairs)
        twice = sorted(name for name, count in counts.items() if count > 1)
        raise ValueError(f"Names given more than once in an object: {', '.join(twice)}.")
    return data


def _is_utf_8(charset: str) -> bool:
    try:
        return codecs.lookup(charset).name == "utf-8"
    except (LookupError, ValueError):
        return False


def refuse_charset_other_than_utf_8(media_type: str | None, what: str) -> None:
    """Refuse (415) a body whose Content-Type declares a charset other than UTF-8, under
    any of its names, saying `what` is UTF-8: the body is read as UTF-8, and read in the
    charset it declares its text would come out garbled."""
    charset = parse_header_parameters(media_type or "")[1].get("charset")
    if charset is not None and not _is_utf_8(charset):
        raise exceptions.UnsupportedMediaType(
            media_type, detail=f'{what}: charset "{charset}" is not supported.'
        )


# The json module's words that speak of Python rather than of the body.
_SYNTAX_ERRORS = {
    "Extra data": "Data after the JSON value",
    # Only once the one mark a body may start with is dropped (`_json_text`).
    "Unexpected UTF-8 BOM (decode using utf-8-sig)": (
        "The body starts with more than one byte order mark"
    ),
}


def _json_text(body: bytes) -> str:
    """The text of a JSON body, without the byte order mark it may start with (RFC 8259
    §8.1 lets a parser ignore it; Notepad and PowerShell write one). Bytes that are not
    UTF-8 are named by their offset in the body, not by Python's codec."""
    start = len(codecs.BOM_UTF8) if body.startswith(codecs.BOM_UTF8) else 0
    try:
        return body[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        byte = f"the byte at offset {offset} (0x{body[offset]:02X})"
        raise ValueError(f"JSON is UTF-8 (RFC 8259): {byte} is not.") from error


class StrictJSONParser(JSONParser):
    """JSON bodies PostgreSQL can store: UTF-8 text without NUL characters, bounded nesting,
    each name of an object given once."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        """As DRF's JSON parser, integers read by `_json_integer`, objects by `_json_object`,
        the text by `_json_text`. JSON is UTF-8 (RFC 8259): a body declared in another charset
        is refused (415), where DRF decodes it in that charset (Latin-1 turned "café" into
        "cafÃ©") or, for a charset Django does not know, as UTF-8 anyway. NaN and Infinity,
        which DRF refused naming Python's floats, are refused as numbers out of range are."""
        refuse_charset_other_than_utf_8(media_type, "JSON is UTF-8 (RFC 8259)")
        try:
            data = json.loads(
                _json_text(stream.read()),
                parse_constant=float,
                parse_int=_json_integer,
                object_pairs_hook=_json_object,
            )
        except json.JSONDecodeError as error:
            message = _SYNTAX_ERRORS.get(error.msg, error.msg)
            # Where the body starts, a line and column would add nothing.
            if error.pos:
                message = f"{message}: line {error.lineno} column {error.colno}"
            raise exceptions.ParseError(f"JSON parse error - {message}.") from error
        except ValueError as error:
            raise exceptions.ParseError(f"JSON parse error - {error}") from error
        except RecursionError as error:
            raise exceptions.ParseError(
                f"JSON nested deeper than {MAX_JSON_DEPTH} levels."
            ) from error
        problem = json_problem(data)
        if problem:
            raise exceptions.ParseError(problem)
        return data


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, so a typo is an error rather than silently ignored."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["Unknown field."] for name in unknown})
        return super().to_internal_value(data)


class CommandSerializer(StrictSerializer):
    """The body of a command that takes no fields: empty, or {}."""


# A viewset whose OPTIONS describes, for each method that takes a body, the serializer that
# reads it, rather than the output serializer (whose fields are read-only). A comment, not a
# docstring: the API schema would show a docstring as the description of a viewset without one.
class BodiesDescribed:
    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        """What each POST reads as its body, by action."""
        return {}

    def body_described(self) -> type[serializers.Serializer] | None:
        """The body OPTIONS describes for the method asked about: DRF asks with the request
        cloned to that method and the action left as "metadata"."""
        if self.action != "metadata":
            return None
        return self.body_serializers().get(self.action_map.get(self.request.method.lower()))

    def get_serializer_class(self) -> type[serializers.Serializer]:
        return self.body_described() or super().get_serializer_class()


# An APIView whose OPTIONS describes the body its POST reads: DRF describes what the view's
# get_serializer gives, which a plain APIView lacks. A comment, not a docstring, as above.
class BodyDescribed:
    body_serializer: ClassVar[type[serializers.Serializer]]

    def get_serializer(self, *args: Any, **kwargs: Any) -> serializers.Serializer:
        """The serializer that reads the POST's body."""
        return self.body_serializer(*args, **kwargs)


class _JSONString:
    """A field that takes a JSON string only, where DRF's also takes a number and reads its
    str() (a UUID from an integer, a name from 5)."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(_JSONString, serializers.CharField):
    """A JSON string only."""


class StrictSlugField(_JSONString, serializers.SlugField):
    """A slug written as a JSON string only."""


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: DRF's IntegerField also reads "30", 30.0 and "30.0" as 30."""

    def to_internal_value(self, data: Any) -> int:
        if type(data) is not int:
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """A JSON true or false only: DRF's BooleanField also takes 1, "yes" or "on"."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictUUIDField(_JSONString, serializers.UUIDField):
    """A UUID written as a JSON string only."""


class DocumentField(serializers.JSONField):
    """A JSON document with a contract of its own (a JSON Schema), which the API schema shows;
    the service that stores the document enforces it."""

    def __init__(self, *, document_schema: dict[str, Any], **kwargs: Any) -> None:
        self.document_schema = document_schema
        super().__init__(**kwargs)


class FilterSet(django_filters.FilterSet):
    """Refuses a filter of choices, instants or ids given empty (`?status=`), or blanks alone,
    which an id's field strips to nothing (`?session=%20`): a value none of them can hold,
    which would otherwise filter nothing; leave the parameter out instead. A
    filter of one value given several times (`?status=pending&status=approved`) is refused
    too, rather than filtered by its last value alone; a filter of several choices takes each.
    A range whose lower bound is above its upper one (`?created_after=` a day later than
    `?created_before=`) is refused naming both, rather than answered with an empty list as
    if nothing were in it; equal bounds are a range. A value none of a filter's choices is
    is refused naming the choices, not echoing the value, which may be kilobytes long."""

    def get_form_class(self) -> type[forms.Form]:
        form_class = super().get_form_class()
        for field in form_class.base_fields.values():
            if isinstance(field, forms.ChoiceField):
                choices = ", ".join(str(value) for value, _ in field.choices if value != "")
                field.error_messages["invalid_choice"] = f"Not one of the choices: {choices}."
        return form_class

    def is_valid(self) -> bool:
        valid = super().is_valid()
        refused = {}
        for name, declared in self.filters.items():
            if name not in self.data or name in self.form.errors:
                continue
            values = self.data.getlist(name)
            if not isinstance(declared, django_filters.CharFilter) and not any(
                value.strip() for value in values
            ):
                refused[name] = "Give a value, or leave the parameter out."
            elif not isinstance(declared, django_filters.MultipleChoiceFilter) and len(values) > 1:
                refused[name] = "Give one value."
        if valid and not refused:
            refused = self._reversed_ranges()
        for name, message in refused.items():
            self.form.add_error(name, message)
        return valid and not refused

    def _reversed_ranges(self) -> dict[str, str]:
        """Both bounds of each range given the wrong way round, once each value is one its
        filter can hold: a filter of a field's lower bound (gt, gte) whose value is above
        that of a filter of its upper bound (lt, lte)."""
        values = self.form.cleaned_data
        refused = {}
        for lower_name, lower in self.filters.items():
            for upper_name, upper in self.filters.items():
                if (
                    lower.lookup_expr in ("gt", "gte")
                    and upper.lookup_expr in ("lt", "lte")
                    and lower.field_name == upper.field_name
                    and values.get(lower_name) is not None
                    and values.get(upper_name) is not None
                    and values[lower_name] > values[upper_name]
                ):
                    message = f"{lower_name} must not be after {upper_name}."
                    refused[lower_name] = refused[upper_name] = message
        return refused


class FilterBackend(DjangoFilterBackend):
    """A viewset's filters narrow its list only. DRF also applies them to the lookup of one
    object and to its actions: `runs/{id}/events?status=COMPLETED` answered 404 "No such run"
    for a run still running, and the schema listed the run filters as parameters of the
    events, which they never filtered."""

    def get_filterset_class(self, view: Any, queryset: Any = None) -> Any:
        if getattr(view, "action", None) != "list":
            return None
        return super().get_filterset_class(view, queryset)

    def filter_queryset(self, request: Any, queryset: Any, view: Any) -> Any:
        """A list refuses a parameter it does not take, rather than ignoring it: a misspelt
        filter (`?stauts=`) or one of another list (`/skills?risk=`) answered every row as
        if it had been applied. Each is named in the details, cut to its first characters."""
        filterset_class = self.get_filterset_class(view, queryset)
        if filterset_class is not None:
            paginator = getattr(view, "paginator", None)
            known = [
                *filterset_class.base_filters,
                *(
                    [paginator.page_query_param, paginator.page_size_query_param]
                    if paginator is not None
                    else []
                ),
                api_settings.URL_FORMAT_OVERRIDE,
            ]
            unknown = [name for name in request.query_params if name not in known]
            if unknown:
                raise ValidationFailed(
                    f"Unknown parameters. This list takes: {', '.join(known)}.",
                    details={_shortened(name): ["Unknown parameter."] for name in unknown},
                )
        return super().filter_queryset(request, queryset, view)


SHOWN_NAME_CHARACTERS = 64


def _shortened(name: str) -> str:
    """`name` as an error shows it: its first characters, marked as cut if there were more."""
    if len(name) <= SHOWN_NAME_CHARACTERS:
        return name
    return f"{name[:SHOWN_NAME_CHARACTERS]}…"


WHOLE_NUMBER = re.compile(r"[0-9]+")


def _whole_number(request: Any, name: str, refusal: str) -> str | None:
    """The digits (without leading zeros) of the one whole number from 1 given as the query
    parameter `name`; None when it is not given. Anything else is refused with `refusal`,
    rather than silently replaced by a default."""
    values = request.query_params.getlist(name)
    if not values:
        return None
    single = values[0] if len(values) == 1 else ""
    digits = single.lstrip("0") if WHOLE_NUMBER.fullmatch(single) else ""
    if not digits:
        raise exceptions.ValidationError({name: [refusal]})
    return digits


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200

    def get_page_size(self, request: Any) -> int:
        """The page size asked for, at most `max_page_size`."""
        digits = _whole_number(
            request,
            self.page_size_query_param,
            f"One whole number from 1 (pages hold at most {self.max_page_size}).",
        )
        if digits is None:
            return self.page_size
        # More digits than the largest page has is more than it holds (and int() refuses the
        # longest numbers).
        if len(digits) > len(str(self.max_page_size)):
            return self.max_page_size
        return min(int(digits), self.max_page_size)

    def get_page_number(self, request: Any, paginator: Any) -> str:
        """The page asked for; a page past the last is not found (404)."""
        return _whole_number(request, self.page_query_param, "One whole number from 1.") or "1"

    def get_schema_operation_parameters(self, view: Any) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_query_param:
                parameter["schema"]["minimum"] = 1
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"]["minimum"] = 1
                parameter["description"] = (
                    f"Results per page ({self.page_size} by default, at most {self.max_page_size})."
                )
        return parameters


ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "example": "VALIDATION_ERROR"},
                "message": {"type": "string"},
                "details": {"type": "object", "additionalProperties": True},
            },
            "required": ["code", "message", "details"],
        }
    },
    "required": ["error"],
}


RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}


def add_error_responses(result: dict, generator: Any, request: Any, public: bool) -> dict:
    """drf-spectacular hook: document the one error body on every operation, and on those a
    rate limits (whose count Redis keeps) the 429 and 503 that tell the client, in
    Retry-After, when to try again: a client sees only the headers the schema names."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    rate_limited = {
        (path, method.lower())
        for path, _, method, callback in generator.endpoints
        if getattr(callback.cls, "throttle_classes", None)
    }
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses["4XX"] = {
                "description": "Refused: the error body names the code.",
                "content": reference,
            }
            if (path, method) in rate_limited:
                responses["429"] = {
                    "description": "RATE_LIMITED: too many requests for now.",
                    "headers": RETRY_AFTER,
                    "content": reference,
                }
                responses["503"] = {
                    "description": "SERVICE_UNAVAILABLE: the rate cannot be checked for now.",
                    "headers": RETRY_AFTER,
                    "content": reference,
                }
    return result
