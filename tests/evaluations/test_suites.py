"""Installing a suite checks each case's definition as the runner reads it: a malformed case
is refused naming the case and the field, before anything is saved."""

import copy
from io import StringIO

import pytest
import yaml
from django.core.management import call_command

from config.errors import ValidationFailed
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
    ],
    ids=["messages-string", "project-without-key", "misspelled-expectation"],
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


def test_the_install_command_names_the_malformed_case(db, tmp_path, monkeypatch):
    document = copy.deepcopy(TINY_SUITE)
    document["cases"][1]["metadata"] = [{}, {}]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(document))
    monkeypatch.setattr("evaluations.starter.SUITES", tmp_path)

    with pytest.raises(Exception, match="cases/no-scope/metadata: 2 metadata for 1 messages"):
        call_command("eval_suites_install", stdout=StringIO())

    assert not EvalCase.objects.exists()
