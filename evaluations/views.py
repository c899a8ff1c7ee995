"""Evaluation pages: eval runs of the viewer's tenants, one run's metrics and cases, and two
runs side by side with per-metric deltas, per-case differences and charts."""

from typing import Any
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.decorators import method_decorator
from django.views import View

from evaluations import selectors
from evaluations.choices import LOWER_IS_BETTER, METRIC_DEFINITIONS, Metric
from evaluations.models import EvalRun
from registry.choices import Action
from registry.selectors import tenants_where_user_can
from runs import charts

PAGE_SIZE = 50
# Rates are shown as percentages; the rest as measured.
PERCENT_METRICS = frozenset(Metric.values) - {
    Metric.COST_P50,
    Metric.COST_P95,
    Metric.LATENCY_P50_MS,
    Metric.LATENCY_P95_MS,
}
CHOOSE_TWO = "Choose two eval runs to compare: one as A and one as B."
NOT_FOUND_TO_COMPARE = (
    "No such eval run to compare, or not one you may read: choose two from the list, "
    "one as A and one as B."
)


def _visible(request: HttpRequest):
    if not tenants_where_user_can(
        user=request.user, action=Action.REGISTRY_VIEW_UNPUBLISHED
    ).exists():
        raise PermissionDenied("Only publishers, auditors and admins read evaluations.")
    return selectors.eval_runs_visible(user=request.user)


def _found(visible: QuerySet[EvalRun], eval_run_id: Any) -> EvalRun | None:
    """The visible eval run of this id; None for an id that is not one, or not the viewer's
    to read, alike."""
    try:
        return visible.filter(pk=UUID(str(eval_run_id))).first()
    except ValueError:
        return None


def _eval_run(request: HttpRequest, eval_run_id: Any) -> EvalRun:
    eval_run = _found(_visible(request), eval_run_id)
    if eval_run is None:
        raise Http404("No such eval run.")
    return eval_run


def _plain(value: float, *, sign: str = "") -> str:
    """A measured figure (a cost, milliseconds) to the six places a run's cost is kept, in
    plain digits: `g` wrote a case's cost of 0.00002 as 2e-05."""
    return f"{value:{sign}.6f}".rstrip("0").rstrip(".")


def _shown(metric: str, value: float | None) -> str:
    if value is None:
        return "—"
    if metric in PERCENT_METRICS:
        # A rate that is not whole is never written as one: one injection in 5,000 attacks is
        # not "0.0%", nor one failed case in 2,000 "100.0%".
        shown = f"{value * 100:.1f}%"
        if shown == "0.0%" and value > 0:
            return "<0.1%"
        if shown == "100.0%" and value < 1:
            return ">99.9%"
        return shown
    return _plain(value)


def _metric_rows(*runs: EvalRun) -> list[dict[str, Any]]:
    rows = []
    for metric in Metric:
        values = [run.metrics.get(metric) for run in runs]
        row = {
            "metric": metric.label,
            "definition": METRIC_DEFINITIONS[metric],
            "values": [_shown(metric, value) for value in values],
        }
        if len(values) == 2 and None not in values:
            delta = values[1] - values[0]
            better = delta < 0 if metric in LOWER_IS_BETTER else delta > 0
            row["delta"] = (
                f"{delta * 100:+.1f} pts" if metric in PERCENT_METRICS else _plain(delta, sign="+")
            )
            row["direction"] = "same" if delta == 0 else "better" if better else "worse"
        rows.append(row)
    return rows


@method_decorator(login_required, name="dispatch")
class EvalRunListView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        page = Paginator(_visible(request), PAGE_SIZE).get_page(request.GET.get("page"))
        # Written as on its own page: the template's whole percents wrote 199 of 200 as 100%.
        rows = [
            (eval_run, _shown(Metric.CASE_PASS_RATE, eval_run.metrics.get(Metric.CASE_PASS_RATE)))
            for eval_run in page
        ]
        return render(request, "evaluations/list.html", {"page": page, "rows": rows})


@method_decorator(login_required, name="dispatch")
class EvalRunDetailView(View):
    def get(self, request: HttpRequest, eval_run_id) -> HttpResponse:
        eval_run = _eval_run(request, eval_run_id)
        results = eval_run.results.select_related("case").order_by("case__key")
        return render(
            request,
            "evaluations/detail.html",
            {"eval_run": eval_run, "metrics": _metric_rows(eval_run), "results": results},
        )


@method_decorator(login_required, name="dispatch")
class EvalRunCompareView(View):
    """Two eval runs (`a`, `b`) side by side: usually one suite on two versions or models.
    Asked without two (one chosen on the list, or none), or with one the viewer may not read
    (another tenant's answers as one that does not exist), it sends the viewer back to the
    list, saying to choose two."""

    def get(self, request: HttpRequest) -> HttpResponse:
        visible = _visible(request)
        chosen = [request.GET.get(side) for side in ("a", "b")]
        if not all(chosen):
            messages.error(request, CHOOSE_TWO)
            return redirect("evaluations:list")
        first, second = (_found(visible, eval_run_id) for eval_run_id in chosen)
        if first is None or second is None:
            messages.error(request, NOT_FOUND_TO_COMPARE)
            return redirect("evaluations:list")
        results = {
            side: {result.case.key: result for result in run.results.select_related("case")}
            for side, run in (("a", first), ("b", second))
        }
        cases = []
        for key in sorted(set(results["a"]) | set(results["b"])):
            a, b = results["a"].get(key), results["b"].get(key)
            if a is None or b is None or a.passed != b.passed or a.failures != b.failures:
                cases.append({"key": key, "a": a, "b": b})
        rates = [
            (f"{label} · {metric.label}", round(run.metrics[metric] * 100, 1))
            for metric in Metric
            if metric in PERCENT_METRICS
            for label, run in (("A", first), ("B", second))
            if run.metrics.get(metric) is not None
        ]
        return render(
            request,
            "evaluations/compare.html",
            {
                "a": first,
                "b": second,
                "metrics": _metric_rows(first, second),
                "cases": cases,
                "chart": charts.bars(rates, unit="%"),
            },
        )
