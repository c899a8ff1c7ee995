from django.urls import path
from rest_framework.routers import SimpleRouter

from registry.api.views import (
    SkillVersionViewSet,
    TokenView,
    TokenWithoutSlashView,
    ToolVersionViewSet,
)

router = SimpleRouter(trailing_slash=False)
router.register("tools", ToolVersionViewSet, basename="tool-version")
router.register("skills", SkillVersionViewSet, basename="skill-version")

urlpatterns = [
    path("auth/token/", TokenView.as_view(), name="auth-token"),
    path("auth/token", TokenWithoutSlashView.as_view()),
    *router.urls,
]
