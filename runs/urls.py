from django.urls import path

from runs.views import DashboardView, RunDetailView, RunExportView, RunHistoryView, RunStreamView

app_name = "runs"

urlpatterns = [
    path("", RunHistoryView.as_view(), name="history"),
    path("dashboard/", DashboardView.as_view(), name="dashboard"),
    path("<uuid:run_id>/", RunDetailView.as_view(), name="detail"),
    path("<uuid:run_id>/export.json", RunExportView.as_view(), name="export"),
    path("<uuid:run_id>/stream", RunStreamView.as_view(), name="stream"),
]
