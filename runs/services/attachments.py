"""Attachments: an upload checked (size, media type shown by its content, sha256) and kept in
private storage; the message parts that refer to one, bound to it by id and digest only; and
the sweep of stored files no row names."""

import codecs
import hashlib
import json
import logging
import os
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

import filetype
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.core.files import File
from django.core.files.storage import Storage
from django.db import models, transaction
from django.utils import timezone

from registry.choices import Action
from registry.models import Tenant
from registry.selectors import user_can
from runs.errors import PayloadTooLarge, PermissionDenied, UnsupportedMediaType, ValidationFailed
from runs.models import Attachment
from runs.models.attachments import attachment_path
from runs.selectors import attachments_usable
from runs.services.excerpts import repeats_refused
from runs.storage import attachment_storage

logger = logging.getLogger(__name__)

# Types recognised by their content being UTF-8 text without NUL (JSON must also parse);
# every other allowed type is recognised by its magic bytes.
TEXT_MEDIA_TYPES = frozenset({"text/plain", "text/csv", "application/json"})
TEXT = "text/plain"
# Other names clients send for CSV: a browser on Windows with Excel installed labels a .csv
# application/vnd.ms-excel. An upload under one of them is taken as text/csv, and its content
# must show that as any CSV's does (an Excel workbook is no UTF-8 text and stays refused).
CSV_ALIASES = frozenset(
    {
        "application/csv",
        "application/x-csv",
        "application/vnd.ms-excel",
        "text/comma-separated-values",
        "text/x-comma-separated-values",
        "text/x-csv",
    }
)
# The message part that refers to an attachment.
ATTACHMENT_PART = "attachment_ref"
UNKNOWN = "application/octet-stream"
SIGNATURE_BYTES = 8192  # as many leading bytes as `filetype` looks at
MAX_EXTENSION_CHARS = 16
# Stored names whose rows one query of the orphan sweep looks up, at most.
ORPHAN_SWEEP_BATCH = 1000


@dataclass(frozen=True)
class Inspection:
    size: int
    sha256: str
    detected_media_type: str


def _detected_media_type(head: bytes, *, is_text: bool) -> str:
    """What the content shows. Magic bytes decide, except that text which merely starts like a
    type we do not accept ("BM…" looks like a bitmap) stays text."""
    kind = filetype.guess(head)
    if kind is not None and (not is_text or kind.mime in settings.ATTACHMENT_MEDIA_TYPES):
        return kind.mime
    return TEXT if is_text else UNKNOWN


def _decodes(decoder: codecs.IncrementalDecoder, chunk: bytes, *, final: bool = False) -> bool:
    try:
        decoder.decode(chunk, final=final)
    except UnicodeDecodeError:
        return False
    return True


