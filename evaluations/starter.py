"""The suites shipped with the platform (evaluations/suites/*.yaml), installed or brought up
to date by `manage.py eval_suites_install` and by the demo."""

from pathlib import Path
from typing import Any

import yaml
from django.db import transaction

from evaluations.models import EvalCase, EvalSuite

SUITES = Path(__file__).resolve().parent / "suites"


def _case_fields(case: dict[str, Any], projects: dict[str, dict]) -> dict[str, Any]:
    """A case's projects are named fixtures of the suite's `projects`, or written inline."""
    fixture = {
        "projects": [
            projects[entry] if isinstance(entry, str) else entry
            for entry in case.get("projects", [])
        ],
        "faults": case.get("faults", {}),
        "tool_descriptions": case.get("tool_descriptions", {}),
    }
    if "attachment" in case:
        fixture["attachment"] = case["attachment"]
    return {
        "title": case["title"],
        "messages": case["messages"],
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
    lists is kept: past eval runs refer to it. Returns the suite and whether it is new."""
    with transaction.atomic():
        suite, created = EvalSuite.objects.update_or_create(
            tenant=None,
            key=document["key"],
            defaults={
                "name": document["name"],
                "kind": document["kind"],
                "description": document.get("description", ""),
                "skill_name": document["skill"],
            },
        )
        projects = document.get("projects", {})
        for case in document["cases"]:
            EvalCase.objects.update_or_create(
                suite=suite, key=case["key"], defaults=_case_fields(case, projects)
            )
    return suite, created


def suites_install() -> list[tuple[EvalSuite, bool]]:
    return [
        suite_install(yaml.safe_load(path.read_text())) for path in sorted(SUITES.glob("*.yaml"))
    ]
