"""A message's attachments read when its run starts, never at ingress (seed 000: an
attachment's body is parsed lazily) and never into a model context whole.

Text, CSV and JSON are read as the UTF-8 they were confirmed to be on upload; a PDF gives the
text of its first pages; an image is not read. The message's readable attachments share
`ATTACHMENT_EXCERPT_MAX_BYTES` evenly, and the tokens the message's text leaves of what a
message may take of the context; each shows at most its share, marked as cut when there is
more. The stored file must still match the sha256 its message refers to. What is read
loses anything that looks like a credential, is kept as a Source the draft may cite (by
`attachment:<id>`) and reaches the model only inside an `untrusted_data` envelope. An
attachment that cannot be read leaves a note, not a failed run.
"""

import functools
import hashlib
import io
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import pypdf
from django.conf import settings
from django.utils import timezone
from pypdf import PageObject, PasswordType
from pypdf.errors import PdfReadError, PyPdfError
from pypdf.generic import ArrayObject, DictionaryObject, IndirectObject, NameObject, NullObject

from runs.context import wrap_untrusted
from runs.models import Attachment, Run, Source
from runs.models.tools import EVIDENCE_USE
from runs.services.attachments import ATTACHMENT_PART, TEXT_MEDIA_TYPES
from runs.services.excerpts import LONGEST_TIMESTAMP, NO_ROOM, fitted, head, within
from runs.tools.envelope import strip_secrets
from runs.tools.executor import known_rows_add

logger = logging.getLogger(__name__)

PDF = "application/pdf"
READABLE_MEDIA_TYPES = TEXT_MEDIA_TYPES | {PDF}
ORIGIN = "attachment"
# How much more than its share of an attachment is read, so that a credential its share
# would end inside is seen whole and removed before the cut.
SECRET_MARGIN_BYTES = 1024
# What a malformed PDF may raise from pypdf besides its own errors (a stream filter it does
# not implement raises NotImplementedError; a font's /FirstChar past any C int, OverflowError;
# an object said to lie in a stream that is no object stream fails one of its `assert`s; a
# catalog without a page tree, or one that is no dictionary, is used as one all the same).
PDF_FAULTS = (
    AssertionError,
    AttributeError,
    PyPdfError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    ArithmeticError,
    NotImplementedError,
    RecursionError,
    zlib.error,
)
# What any one stream of a PDF may decode to: interpreting it takes seconds a megabyte, before
# the deadline can be checked. pypdf's own limits (75 MB) would take minutes.
PDF_STREAM_MAX_BYTES = 2 * 1024 * 1024
PDF_STREAM_LIMITS = {
    "zlib_maximum_output_length": PDF_STREAM_MAX_BYTES,
    "lzw_maximum_output_length": PDF_STREAM_MAX_BYTES,
    "run_length_maximum_output_length": PDF_STREAM_MAX_BYTES,
    "array_based_stream_maximum_output_length": PDF_STREAM_MAX_BYTES,
}

# What a page takes from the nodes of its page tree above it when it has none of its own.
PDF_INHERITED = tuple(
    NameObject(name) for name in ("/Resources", "/MediaBox", "/CropBox", "/Rotate")
)


class Unreadable(Exception):
    """Why an attachment shows no content: said to the model in its place."""


class TextRead(NamedTuple):
    """The start of an attachment's text, whether there is more (`cut`), and how many bytes
    the whole text has: `size`, or at least that many when `size_is_minimum` (the text of a
    PDF's pages past those extracted is not known)."""

    text: str
    cut: bool
    size: int
    size_is_minimum: bool = False


def attachment_reference(attachment_id: str) -> str:
    return f"{ORIGIN}:{attachment_id}"


def _stored_bytes(attachment: Attachment, *, keep: int | None) -> tuple[bytes, bool]:
    """The file's first `keep` bytes (all of them for None), and whether there are more; the
    whole file is hashed on the way and must match the digest recorded on upload."""
    digest = hashlib.sha256()
    kept = bytearray()
    size = 0
    try:
        with attachment.file.open("rb") as stored:
            for chunk in stored.chunks():
                size += len(chunk)
                digest.update(chunk)
                kept += chunk if keep is None else chunk[: max(keep - len(kept), 0)]
    except OSError as error:
        logger.warning("Attachment %s could not be read: %s", attachment.pk, error)
        raise Unreadable("its file could not be read") from error
    if digest.hexdigest() != attachment.sha256:
        logger.warning("Attachment %s no longer matches its sha256: not read.", attachment.pk)
        raise Unreadable("its stored file no longer matches its sha256")
    return bytes(kept), size > len(kept)


