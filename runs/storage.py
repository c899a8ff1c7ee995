"""Where attachments are kept: the "attachments" storage of settings.STORAGES."""

from typing import Any

from django.core.files.storage import Storage, storages
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.functional import LazyObject, empty

ATTACHMENTS = "attachments"


class _AttachmentStorage(LazyObject):
    """Resolved on first use rather than when the model class is built, and again after
    STORAGES changes (as Django does for default_storage), so the FileField always writes
    where the settings say."""

    def _setup(self) -> None:
        self._wrapped = storages[ATTACHMENTS]


_attachment_storage = _AttachmentStorage()


def attachment_storage() -> Storage:
    """The FileField's storage callable: migrations record this name, not a storage object."""
    return _attachment_storage


@receiver(setting_changed)
def _forget_attachment_storage(*, setting: str, **kwargs: Any) -> None:
    if setting == "STORAGES":
        _attachment_storage._wrapped = empty
