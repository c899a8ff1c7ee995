from rest_framework.routers import SimpleRouter

from approvals.api.views import ApprovalViewSet, HandoffViewSet

router = SimpleRouter(trailing_slash=False)
router.register("approvals", ApprovalViewSet, basename="approval")
router.register("handoffs", HandoffViewSet, basename="handoff")

urlpatterns = router.urls
