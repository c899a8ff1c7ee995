"""A real SMTP server on loopback (aiosmtpd) and the running example up to its approval."""

import asyncio
import email
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult
from django.contrib.auth import get_user_model
from django.db import connection

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.models import BusinessAction
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.services.tenancy import membership_add
from runs.loop import run_execute
from runs.models import Run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run

demo = runs_fixtures.demo

# The running example's events from the approval to the end, after EXAMPLE_EVENTS.
SENDING_EVENTS = [
    "approval.granted",
    "run.resumed",
    "tool.requested",
    "action.executing",
    "tool.completed",
    "action.succeeded",
    "run.finished",
]

ACCEPTED_LOG = "SMTP_ACCEPTED_LOG"
SMTP_PASSWORD = "smtp-secret"
LOOKUP = "tests.approvals.conftest.accepted"


def accepted(message_id: str) -> bool:
    """MAIL_DELIVERY_LOOKUP of the tests, as a relay's API would answer: did the test SMTP
    server accept this message? It logs the Message-IDs it accepted to a file, so a worker
    process can ask too."""
    return message_id in Path(os.environ[ACCEPTED_LOG]).read_text().splitlines()


@dataclass
class SmtpServer:
    """What the server accepted, in order. While `stall` is set it accepts a message (stores
    it) and then does not answer for that many seconds, as a server that times out after
    accepting. `drop` closes the connection after DATA without an answer: "after_accept"
    stores the message first, "before_accept" does not. `refuse` is the reply to each
    message's DATA instead of accepting it, and `data_replies` those to the next messages'
    DATA, one taken by each (both counted in `refused`). `sender_replies` are the
    replies to the next MAIL FROM commands, and `recipient_replies` those to the next RCPT TO
    of each address, one taken by each command instead of accepting it (counted in
    `envelope_refused`); once they are used up, the command is accepted. `greetings` are
    the replies to the next connections instead of its ready greeting, one taken by each, the
    connection closed after it; an empty one closes it without a word. While `greeting_stall`
    is set, it waits that many seconds before greeting. It offers AUTH: `auth_replies` are
    the replies to the next AUTH commands, one taken by each; once they are used up, a login
    with SMTP_PASSWORD is accepted and any other turned away."""

    host: str
    port: int
    accepted_log: Path
    messages: list[Message] = field(default_factory=list)
    envelope_recipients: list[list[str]] = field(default_factory=list)
    stall: float = 0.0
    drop: str = ""
    refuse: str = ""
    refused: int = 0
    data_replies: list[str] = field(default_factory=list)
    sender_replies: list[str] = field(default_factory=list)
    recipient_replies: dict[str, list[str]] = field(default_factory=dict)
    envelope_refused: int = 0
    greetings: list[str] = field(default_factory=list)
    greeting_stall: float = 0.0
    auth_replies: list[str] = field(default_factory=list)
    controller: Controller | None = None

    def start(self) -> None:
        self.controller = _Controller(
            self,
            hostname=self.host,
            port=self.port,
            auth_require_tls=False,
            authenticator=self.authenticate,
        )
        self.controller.start()

    def authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        if self.auth_replies:
            return AuthResult(success=False, handled=False, message=self.auth_replies.pop(0))
        return AuthResult(success=auth_data.password == SMTP_PASSWORD.encode(), handled=False)

    def sending(self, work: Callable[[], object]) -> threading.Thread:
        """`work` started on a thread of its own (with its own connection), returned once
        this server holds a message: the send it makes is under way."""

        def in_thread() -> None:
            try:
                work()
            finally:
                connection.close()

        thread = threading.Thread(target=in_thread)
        thread.start()
        deadline = time.monotonic() + 10
        while not self.messages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.messages, "the send never reached the mail server"
        return thread

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        if self.sender_replies:
            self.envelope_refused += 1
            return self.sender_replies.pop(0)
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if self.recipient_replies.get(address):
            self.envelope_refused += 1
            return self.recipient_replies[address].pop(0)
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        if self.drop == "before_accept":
            server.transport.close()
            return "421 Closing"
        if self.refuse or self.data_replies:
            self.refused += 1
            return self.refuse or self.data_replies.pop(0)
        message = email.message_from_bytes(envelope.original_content)
        self.messages.append(message)
        self.envelope_recipients.append(list(envelope.rcpt_tos))
        with self.accepted_log.open("a") as log:
            log.write(message["Message-ID"] + "\n")
        if self.drop == "after_accept":
            server.transport.close()
            return "421 Closing"
        waited = 0.0
        while waited < self.stall:
            await asyncio.sleep(0.05)
            waited += 0.05
        return "250 OK"

    def environment(self, **extra: str) -> dict[str, str]:
        """The settings a worker process needs to deliver to this server."""
        return {
            "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
            "EMAIL_HOST": self.host,
            "EMAIL_PORT": str(self.port),
            "MAIL_DELIVERY_LOOKUP": LOOKUP,
            ACCEPTED_LOG: str(self.accepted_log),
            **extra,
        }


class _Smtp(SMTP):
    """aiosmtpd's server, greeting as its handler (a SmtpServer) says."""

    async def _handle_client(self) -> None:
        server = self.event_handler
        if server.greeting_stall:
            await asyncio.sleep(server.greeting_stall)
        if server.greetings:
            reply = server.greetings.pop(0)
            if reply:
                await self.push(reply)
            self.transport.close()
            return
        await super()._handle_client()


class _Controller(Controller):
    def factory(self) -> SMTP:
        return _Smtp(self.handler, **self.SMTP_kwargs)


@pytest.fixture
def smtp_server(settings, free_tcp_port, tmp_path, monkeypatch) -> Iterator[SmtpServer]:
    server = SmtpServer(host="127.0.0.1", port=free_tcp_port, accepted_log=tmp_path / "smtp.log")
    server.accepted_log.touch()
    monkeypatch.setenv(ACCEPTED_LOG, str(server.accepted_log))
    server.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = server.host
    settings.EMAIL_PORT = server.port
    settings.EMAIL_TIMEOUT = 2
    settings.MAIL_DELIVERY_LOOKUP = LOOKUP
    try:
        yield server
    finally:
        server.stall = 0
        server.drop = ""
        server.refuse = ""
        server.sender_replies.clear()
        server.recipient_replies.clear()
        server.greetings.clear()
        server.greeting_stall = 0
        server.controller.stop()


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


def approve(action: BusinessAction, approver) -> None:
    """`approver` approves the action as drafted (its resume task is sent, not run)."""
    services.approval_decide(
        action_id=action.pk,
        approver=approver,
        decision=Decision.APPROVE,
        payload_hash=action.payload_hash,
    )


def approved_run(demo, approver) -> tuple[Run, BusinessAction]:
    """The running example as alice, approved (its resume task is sent, not run)."""
    run, action = waiting_run(demo)
    approve(action, approver)
    return run, action


def left_unknown(demo, approver, smtp_server) -> tuple[Run, BusinessAction]:
    """An approved action whose send timed out after the mail server accepted it: unknown."""
    run, action = approved_run(demo, approver)
    smtp_server.stall = 3  # longer than EMAIL_TIMEOUT
    services.action_execute(action_id=action.pk)
    action.refresh_from_db()
    assert action.status == ActionStatus.UNKNOWN
    return run, action


def approver_in(tenant, username: str = "quinn"):
    user = get_user_model().objects.create_user(username=username, password=DEMO_PASSWORD)
    membership_add(actor=None, user=user, tenant=tenant, role=Role.APPROVER)
    return user