def _text(attachment: Attachment, limit: int) -> TextRead:
    """The file's first `limit` bytes: its text, in the UTF-8 it was confirmed to be."""
    data, more = _stored_bytes(attachment, keep=limit + 1)
    text, cut = head(data, limit)
    return TextRead(text, cut or more, attachment.size)


def _in_time(deadline: float) -> Callable[..., None]:
    """What pypdf calls before each operation it interprets, forms included: past the
    deadline, the extraction stops."""

    def check(*_operation: Any) -> None:
        if time.monotonic() > deadline:
            raise Unreadable("its text takes too long to extract")

    return check


def _first_pages(
    reader: pypdf.PdfReader, count: int, in_time: Callable[..., None]
) -> list[PageObject]:
    """The PDF's first `count` pages (all of them when it has fewer), its page tree walked no
    further than they are and the deadline checked on every node: pypdf lists every page
    first (`reader.pages`), which a file of a few kilobytes whose tree names one page a
    hundred thousand times makes take seconds, before the deadline can be checked."""
    root = reader.root_object["/Pages"].get_object()
    if not isinstance(root, DictionaryObject):
        raise PdfReadError("The page tree is no dictionary.")
    pages: list[PageObject] = []
    pending: list[tuple[Any, dict[NameObject, Any], frozenset[int]]] = [(root, {}, frozenset())]
    while pending and len(pages) < count:
        in_time()
        entry, inherited, above = pending.pop()
        node = entry.get_object()
        # As pypdf reads a node: by its /Type, else a page when it has no /Kids; an entry of a
        # damaged tree that is no node is skipped.
        if not isinstance(node, DictionaryObject):
            continue
        kind = node.get("/Type", "/Pages" if "/Kids" in node else "/Page")
        if kind == "/Page":
            page = PageObject(reader, entry if isinstance(entry, IndirectObject) else None)
            page.update(node)
            page.update({name: value for name, value in inherited.items() if name not in node})
            pages.append(page)
            continue
        if kind != "/Pages":
            continue
        if id(node) in above:
            raise PdfReadError("The page tree has a cycle.")
        kids = node.get("/Kids", ArrayObject()).get_object()
        if isinstance(kids, NullObject):
            kids = ArrayObject()
        if not isinstance(kids, ArrayObject):
            raise PdfReadError("A page tree node's /Kids is no array.")
        inherited = {**inherited, **{name: node[name] for name in PDF_INHERITED if name in node}}
        above |= {id(node)}
        pending += [(kid, inherited, above) for kid in reversed(kids)]
    return pages


def _pdf_text(attachment: Attachment, limit: int) -> TextRead:
    """The text of the PDF's first pages, measured as extracted (never as the file's bytes,
    which compress it or hold far more than it), up to `limit` bytes of it and
    ATTACHMENT_PDF_MAX_PAGES pages, within ATTACHMENT_PDF_MAX_SECONDS: a stream that decodes
    past PDF_STREAM_MAX_BYTES is not interpreted, and the deadline is checked on every node
    of the page tree walked to the pages read and on every operation, so a small file that
    names a page thousands of times, or draws a large form thousands of times, stops in
    time."""
    data, _ = _stored_bytes(attachment, keep=None)
    in_time = _in_time(time.monotonic() + settings.ATTACHMENT_PDF_MAX_SECONDS)
    try:
        with pypdf.apply_configuration(**PDF_STREAM_LIMITS):
            reader = pypdf.PdfReader(io.BytesIO(data))
            # A PDF its owner only restricted (editing, printing) has an empty user password,
            # which opens it in any viewer; pypdf still calls it encrypted once open.
            if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
                raise Unreadable("the PDF is encrypted")
            # One page more than are read: whether there are more.
            first = _first_pages(reader, settings.ATTACHMENT_PDF_MAX_PAGES + 1, in_time)
            pages = len(first)
            read = b""
            shown = 0
            while shown < min(pages, settings.ATTACHMENT_PDF_MAX_PAGES) and len(read) <= limit:
                page = first[shown]
                read += (page.extract_text(visitor_operand_before=in_time) or "").strip().encode()
                read += b"\n\n"
                shown += 1
    except PDF_FAULTS as error:
        # The fault's type only: pypdf's messages quote the PDF's own dictionaries and names.
        logger.warning(
            "The text of attachment %s could not be extracted: %s",
            attachment.pk,
            type(error).__name__,
        )
        raise Unreadable("its text could not be extracted") from error
    extracted = read.rstrip()
    text, cut = head(extracted, limit)
    if not text.strip():
        where = " on its first pages" if pages > shown else ""
        raise Unreadable(f"it has no text to extract{where}")
    more_pages = pages > shown
    return TextRead(text, cut or more_pages, len(extracted), size_is_minimum=more_pages)


