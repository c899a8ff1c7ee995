"""The suites shipped with the platform (evaluations/suites/*.yaml), installed or brought up
to date by `manage.py eval_suites_install` and by the demo."""

from pathlib import Path
from typing import Any

import yaml
from django.core.exceptions import ValidationError
from django.db import transaction

from evaluations.errors import ValidationFailed
from evaluations.gates import suite_changed, suite_content_hash
from evaluations.models import EvalCase, EvalSuite

SUITES = Path(__file__).resolve().parent / "suites"
SUITE_FIELDS = ("key", "name", "kind", "skill", "cases")


def _missing(document: Any) -> dict[str, list[str]]:
    """What a suite document lacks that an install reads: the suite's fields, each case's key."""
    if not isinstance(document, dict):
        return {"suite": ["A suite is a mapping of its fields."]}
    missing = {
        field: ["This field is required."] for field in SUITE_FIELDS if field not in document
    }
    cases = document.get("cases", [])
    if not isinstance(cases, list):
        missing["cases"] = ["A list of cases."]
        return missing
    for index, case in enumerate(cases):
        if not isinstance(case, dict) or "key" not in case:
            missing[f"cases/{index}/key"] = ["This field is required."]
    return missing


def _suite_fields(document: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": document["name"],
        "kind": document["kind"],
        "description": document.get("description", ""),
        "skill_name": document["skill"],
    }


def _suite_errors(document: dict[str, Any]) -> dict[str, list[str]]:
    """What the suite's own fields break (a kind that is none, a key that is not one), named
    as the document names them: saved as they came, a kind unknown to the metrics was
    installed, and a value too long for its column failed the install with a database error."""
    suite = EvalSuite(tenant=None, key=document["key"], **_suite_fields(document))
    try:
        suite.full_clean(validate_unique=False, validate_constraints=False)
    except ValidationError as error:
        return {"skill" if field == "skill_name" else field: found for field, found in error}
    return {}


def _not_valid(message: str, problems: dict[str, list[str]]) -> ValidationFailed:
    """A refusal whose message lists its problems, as the install command prints it."""
    listed = "; ".join(f"{where}: {' '.join(found)}" for where, found in problems.items())
    return ValidationFailed(f"{message}: {listed}", details=problems)


def _case_fields(case: dict[str, Any], projects: dict[str, dict]) -> dict[str, Any]:
    """A case's projects are named fixtures of the suite's `projects`, or written inline."""
    fixture = {
        "projects": [
            projects.get(entry, entry) if isinstance(entry, str) else entry
            for entry in case.get("projects", [])
        ],
        "faults": case.get("faults", {}),
        "tool_descriptions": case.get("tool_descriptions", {}),
    }
    if "attachment" in case:
        fixture["attachment"] = case["attachment"]
    return {
        "title": case.get("title", ""),
        "messages": case.get("messages"),
        "metadata": case.get("metadata", {}),
        "session_state": case.get("session_state", {}),
        "fixture": fixture,
        "expected": case.get("expected", {}),
        "vector": case.get("vector", ""),
        "payload": case.get("payload", ""),
        "forbidden": case.get("forbidden", {}),
    }


def suite_install(document: dict[str, Any]) -> tuple[EvalSuite, bool]:
    """A platform suite and its cases as the document says. A case the document no longer
    lists is kept: past eval runs refer to it. An eval run of the suite queued or running
    while what it measures changes no longer counts for a release gate (`suite_changed`).
    Returns the suite and whether it is new."""
    problems = _missing(document) or _suite_errors(document)
    if problems:
        raise _not_valid("Not a suite", problems)
    with transaction.atomic():
        installed = (
            EvalSuite.objects.select_for_update().filter(tenant=None, key=document["key"]).first()
        )
        before = suite_content_hash(installed) if installed else None
        suite, created = EvalSuite.objects.update_or_create(
            tenant=None,
            key=document["key"],
            defaults=_suite_fields(document),
        )
        projects = document.get("projects", {})
        problems = {}
        for case in document["cases"]:
            fields = _case_fields(case, projects)
            try:
                EvalCase(suite=suite, key=case["key"], **fields).full_clean(
                    validate_unique=False, validate_constraints=False
                )
            except ValidationError as error:
                problems.update({f"cases/{case['key']}/{field}": found for field, found in error})
                continue
            EvalCase.objects.update_or_create(suite=suite, key=case["key"], defaults=fields)
        if problems:
            raise _not_valid(f"Suite {suite.key} has cases that are not valid", problems)
        if before is not None and suite_content_hash(suite) != before:
            suite_changed(suites=[suite])
    return suite, created


def suites_install() -> list[tuple[EvalSuite, bool]]:
    """Every shipped suite, or none: a file that is not YAML, or not a valid suite, leaves
    every suite as it was, and the refusal names the file. The installed suites are locked up
    front in primary-key order, as a case's save locks the suites it is in and goes to
    (`eval_case_save`): locked file by file, a case moved meanwhile between two of them
    could deadlock with the install."""
    documents = []
    for path in sorted(SUITES.glob("*.yaml")):
        try:
            documents.append((path, yaml.safe_load(path.read_text())))
        except yaml.YAMLError as error:
            raise ValidationFailed(
                f"{path.name}: Not YAML: {' '.join(str(error).split())}"
            ) from error
    keys = [
        document["key"]
        for _, document in documents
        if isinstance(document, dict) and isinstance(document.get("key"), str)
    ]
    installed = []
    with transaction.atomic():
        list(
            EvalSuite.objects.select_for_update()
            .filter(tenant=None, key__in=keys)
            .order_by("pk")
            .values("pk")
        )
        for path, document in documents:
            try:
                installed.append(suite_install(document))
            except ValidationFailed as error:
                raise ValidationFailed(
                    f"{path.name}: {error.message}", details=error.details
                ) from error
    return installed
