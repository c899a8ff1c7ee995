"""A real SMTP server on loopback (aiosmtpd) and the running example up to its approval."""

import email
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message

import pytest
from aiosmtpd.controller import Controller
from django.contrib.auth import get_user_model

from approvals.models import BusinessAction
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.services.tenancy import membership_add
from runs.loop import run_execute
from runs.models import Run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run

demo = runs_fixtures.demo

RECEIVED: dict[str, Message] = {}
"""Every message the test SMTP servers accepted, by Message-ID (see `accepted`)."""


def accepted(message_id: str) -> bool | None:
    """MAIL_DELIVERY_LOOKUP of the tests: did a test SMTP server accept this message?"""
    return message_id in RECEIVED


@dataclass
class SmtpServer:
    """What the server accepted, in order. `stall_after_data` makes it accept a message
    (store it) and then not answer, as a server that times out after accepting."""

    host: str
    port: int
    messages: list[Message] = field(default_factory=list)
    stall_after_data: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def handle_DATA(self, server, session, envelope):
        message = email.message_from_bytes(envelope.original_content)
        with self.lock:
            self.messages.append(message)
            RECEIVED[message["Message-ID"]] = message
        if self.stall_after_data:
            time.sleep(self.stall_after_data)
        return "250 OK"


@pytest.fixture
def smtp_server(settings, free_tcp_port) -> Iterator[SmtpServer]:
    server = SmtpServer(host="127.0.0.1", port=free_tcp_port)
    controller = Controller(server, hostname=server.host, port=server.port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = server.host
    settings.EMAIL_PORT = server.port
    settings.EMAIL_TIMEOUT = 2
    settings.MAIL_DELIVERY_LOOKUP = "tests.approvals.conftest.accepted"
    try:
        yield server
    finally:
        controller.stop()


@pytest.fixture
def bob(demo):
    return get_user_model().objects.get(username="bob")


def waiting_run(demo, **metadata) -> tuple[Run, BusinessAction]:
    """The running example as alice, up to its approval."""
    run = demo_run(demo, project_id="apollo", **metadata)
    run_execute(run_id=str(run.pk))
    run = Run.objects.get(pk=run.pk)
    assert run.status == "WAITING_APPROVAL", run.result
    return run, BusinessAction.objects.get(run=run)


def approver_in(tenant, username: str = "quinn"):
    user = get_user_model().objects.create_user(username=username, password=DEMO_PASSWORD)
    membership_add(actor=None, user=user, tenant=tenant, role=Role.APPROVER)
    return user
