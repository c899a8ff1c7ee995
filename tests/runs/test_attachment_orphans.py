"""The sweep of attachment files no row names (the process died between the file and the row,
or an outer transaction rolled the row back): removed once past the grace period, never an
upload in flight, a file a row names, or a file that is not shaped like an attachment."""

import io
import os
import time
import uuid

import pytest
from django.core.files import File
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from config.celery import app
from runs.models import Attachment
from runs.services import attachments
from runs.services.attachments import attachment_orphans_remove, attachment_store
from runs.tasks import attachment_orphans_remove as attachment_orphans_remove_task

TEXT = b"Weekly notes: Apollo ships on Friday.\n"


pytestmark = pytest.mark.usefixtures("private_root")


def _stored_files(root) -> set[str]:
    return {path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()}


def _write(root, name: str) -> str:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(TEXT)
    return name


def _age(root, name: str, seconds: float) -> None:
    moment = time.time() - seconds
    os.utime(root / name, (moment, moment))


def _store(member, acme) -> Attachment:
    return attachment_store(
        actor=member,
        tenant=acme,
        upload=File(io.BytesIO(TEXT), name="notes.txt"),
        declared_media_type="text/plain",
    )


class Interrupted(Exception):
    pass


def test_an_orphan_older_than_the_grace_period_is_removed(acme, private_root, settings):
    orphan = _write(private_root, f"{acme.pk}/{uuid.uuid4()}")
    _age(private_root, orphan, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS + 60)

    assert attachment_orphans_remove() == 1

    assert _stored_files(private_root) == set()


def test_a_store_nothing_was_uploaded_to_yet_has_nothing_to_remove(db, private_root):
    assert not private_root.exists()

    assert attachment_orphans_remove() == 0


def test_an_orphan_within_the_grace_period_is_kept(acme, private_root, settings):
    fresh = _write(private_root, f"{acme.pk}/{uuid.uuid4()}")
    recent = _write(private_root, f"{acme.pk}/{uuid.uuid4()}")
    _age(private_root, recent, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS - 60)

    assert attachment_orphans_remove() == 0

    assert _stored_files(private_root) == {fresh, recent}


def test_a_file_a_row_names_is_kept_however_old(member, acme, private_root, settings):
    attachment = _store(member, acme)
    _age(private_root, attachment.file.name, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS * 10)

    assert attachment_orphans_remove() == 0

    assert _stored_files(private_root) == {attachment.file.name}
    with Attachment.objects.get().file.open("rb") as stored:
        assert stored.read() == TEXT


def test_an_upload_whose_row_an_outer_transaction_rolled_back_is_removed_once_old(
    member, acme, private_root, settings
):
    with pytest.raises(Interrupted), transaction.atomic():
        attachment = _store(member, acme)
        raise Interrupted
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == {attachment.file.name}

    assert attachment_orphans_remove() == 0
    assert _stored_files(private_root) == {attachment.file.name}

    _age(private_root, attachment.file.name, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS + 60)
    assert attachment_orphans_remove() == 1
    assert _stored_files(private_root) == set()


def test_files_not_shaped_like_an_attachment_are_left_alone(acme, private_root, settings):
    attachment_id = uuid.uuid4()
    others = {
        _write(private_root, "README.txt"),
        _write(private_root, f"acme/{attachment_id}"),
        _write(private_root, f"0{acme.pk}/{attachment_id}"),
        _write(private_root, f"{acme.pk}/notes.txt"),
        _write(private_root, f"{acme.pk}/{str(attachment_id).upper()}"),
        _write(private_root, f"{acme.pk}/{attachment_id}_a1b2c3d"),
        _write(private_root, f"{acme.pk}/{attachment_id}/nested"),
    }
    for name in others:
        _age(private_root, name, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS * 10)

    assert attachment_orphans_remove() == 0

    assert _stored_files(private_root) == others


def test_the_rows_are_looked_up_one_batch_of_names_at_a_time(
    member, acme, globex, private_root, settings, monkeypatch, django_assert_num_queries
):
    monkeypatch.setattr(attachments, "ORPHAN_SWEEP_BATCH", 2)
    kept = {_store(member, acme).file.name for _ in range(2)}
    orphans = {_write(private_root, f"{acme.pk}/{uuid.uuid4()}") for _ in range(3)}
    orphans.add(_write(private_root, f"{globex.pk}/{uuid.uuid4()}"))
    for name in kept | orphans:
        _age(private_root, name, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS + 60)

    # acme's five files in three batches, globex's one in one.
    with django_assert_num_queries(4):
        assert attachment_orphans_remove() == 4

    assert _stored_files(private_root) == kept


@pytest.mark.django_db(transaction=True)
def test_the_beat_removes_orphans_hourly(acme, private_root, settings):
    DatabaseScheduler(app=app)

    periodic = PeriodicTask.objects.get(name="attachment-orphans-remove")
    assert periodic.task == "runs.tasks.attachment_orphans_remove"
    assert periodic.enabled
    assert (periodic.interval.every, periodic.interval.period) == (3600, IntervalSchedule.SECONDS)
    assert attachment_orphans_remove_task.name in app.tasks
    assert attachment_orphans_remove_task.acks_late

    orphan = _write(private_root, f"{acme.pk}/{uuid.uuid4()}")
    _age(private_root, orphan, settings.ATTACHMENT_ORPHAN_GRACE_SECONDS + 60)
    assert attachment_orphans_remove_task() == 1
    assert attachment_orphans_remove_task() == 0
    assert _stored_files(private_root) == set()
