"""Installing a suite checks each case's definition as the runner reads it: a malformed case
is refused naming the case and the field, before anything is saved. A case saved while its
suite is installed waits for the install."""

import copy
import threading
import time
from io import StringIO

import pytest
import yaml
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection

from config.errors import ValidationFailed
from evaluations import services, starter
from evaluations.models import EvalCase, EvalSuite
from evaluations.starter import SUITES, suite_install
from tests.evaluations.conftest import TINY_SUITE


def test_every_shipped_case_installs(db):
    out = StringIO()

    call_command("eval_suites_install", stdout=out)

    for path in sorted(SUITES.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        assert f"installed {document['key']}: {len(document['cases'])} cases" in out.getvalue()


@pytest.mark.parametrize(
    ("change", "where", "message"),
    [
        (
            {"messages": "Summarise Apollo's week."},
            "cases/complete/messages",
            "\"Summarise Apollo's week.\" is not of type 'array'",
        ),
        (
            {"projects": [{"name": "No key"}]},
            "cases/complete/fixture",
            "projects/0: 'key' is a required property",
        ),
        (
            {"expected": {"status": "WAITING_APPROVAL", "tool_called": ["mail_send"]}},
            "cases/complete/expected",
            "Additional properties are not allowed ('tool_called' was unexpected)",
        ),
        (
            {"metadata": {"project_id": "apollo", "budget": 1e20}},
            "cases/complete/metadata",
            "Holds a number outside the exactly representable range (integers within "
            "±2^53-1, finite floats); the case could not be hashed canonically.",
        ),
    ],
    ids=["messages-string", "project-without-key", "misspelled-expectation", "huge-number"],
)
def test_a_malformed_case_is_refused_naming_the_case_and_the_field(db, change, where, message):
    document = copy.deepcopy(TINY_SUITE)
    document["cases"][0].update(change)

    with pytest.raises(ValidationFailed) as refused:
        suite_install(document)

    assert refused.value.details == {where: [message]}
    assert f"{where}: {message}" in str(refused.value)
    assert not EvalSuite.objects.exists()
    assert not EvalCase.objects.exists()


def apollo_with(*, updates=(), leads=()) -> dict:
    return {
        "key": "apollo",
        "updates": [["task", "API gateway migration", "done", "Moved.", 0], *updates],
        "leads": [["dir-1001", "Li Wei", "li.wei@acme.example", 3], *leads],
    }


@pytest.mark.parametrize(
    ("projects", "message"),
    [
        (
            [apollo_with(updates=[["task", "T" * 201, "done", "", 1]])],
            "projects/0/updates/1/1: '" + "T" * 201 + "' is too long",
        ),
        (
            [apollo_with(updates=[["risk", "Vendor", "s" * 33, "", 1]])],
            "projects/0/updates/1/2: '" + "s" * 33 + "' is too long",
        ),
        (
            [apollo_with(updates=[["task", "Far", "done", "", 10**9]])],
            "projects/0/updates/1/4: 1000000000 is greater than the maximum of 36500",
        ),
        (
            [apollo_with(leads=[["dir-1002", "N" * 201, "", 1]])],
            "projects/0/leads/1/1: '" + "N" * 201 + "' is too long",
        ),
        (
            [apollo_with(leads=[["dir-1002", "Wang Fang", "w@" + "e" * 260, 1]])],
            "projects/0/leads/1/2: 'w@" + "e" * 260 + "' is too long",
        ),
        (
            [apollo_with(leads=[["dir-1002", "Wang Fang", "", 2**31]])],
            "projects/0/leads/1/3: 2147483648 is greater than the maximum of 2147483647",
        ),
        (
            [apollo_with(leads=[["dir-1001", "Wang Fang", "wang.fang@acme.example", 1]])],
            "projects/0/leads/1: dir-1001 is a record of this project already.",
        ),
        (
            [apollo_with(), {"key": "apollo", "name": "Apollo again"}],
            "projects/1: apollo is a project of this case already.",
        ),
    ],
    ids=[
        "long-title",
        "long-status",
        "far-day",
        "long-name",
        "long-email",
        "huge-version",
        "record-twice",
        "project-twice",
    ],
)
def test_a_fixture_the_sandbox_cannot_hold_is_refused_naming_the_case(db, projects, message):
    # a fixture the sandbox's tables cannot hold would fail the case's every eval run, and
    # with it the whole eval run, instead of being refused here
    document = copy.deepcopy(TINY_SUITE)
    document["cases"][0]["projects"] = projects

    with pytest.raises(ValidationFailed) as refused:
        suite_install(document)

    assert refused.value.details == {"cases/complete/fixture": [message]}
    assert not EvalCase.objects.exists()


def test_the_install_command_names_the_malformed_case(db, tmp_path, monkeypatch):
    document = copy.deepcopy(TINY_SUITE)
    document["cases"][1]["metadata"] = [{}, {}]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(document))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(Exception, match="cases/no-scope/metadata: 2 metadata for 1 messages"):
        call_command("eval_suites_install", stdout=StringIO())

    assert not EvalCase.objects.exists()


