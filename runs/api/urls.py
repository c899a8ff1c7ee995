from django.urls import path
from rest_framework.routers import SimpleRouter

from runs.api.views import AttachmentView, MemoryViewSet, MessageView, RunViewSet

router = SimpleRouter(trailing_slash=False)
router.register("runs", RunViewSet, basename="run")
router.register("memories", MemoryViewSet, basename="memory")

urlpatterns = [
    path("messages", MessageView.as_view(), name="messages"),
    path("attachments", AttachmentView.as_view(), name="attachments"),
    *router.urls,
]
