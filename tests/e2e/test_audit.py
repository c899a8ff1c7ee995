"""The people of the product in a browser: an approver approves from the queue and sees the
mail go out (a real worker, a real SMTP server); an auditor filters the history, opens the run
and sees the recipient's email masked; someone of another tenant does not find the run; an
auditor on a waiting run's page sees what happens next as progress."""

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from approvals import services
from approvals.models import BusinessAction
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import Tenant
from registry.services.tenancy import membership_add
from runs.choices import RunStatus
from runs.loop import run_execute
from runs.models import Run, RunEvent
from tests.approvals.conftest import approve, smtp_server  # noqa: F401 (fixture)
from tests.celery_worker import (
    alice_client,
    example_post,
    example_seed,
    queue_purge,
    run_status,
    wait_until,
)
from tests.e2e.conftest import log_in

pytestmark = pytest.mark.django_db(transaction=True)

EMAIL = "li.wei@acme.example"
MASKED = "l***@acme.example"
# Hands each line the run page adds to its progress to `progressShown`, as it appears.
PROGRESS_OBSERVER = """
new MutationObserver(records => records.forEach(record => record.addedNodes.forEach(node => {
  if (node.nodeName === "LI" && node.parentElement.id === "progress") {
    window.progressShown(node.textContent);
  }
}))).observe(document, {childList: true, subtree: true});
"""


def test_an_approver_approves_from_the_queue_and_sees_the_mail_sent(
    page,
    live_server,
    http_cookies,
    start_worker,
    smtp_server,  # noqa: F811
):
    example_seed()
    worker = start_worker(environment=smtp_server.environment())
    run_id = example_post(alice_client()).json()["run_id"]
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=60,
        what="the run to wait for approval",
        worker=worker,
    )

    log_in(page, live_server, "bob")
    page.goto(f"{live_server.url}/approvals/")
    page.click("text=mail_send")
    assert f"Li Wei <{EMAIL}>" in page.inner_text("dl")
    page.fill("textarea[name=comment]", "Looks right.")
    page.click("button[value=approve]")
    assert "Recorded: approve." in page.inner_text(".message")
    wait_until(
        lambda: run_status(run_id) == RunStatus.COMPLETED,
        seconds=60,
        what="the worker to send the approved mail",
        worker=worker,
    )
    page.reload()

    details = page.inner_text("dl")
    assert "Succeeded" in details
    assert "approve by bob" in details
    assert BusinessAction.objects.get(run_id=run_id).external_id in details
    assert [message["To"] for message in smtp_server.messages] == [EMAIL]


@pytest.fixture
def sent_run(smtp_server, celery_queue) -> Run:  # noqa: F811
    """The running example, approved by bob and sent, in this process (the task the ingress
    enqueued is dropped: no worker of a later test may take it)."""
    example_seed()
    response = example_post(alice_client())
    run_id = response.json()["run_id"]
    queue_purge()
    run_execute(run_id=run_id)
    action = BusinessAction.objects.get(run_id=run_id)
    approve(action, get_user_model().objects.get(username="bob"))
    services.action_execute(action_id=action.pk)
    return Run.objects.get(pk=run_id)


def test_an_auditor_filters_the_history_opens_the_run_and_sees_the_email_masked(
    page, live_server, http_cookies, sent_run
):
    log_in(page, live_server, "carol")
    page.goto(f"{live_server.url}/runs/")
    page.select_option("select[name=status]", "COMPLETED")
    page.check("input[name=has_side_effect]")
    page.click("#filters button[type=submit]")
    page.wait_for_load_state()

    rows = page.locator("#runs tbody tr")
    assert rows.count() == 1
    rows.first.locator("a").click()
    page.wait_for_selector("#timeline")

    text = page.inner_text("main")
    assert page.url == f"{live_server.url}/runs/{sent_run.pk}/"
    assert MASKED in text
    assert EMAIL not in page.content()
    assert "approve by bob" in text
    assert "run.finished" in page.inner_text("#timeline")


def test_someone_of_another_tenant_does_not_find_the_run(page, live_server, http_cookies, sent_run):
    auditor = get_user_model().objects.create_user("gina", password=DEMO_PASSWORD)
    membership_add(
        actor=None, user=auditor, tenant=Tenant.objects.get(slug="globex"), role=Role.AUDITOR
    )
    log_in(page, live_server, "gina")

    response = page.goto(f"{live_server.url}/runs/{sent_run.pk}/")

    assert response.status == 404
    assert EMAIL not in page.content() and MASKED not in page.content()


def test_an_auditor_watching_a_waiting_run_sees_what_happens_next_as_progress(
    page,
    live_server,
    http_cookies,
    smtp_server,  # noqa: F811
    celery_queue,
    settings,
):
    # given the running example waiting for approval, and carol on its page, with every line
    # the page adds to its progress kept as it appears (the page reloads at the end)
    settings.RUN_STREAM_MAX_SECONDS = 30
    example_seed()
    run_id = example_post(alice_client()).json()["run_id"]
    queue_purge()
    run_execute(run_id=run_id)
    shown = Run.objects.get(pk=run_id).last_event_seq
    progress = []
    page.expose_function("progressShown", lambda text: progress.append(text))
    page.add_init_script(PROGRESS_OBSERVER)
    log_in(page, live_server, "carol")
    page.goto(f"{live_server.url}/runs/{run_id}/")
    assert "approval.required" in page.inner_text("#timeline")

    # when bob approves the mail and it is sent
    action = BusinessAction.objects.get(run_id=run_id)
    approve(action, get_user_model().objects.get(username="bob"))
    services.action_execute(action_id=action.pk)

    # then the page showed exactly what happened since it loaded, each event with its time,
    # and at the end of the stream loaded again with the result
    expect(page.locator("#status")).to_have_text("COMPLETED", timeout=30_000)
    happened = list(
        RunEvent.objects.filter(run_id=run_id, seq__gt=shown)
        .order_by("seq")
        .values_list("type", "created_at")
    )
    assert progress == [f"{type_} at {created_at.isoformat()}" for type_, created_at in happened]
    assert "run.finished" in [type_ for type_, _created_at in happened]
    assert page.locator("#live").count() == 0