@pytest.mark.parametrize(
    ("remove", "missing"),
    [
        (lambda document: document.pop("key"), "key"),
        (lambda document: document.pop("name"), "name"),
        (lambda document: document.pop("kind"), "kind"),
        (lambda document: document.pop("skill"), "skill"),
        (lambda document: document.pop("cases"), "cases"),
        (lambda document: document["cases"][1].pop("key"), "cases/1/key"),
    ],
    ids=["key", "name", "kind", "skill", "cases", "case-key"],
)
def test_the_install_command_names_the_file_and_what_it_misses(
    db, tmp_path, monkeypatch, remove, missing
):
    document = copy.deepcopy(TINY_SUITE)
    remove(document)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(document))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(CommandError) as refused:
        call_command("eval_suites_install", stdout=StringIO())

    assert str(refused.value) == f"tiny.yaml: Not a suite: {missing}: This field is required."
    assert not EvalSuite.objects.exists()
    assert not EvalCase.objects.exists()


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"kind": "tsak"}, "kind: Value 'tsak' is not a valid choice."),
        ({"key": "Weekly Summary"}, "key: Lower-case letters, digits and '-'."),
        ({"name": None}, "name: This field cannot be null."),
        (
            {"skill": "s" * 65},
            "skill: Ensure this value has at most 64 characters (it has 65).",
        ),
        ({"cases": None}, "cases: A list of cases."),
    ],
    ids=["kind", "key", "name", "skill", "cases"],
)
def test_the_install_command_names_the_file_and_the_suite_field_that_is_not_valid(
    db, tmp_path, monkeypatch, change, refusal
):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(copy.deepcopy(TINY_SUITE) | change))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(CommandError) as refused:
        call_command("eval_suites_install", stdout=StringIO())

    assert str(refused.value) == f"tiny.yaml: Not a suite: {refusal}"
    assert not EvalSuite.objects.exists()