def attachment_line(part: dict[str, Any]) -> str:
    """How the message refers to an attachment, whether or not its content is shown."""
    return (
        f"[attachment {part['id']}: {part.get('media_type', '')}, "
        f"{part.get('size', '?')} bytes, sha256 {part.get('sha256', '')}]"
    )


def _wrapped(reference: str, fetched_at: str, content: str) -> str:
    return wrap_untrusted(
        source=reference,
        fetched_at=fetched_at,
        content=content,
        allowed_use=EVIDENCE_USE,
        references=[reference],
    )


def _shown(part: dict[str, Any], content: str) -> str:
    """How the user's message shows an excerpt of the attachment (at its longest timestamp)."""
    reference = attachment_reference(part["id"])
    return attachment_line(part) + "\n" + _wrapped(reference, LONGEST_TIMESTAMP, content)


def is_read(part: dict[str, Any]) -> bool:
    """Whether the run reads this part of its message as an attachment with text."""
    return part["type"] == ATTACHMENT_PART and part.get("media_type") in READABLE_MEDIA_TYPES


def _excerpt(attachment: Attachment, *, limit: int, fits: Callable[[str], bool]) -> str:
    """At most `limit` bytes of the attachment's text, and no more of it than `fits`, marked
    as cut when there is more."""
    reader = _pdf_text if attachment.media_type == PDF else _text
    read = reader(attachment, limit + SECRET_MARGIN_BYTES)
    # Credentials are removed before the cut: a token cut in half is no longer recognised.
    stripped = strip_secrets(read.text).encode()
    text, shortened = head(stripped, limit)
    # A text read whole is measured as it is shown, its credentials removed.
    size = len(stripped) if len(read.text.encode()) == read.size else read.size
    excerpt = fitted(
        text,
        cut=read.cut or shortened,
        size=size,
        fits=fits,
        at_least=read.size_is_minimum,
    )
    if excerpt is None:
        raise Unreadable(NO_ROOM)
    return excerpt


def attachments_read(run: Run, *, tokens: int) -> dict[str, str]:
    """Read the message's attachments; returns, by attachment id, what the model is shown of
    each after its reference: its wrapped excerpt, or why there is none. The readable
    attachments share ATTACHMENT_EXCERPT_MAX_BYTES, and each shows at most `tokens` of the
    context (`excerpts.tokens_each`)."""
    readable = [part for part in run.message.get("message", {}).get("parts", []) if is_read(part)]
    if not readable:
        return {}
    limit = settings.ATTACHMENT_EXCERPT_MAX_BYTES // len(readable)
    found = {
        str(attachment.pk): attachment
        for attachment in Attachment.objects.filter(
            tenant_id=run.tenant_id, pk__in=[part["id"] for part in readable]
        )
    }
    shown: dict[str, str] = {}
    for part in readable:
        attachment = found.get(part["id"])
        try:
            if attachment is None or attachment.sha256 != part["sha256"]:
                raise Unreadable("it is no longer stored")
            content = _excerpt(
                attachment, limit=limit, fits=within(tokens, functools.partial(_shown, part))
            )
        except Unreadable as reason:
            shown[part["id"]] = f"[not read: {reason}]"
            continue
        source = Source.objects.create(
            run=run,
            origin=ORIGIN,
            reference=attachment_reference(part["id"]),
            content_hash=hashlib.sha256(content.encode()).hexdigest(),
            allowed_use=EVIDENCE_USE,
            content=content,
        )
        known_rows_add(run, [source])
        shown[part["id"]] = _wrapped(
            source.reference, (source.fetched_at or timezone.now()).isoformat(), content
        )
    return shown
