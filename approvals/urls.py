from django.urls import path

from approvals.views import ActionView, QueueView

app_name = "approvals"

urlpatterns = [
    path("", QueueView.as_view(), name="queue"),
    path("<uuid:action_id>/", ActionView.as_view(), name="action"),
]
