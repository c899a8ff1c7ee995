from django.urls import path
from rest_framework.routers import SimpleRouter

from runs.api.views import MessageView, RunViewSet

router = SimpleRouter(trailing_slash=False)
router.register("runs", RunViewSet, basename="run")

urlpatterns = [
    path("messages", MessageView.as_view(), name="messages"),
    *router.urls,
]
