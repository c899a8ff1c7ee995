from django.urls import path

from evaluations.views import EvalRunCompareView, EvalRunDetailView, EvalRunListView

app_name = "evaluations"

urlpatterns = [
    path("", EvalRunListView.as_view(), name="list"),
    path("compare/", EvalRunCompareView.as_view(), name="compare"),
    path("<uuid:eval_run_id>/", EvalRunDetailView.as_view(), name="detail"),
]
