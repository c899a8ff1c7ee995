import uuid

from django.conf import settings
from django.db import models

from runs.storage import attachment_storage


def attachment_path(attachment: "Attachment", filename: str) -> str:
    """Stored under the tenant and the attachment's own id: the uploader's file name never
    becomes a path."""
    return f"{attachment.tenant_id}/{attachment.id}"


class Attachment(models.Model):
    """A file a user uploaded for their messages, kept in private storage (no URL serves it).

    Checked once on upload (allowed media type confirmed by its content, size, sha256) and
    never changed; a message refers to it by id, and its content is read lazily, never put
    into a model context whole.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="attachments"
    )
    uploaded_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="attachments"
    )
    original_name = models.CharField(
        max_length=255, help_text="The uploader's file name, sanitised; shown, never a path."
    )
    media_type = models.CharField(max_length=100)
    size = models.PositiveBigIntegerField(help_text="Bytes.")
    sha256 = models.CharField(max_length=64)
    file = models.FileField(storage=attachment_storage, upload_to=attachment_path, max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "uploaded_by", "-created_at"])]
        constraints = [
            models.CheckConstraint(condition=models.Q(size__gt=0), name="attachment_size_positive"),
            models.CheckConstraint(
                condition=models.Q(sha256__regex=r"^[0-9a-f]{64}$"), name="attachment_sha256_hex"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.original_name} ({self.media_type}, {self.size} bytes)"
