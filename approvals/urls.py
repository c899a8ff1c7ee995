from django.urls import path

from approvals.views import ActionView, HandoffQueueView, HandoffView, QueueView

app_name = "approvals"

urlpatterns = [
    path("", QueueView.as_view(), name="queue"),
    path("<uuid:action_id>/", ActionView.as_view(), name="action"),
    path("handoffs/", HandoffQueueView.as_view(), name="handoffs"),
    path("handoffs/<uuid:handoff_id>/", HandoffView.as_view(), name="handoff"),
]
