"""Attachments: an upload checked (size, media type shown by its content, sha256) and kept in
private storage; and the message parts that refer to one, bound to it by id and digest only."""

import codecs
import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass
from typing import Any

import filetype
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.files import File
from django.db import transaction

from registry.choices import Action
from registry.models import Tenant
from registry.selectors import user_can
from runs.errors import PayloadTooLarge, PermissionDenied, UnsupportedMediaType, ValidationFailed
from runs.models import Attachment
from runs.models.attachments import attachment_path
from runs.selectors import attachments_usable

# Types recognised by their content being UTF-8 text without NUL (JSON must also parse);
# every other allowed type is recognised by its magic bytes.
TEXT_MEDIA_TYPES = frozenset({"text/plain", "text/csv", "application/json"})
TEXT = "text/plain"
UNKNOWN = "application/octet-stream"
SIGNATURE_BYTES = 8192  # as many leading bytes as `filetype` looks at
MAX_EXTENSION_CHARS = 16


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


def _is_json(upload: File) -> bool:
    upload.seek(0)
    try:
        json.loads(upload.read())
    except (ValueError, RecursionError):
        return False
    return True


def _confirm_media_type(*, declared: str, detected: str, upload: File) -> None:
    """The declared type must be the one the content shows: a PNG sent as text/plain, or text
    sent as image/png, is refused like a type not allowed."""
    if declared in TEXT_MEDIA_TYPES:
        is_shown = detected == TEXT and (declared != "application/json" or _is_json(upload))
    else:
        is_shown = detected == declared
    if not is_shown:
        raise UnsupportedMediaType(
            f"The content is not {declared}.",
            details={"declared": declared, "detected": detected},
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
    the declared type), so a refusal leaves no row and no file. The file goes to the private
    "attachments" storage under the tenant and a fresh id; if the row then fails, the file is
    removed again.
    """
    if not user_can(user=actor, action=Action.RUN_CREATE, tenant=tenant):
        raise PermissionDenied("You may not upload attachments in this tenant.")
    declared = declared_media_type.split(";", 1)[0].strip().lower()
    if declared not in settings.ATTACHMENT_MEDIA_TYPES:
        raise UnsupportedMediaType(
            "This media type is not accepted.",
            details={"declared": declared, "allowed": list(settings.ATTACHMENT_MEDIA_TYPES)},
        )
    inspection = _inspect(upload)
    if inspection.size == 0:
        raise ValidationFailed("The file is empty.", details={"file": ["The file is empty."]})
    _confirm_media_type(declared=declared, detected=inspection.detected_media_type, upload=upload)
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
        "type": "attachment_ref",
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
    id) is refused the same way, so it tells nothing about what exists."""
    ids = [part["id"] for part in parts if part["type"] == "attachment_ref"]
    if not ids:
        return parts
    usable = {
        str(attachment.pk): attachment
        for attachment in attachments_usable(user=actor, tenant=tenant).filter(pk__in=ids)
    }
    unknown = [
        {"index": index, "id": part["id"], "message": "No such attachment."}
        for index, part in enumerate(parts)
        if part["type"] == "attachment_ref" and part["id"] not in usable
    ]
    if unknown:
        raise ValidationFailed(
            "A part refers to an attachment you cannot use.", details={"parts": unknown}
        )
    return [
        _part(usable[part["id"]]) if part["type"] == "attachment_ref" else part for part in parts
    ]
