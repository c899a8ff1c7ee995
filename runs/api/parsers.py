"""The upload's multipart parser: a file part is a file whatever its name."""

import re
from typing import Any

from django.http.multipartparser import MultiPartParser as DjangoMultiPartParser
from django.http.multipartparser import MultiPartParserError
from django.utils.http import parse_header_parameters
from rest_framework.exceptions import ParseError
from rest_framework.parsers import DataAndFiles, MultiPartParser, get_encoding

from config.api import refuse_charset_other_than_utf_8

UNNAMED = "attachment"
# RFC 2046 §5.1.1: 1-70 of these characters, the last not a space.
BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")


class _NamedFileParser(DjangoMultiPartParser):
    """Django drops a file part whose name sanitises to nothing ("..", "/", only control
    characters), as if no file had been sent; the name is only shown, so such a file is
    kept under a neutral one."""

    def sanitize_file_name(self, file_name: str) -> str:
        return super().sanitize_file_name(file_name) or UNNAMED


class UploadParser(MultiPartParser):
    """DRF's multipart parser, reading the body with `_NamedFileParser`. A body declared in
    a charset other than UTF-8 is refused (415), as a JSON body is: Django reads its field
    and file names in that charset, which turned "café.txt" into "cafÃ©.txt" under Latin-1
    and every field name into CJK characters under UTF-16. A boundary RFC 2046 does not
    allow (longer than 70 characters, or of other characters) is refused (400) without
    repeating it: Django took one of up to 201 printable characters and echoed any other
    one, however long, in its error."""

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: dict | None = None
    ) -> DataAndFiles:
        refuse_charset_other_than_utf_8(media_type, "Form fields and file names are UTF-8")
        boundary = parse_header_parameters(media_type or "")[1].get("boundary", "")
        if not BOUNDARY.fullmatch(boundary):
            raise ParseError(
                "Multipart form parse error - the boundary must be 1-70 letters, digits, spaces "
                "or '()+_,-./:=? characters, not ending in a space (RFC 2046)."
            )
        parser_context = parser_context or {}
        request = parser_context["request"]
        meta = request.META.copy()
        meta["CONTENT_TYPE"] = media_type
        try:
            parser = _NamedFileParser(
                meta, stream, request.upload_handlers, get_encoding(parser_context)
            )
            return DataAndFiles(*parser.parse())
        except MultiPartParserError as exc:
            raise ParseError(f"Multipart form parse error - {exc}") from exc
