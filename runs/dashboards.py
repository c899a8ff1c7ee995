"""Figures for the dashboards, per tenant and per skill version: terminal statuses per day,
latency percentiles per stage, the approval wait and acceptance rate, tool error categories
and cost per day. Percentiles are computed by PostgreSQL (`percentile_cont`); the embedded
SQLite default computes them in Python."""

from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import Aggregate, Count, FloatField, Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from approvals.choices import Decision
from runs.choices import TERMINAL_STATUSES
from runs.models import Run, Span, ToolCall


class Percentile(Aggregate):
    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: str, fraction: float, **extra: Any) -> None:
        super().__init__(expression, fraction=fraction, **extra)


@dataclass
class Dashboard:
    days: list[date]
    statuses: dict[str, dict[date, int]] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    approvals: dict[str, Any] = field(default_factory=dict)
    tool_errors: list[tuple[str, int]] = field(default_factory=list)
    cost: dict[date, Decimal] = field(default_factory=dict)


def _percentiles(spans: QuerySet[Span]) -> list[dict[str, Any]]:
    if connection.vendor == "postgresql":
        rows = (
            spans.values("name")
            .annotate(
                count=Count("id"),
                p50=Percentile("duration_ms", 0.5),
                p95=Percentile("duration_ms", 0.95),
            )
            .order_by("name")
        )
        return [
            {**row, "p50": round(row["p50"] or 0), "p95": round(row["p95"] or 0)} for row in rows
        ]
    by_name: dict[str, list[int]] = {}
    for name, duration in spans.values_list("name", "duration_ms"):
        by_name.setdefault(name, []).append(duration)

    def at(values: list[int], fraction: float) -> int:
        ordered = sorted(values)
        return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]

    return [
        {"name": name, "count": len(values), "p50": at(values, 0.5), "p95": at(values, 0.95)}
        for name, values in sorted(by_name.items())
    ]


def _in_window(runs: QuerySet[Run], days: int) -> QuerySet[Run]:
    """The runs of the days the dashboard shows: today and the `days` - 1 before it, whole."""
    first_day = timezone.localdate() - timedelta(days=days - 1)
    return runs.filter(created_at__gte=timezone.make_aware(datetime.combine(first_day, time.min)))


def skills_seen(runs: QuerySet[Run], *, days: int = 14) -> list[str]:
    """The skill versions `runs` (scoped to the viewer and tenant) ran in the last `days`
    days: what the dashboard offers to filter by, read from the window it shows, never the
    whole run history. Each once: the runs' default order (by creation time) is dropped, as
    its column would be selected with the skill and make every run a distinct row."""
    return sorted(
        _in_window(runs, days)
        .exclude(skill="")
        .order_by()
        .values_list("skill", flat=True)
        .distinct()
    )


def dashboard(runs: QuerySet[Run], *, days: int = 14) -> Dashboard:
    """The figures of `runs` (already scoped to the viewer, tenant and skill) of the last
    `days` days."""
    today = timezone.localdate()
    runs = _in_window(runs, days)
    figures = Dashboard(days=[today - timedelta(days=offset) for offset in reversed(range(days))])
    for row in (
        runs.filter(status__in=TERMINAL_STATUSES)
        .annotate(day=TruncDate("created_at"))
        .values("day", "status")
        .annotate(count=Count("id"))
        .order_by()
    ):
        figures.statuses.setdefault(row["status"], {})[row["day"]] = row["count"]
    spans = Span.objects.filter(run__in=runs)
    # The stages a run goes through: not the run's root span, which holds them all and the
    # time a person took to decide, nor that wait (shown with the approvals).
    figures.stages = _percentiles(spans.exclude(parent_span_id="").exclude(name="approval.wait"))
    # An approval that expired has its wait too, but no one decided it.
    decisions = spans.filter(name="approval.wait", attributes__decision__in=Decision.values)
    waits = _percentiles(decisions)
    decided = decisions.aggregate(
        count=Count("id"), accepted=Count("id", filter=Q(attributes__decision=Decision.APPROVE))
    )
    figures.approvals = {
        **decided,
        "rate": round(decided["accepted"] / decided["count"] * 100) if decided["count"] else None,
        "p50_ms": waits[0]["p50"] if waits else None,
        "p95_ms": waits[0]["p95"] if waits else None,
    }
    figures.tool_errors = list(
        ToolCall.objects.filter(run__in=runs)
        .exclude(error_category="")
        .values_list("error_category")
        .annotate(count=Count("id"))
        .order_by("-count", "error_category")
    )
    figures.cost = {
        row["day"]: row["cost"]
        for row in runs.annotate(day=TruncDate("created_at"))
        .values("day")
        .annotate(cost=Sum("cost"))
        .order_by()
    }
    return figures