def _inspect(upload: File) -> Inspection:
    """One pass over the upload's chunks: its size (stopping once past ATTACHMENT_MAX_BYTES),
    sha256, leading bytes for magic detection, and whether it is UTF-8 text without NUL."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    head = b""
    size = 0
    is_text = True
    for chunk in upload.chunks():
        size += len(chunk)
        if size > settings.ATTACHMENT_MAX_BYTES:
            raise PayloadTooLarge(
                "The file is too large.", details={"max_bytes": settings.ATTACHMENT_MAX_BYTES}
            )
        digest.update(chunk)
        head += chunk[: SIGNATURE_BYTES - len(head)]
        is_text = is_text and b"\x00" not in chunk and _decodes(decoder, chunk)
    is_text = is_text and _decodes(decoder, b"", final=True)
    return Inspection(
        size=size,
        sha256=digest.hexdigest(),
        detected_media_type=_detected_media_type(head, is_text=is_text),
    )


def _not_json(constant: str) -> NoReturn:
    raise ValueError(f"{constant} is not a JSON value.")


def _is_json(upload: File) -> bool:
    """Whether the upload is JSON as RFC 8259 has it: Python's parser also reads NaN,
    Infinity and -Infinity, which JSON does not have and strict readers (a browser's
    JSON.parse, PostgreSQL's jsonb) refuse."""
    upload.seek(0)
    try:
        json.loads(upload.read(), parse_constant=_not_json)
    except (ValueError, RecursionError):
        return False
    return True


def _confirm_media_type(*, declared: str, sent: str, detected: str, upload: File) -> None:
    """The declared type (`sent` as the client named it) must be the one the content shows: a
    PNG sent as text/plain, or text sent as image/png, is refused like a type not allowed.
    Text in another encoding (a CSV Excel wrote in GBK or Latin-1, UTF-16) shows no type; its
    refusal says text must be UTF-8, which is what the uploader can change."""
    if declared in TEXT_MEDIA_TYPES and detected == UNKNOWN:
        raise UnsupportedMediaType(
            f"The content is not {declared}: text must be UTF-8, without NUL characters.",
            details={"declared": sent, "detected": detected, "required_encoding": "utf-8"},
        )
    if declared in TEXT_MEDIA_TYPES:
        is_shown = detected == TEXT and (declared != "application/json" or _is_json(upload))
    else:
        is_shown = detected == declared
    if not is_shown:
        raise UnsupportedMediaType(
            f"The content is not {declared}.",
            details={"declared": sent, "detected": detected},
        )


def attachment_display_name(name: str) -> str:
    """The uploader's file name as metadata to show: its last path segment, without control,
    format (bidirectional overrides, zero-width) or unassigned characters, bounded in length.
    It never becomes a storage path."""
    name = unicodedata.normalize("NFC", name).replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(char for char in name if unicodedata.category(char)[0] != "C").strip()
    limit = Attachment._meta.get_field("original_name").max_length
    if len(name) > limit:
        stem, extension = os.path.splitext(name)
        extension = extension[:MAX_EXTENSION_CHARS]
        name = stem[: limit - len(extension)] + extension
    return name or "attachment"


def attachment_store(
    *, actor: AbstractBaseUser, tenant: Tenant, upload: File, declared_media_type: str
) -> Attachment:
    """Keep an upload for the actor's messages in this tenant.

    Everything is checked before anything is written (allowed type, size, the content showing
    the declared type), so a refusal leaves no row and no file. A CSV sent under another name
    for CSV (`CSV_ALIASES`) is kept as text/csv. The file goes to the private
    "attachments" storage under the tenant and a fresh id; if the row then fails, the file is
    removed again.
    """
    if not user_can(user=actor, action=Action.RUN_CREATE, tenant=tenant):
        raise PermissionDenied("You may not upload attachments in this tenant.")
    sent = declared_media_type.split(";", 1)[0].strip().lower()
    declared = "text/csv" if sent in CSV_ALIASES else sent
    if declared not in settings.ATTACHMENT_MEDIA_TYPES:
        raise UnsupportedMediaType(
            "This media type is not accepted.",
            details={"declared": sent, "allowed": list(settings.ATTACHMENT_MEDIA_TYPES)},
        )
    inspection = _inspect(upload)
    if inspection.size == 0:
        raise ValidationFailed("The file is empty.", details={"file": ["The file is empty."]})
    _confirm_media_type(
        declared=declared, sent=sent, detected=inspection.detected_media_type, upload=upload
    )
    attachment = Attachment(
        tenant=tenant,
        uploaded_by=actor,
        original_name=attachment_display_name(upload.name or ""),
        media_type=declared,
        size=inspection.size,
        sha256=inspection.sha256,
    )
    attachment.file.save(attachment_path(attachment, ""), upload, save=False)
    try:
        with transaction.atomic():
            attachment.save(force_insert=True)
    except BaseException:
        attachment.file.delete(save=False)
        raise
    return attachment


def _part(attachment: Attachment) -> dict[str, Any]:
    """How a message carries an attachment: what it is and its digest, never its content."""
    return {
        "type": ATTACHMENT_PART,
        "id": str(attachment.pk),
        "media_type": attachment.media_type,
        "size": attachment.size,
        "sha256": attachment.sha256,
    }


def attachment_parts_resolve(
    *, actor: AbstractBaseUser, tenant: Tenant, parts: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The message parts with each attachment reference bound to the actor's own upload in
    this tenant. A reference to anything else (another tenant's or user's upload, an unknown
    id) is refused the same way, so it tells nothing about what exists. An attachment is
    referred to once: its run reads each reference in a share of the excerpt."""
    ids = [part["id"] for part in parts if part["type"] == ATTACHMENT_PART]
    if not ids:
        return parts
    repeats_refused(
        parts,
        part_type=ATTACHMENT_PART,
        key=lambda part: part["id"],
        named=("id",),
        noun="attachment",
    )
    usable = {
        str(attachment.pk): attachment
        for attachment in attachments_usable(user=actor, tenant=tenant).filter(pk__in=ids)
    }
    unknown = [
        {"index": index, "id": part["id"], "message": "No such attachment."}
        for index, part in enumerate(parts)
        if part["type"] == ATTACHMENT_PART and part["id"] not in usable
    ]
    if unknown:
        raise ValidationFailed(
            "A part refers to an attachment you cannot use.", details={"parts": unknown}
        )
    return [
        _part(usable[part["id"]]) if part["type"] == ATTACHMENT_PART else part for part in parts
    ]


def _is_written_as(field: models.Field, segment: str) -> bool:
    """Whether a path segment is a value of this field spelled as `attachment_path` spells it
    ("7", never "07"; a lowercase hyphenated UUID)."""
    try:
        return str(field.to_python(segment)) == segment
    except ValidationError:
        return False


def _orphans_remove(*, storage: Storage, directory: str, names: list[str], cutoff: datetime) -> int:
    """Remove the files among `directory/name` that no row names and that were last modified
    before `cutoff`. One query: a path is named after its row's own id (`attachment_path`),
    so the rows of these ids, found by primary key, are the only ones that may name them."""
    named = set(Attachment.objects.filter(pk__in=names).values_list("file", flat=True))
    removed = 0
    for path in (f"{directory}/{name}" for name in names):
        if path in named:
            continue
        try:
            is_old = storage.get_modified_time(path) < cutoff
        except FileNotFoundError:
            continue  # removed meanwhile (a sweep running beside this one)
        if is_old:
            storage.delete(path)
            removed += 1
    return removed


def attachment_orphans_remove() -> int:
    """Remove the files of the "attachments" storage that no Attachment row names and that are
    older than ATTACHMENT_ORPHAN_GRACE_SECONDS: the upload's process died between the file and
    the row, or a transaction around `attachment_store` rolled the row back. A younger file may
    belong to an upload in flight and is kept; so is anything not shaped `<tenant id>/<attachment
    id>` (another file put there, a name the storage changed), which no upload writes. Safe to
    run twice at once. Reads one tenant directory's names at a time and looks up their rows
    ORPHAN_SWEEP_BATCH at a time. Returns how many files it removed."""
    storage = attachment_storage()
    cutoff = timezone.now() - timedelta(seconds=settings.ATTACHMENT_ORPHAN_GRACE_SECONDS)
    tenant_id = Attachment._meta.get_field("tenant").target_field
    attachment_id = Attachment._meta.pk
    removed = 0
    try:
        directories, _files = storage.listdir("")
    except FileNotFoundError:
        return 0  # nothing was ever uploaded
    for directory in directories:
        if not _is_written_as(tenant_id, directory):
            continue
        _subdirectories, files = storage.listdir(directory)
        names = [name for name in files if _is_written_as(attachment_id, name)]
        for start in range(0, len(names), ORPHAN_SWEEP_BATCH):
            removed += _orphans_remove(
                storage=storage,
                directory=directory,
                names=names[start : start + ORPHAN_SWEEP_BATCH],
                cutoff=cutoff,
            )
    if removed:
        logger.info("Removed %d attachment files that no attachment names.", removed)
    return removed
