from django.urls import path
from rest_framework.routers import SimpleRouter

from runs.api.views import AttachmentView, MessageView, RunViewSet

router = SimpleRouter(trailing_slash=False)
router.register("runs", RunViewSet, basename="run")

urlpatterns = [
    path("messages", MessageView.as_view(), name="messages"),
    path("attachments", AttachmentView.as_view(), name="attachments"),
    *router.urls,
]