def test_the_install_command_names_a_file_that_is_not_yaml(db, tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text("key: tiny\ncases: [unclosed\n")
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(CommandError) as refused:
        call_command("eval_suites_install", stdout=StringIO())

    assert str(refused.value).startswith("tiny.yaml: Not YAML: ")
    assert "line 3" in str(refused.value)
    assert not EvalSuite.objects.exists()


@pytest.mark.parametrize(
    "bad",
    ["key: broken\ncases: [unclosed\n", "key: broken\nname: Broken\n"],
    ids=["not-yaml", "not-a-suite"],
)
def test_the_install_command_installs_no_suite_when_a_later_file_is_bad(
    db, tmp_path, monkeypatch, bad
):
    (tmp_path / "a-tiny.yaml").write_text(yaml.safe_dump(TINY_SUITE))
    (tmp_path / "b-broken.yaml").write_text(bad)
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(CommandError, match=r"^b-broken\.yaml: "):
        call_command("eval_suites_install", stdout=StringIO())

    assert not EvalSuite.objects.exists()
    assert not EvalCase.objects.exists()


def test_the_install_command_leaves_installed_suites_as_they_were_when_a_file_is_bad(
    db, tmp_path, monkeypatch
):
    suite_install(TINY_SUITE)
    changed = copy.deepcopy(TINY_SUITE)
    changed["cases"][0]["messages"] = ["Summarise Apollo's week for the lead."]
    broken = copy.deepcopy(TINY_SUITE) | {"key": "broken"}
    broken["cases"][1]["metadata"] = [{}, {}]
    (tmp_path / "a-tiny.yaml").write_text(yaml.safe_dump(changed))
    (tmp_path / "b-broken.yaml").write_text(yaml.safe_dump(broken))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(CommandError, match=r"^b-broken\.yaml: Suite broken has cases"):
        call_command("eval_suites_install", stdout=StringIO())

    assert list(EvalSuite.objects.values_list("key", flat=True)) == ["tiny"]
    assert EvalCase.objects.get(key="complete").messages == [
        "Summarise Apollo's week for the R&D lead."
    ]


def _waiting_on(backend_pid: int) -> bool:
    """Whether another session waits for a lock this session holds (read afresh: in a
    transaction, the activity views keep what they showed first)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            [backend_pid],
        )
        return cursor.fetchone()[0] > 0


def _saved_while_installing(monkeypatch, *, install, case, admin) -> tuple[bool, dict[str, str]]:
    """Run `install` on a thread of its own and, once it holds the first suite it installs
    (as it hashes that suite's content), save `case` as `admin`; the install goes on once the
    save waits for it. Returns whether the save waited for the install, and what became of
    each (`installed`/`saved`, or the database error that aborted it)."""
    outcomes: dict[str, str] = {}
    suite_held, waited = threading.Event(), []
    hashed = starter.suite_content_hash

    def hash_once_the_save_waits(installed):
        if suite_held.is_set():
            return hashed(installed)
        suite_held.set()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend_pid = cursor.fetchone()[0]
        for _ in range(2000):
            if _waiting_on(backend_pid):
                waited.append(True)
                break
            time.sleep(0.005)
        return hashed(installed)

    def installing() -> None:
        try:
            install()
            outcomes["install"] = "installed"
        except DatabaseError as error:
            outcomes["install"] = type(error.__cause__ or error).__name__
        finally:
            suite_held.set()
            connection.close()

    monkeypatch.setattr(starter, "suite_content_hash", hash_once_the_save_waits)
    installer = threading.Thread(target=installing)
    installer.start()
    assert suite_held.wait(timeout=30)
    try:
        services.eval_case_save(case=case, actor=admin)
        outcomes["save"] = "saved"
    except DatabaseError as error:
        outcomes["save"] = type(error.__cause__ or error).__name__
    installer.join(timeout=30)
    return waited == [True], outcomes


@pytest.mark.django_db(transaction=True)
def test_a_case_saved_while_its_suite_is_installed_waits_for_the_install_and_is_saved(
    monkeypatch,
):
    # given the tiny suite, an install of it changing its first case's message, and an admin
    # changing what that case expects
    suite, _ = suite_install(TINY_SUITE)
    admin = get_user_model().objects.create_superuser(username="root", password="not-used")
    case = EvalCase.objects.get(suite=suite, key="complete")
    case.expected = {"status": "NEEDS_CLARIFICATION"}
    document = copy.deepcopy(TINY_SUITE)
    document["cases"][0]["messages"] = ["Summarise Apollo's week for the lead."]

    # when the admin saves the case while the install holds the suite
    waited, outcomes = _saved_while_installing(
        monkeypatch, install=lambda: suite_install(document), case=case, admin=admin
    )

    # then neither is aborted as a deadlock: the save waited for the install, then was saved
    assert waited
    assert outcomes == {"install": "installed", "save": "saved"}
    case.refresh_from_db()
    assert case.expected == {"status": "NEEDS_CLARIFICATION"}


@pytest.mark.django_db(transaction=True)
def test_a_case_moved_between_suites_while_they_are_installed_waits_for_the_install(
    tmp_path, monkeypatch
):
    # given two platform suites installed in the opposite order of their files, so the file
    # installed first holds the newer row, and an admin moving a case from the older suite to
    # the newer one
    older = copy.deepcopy(TINY_SUITE) | {"key": "b-older"}
    for case in older["cases"]:
        case["key"] = f"older-{case['key']}"
    newer = copy.deepcopy(TINY_SUITE) | {"key": "a-newer"}
    older_suite, _ = suite_install(older)
    newer_suite, _ = suite_install(newer)
    (tmp_path / "a-newer.yaml").write_text(yaml.safe_dump(newer))
    (tmp_path / "b-older.yaml").write_text(yaml.safe_dump(older))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)
    admin = get_user_model().objects.create_superuser(username="root", password="not-used")
    case = EvalCase.objects.get(suite=older_suite, key="older-complete")
    case.suite = newer_suite

    # when the admin moves the case while the install is under way
    waited, outcomes = _saved_while_installing(
        monkeypatch, install=starter.suites_install, case=case, admin=admin
    )

    # then neither is aborted as a deadlock: the move waited for the install, then was saved
    assert waited
    assert outcomes == {"install": "installed", "save": "saved"}
    case.refresh_from_db()
    assert case.suite_id == newer_suite.pk
