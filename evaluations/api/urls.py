from rest_framework.routers import SimpleRouter

from evaluations.api.views import EvalRunViewSet, EvalSuiteViewSet

router = SimpleRouter(trailing_slash=False)
router.register("evaluations/suites", EvalSuiteViewSet, basename="eval-suite")
router.register("evaluations/runs", EvalRunViewSet, basename="eval-run")

urlpatterns = router.urls
