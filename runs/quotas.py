"""Daily cost quotas per tenant, counted in the cache (Redis in production, so every worker
adds to and reads the same figure). The day is the platform's local day (TIME_ZONE: UTC),
which a refusal names. An evaluation sandbox's runs call its tenant's models with its
tenant's credentials: they spend, and are held to, its tenant's quota."""

from datetime import datetime, time, timedelta
from decimal import Decimal

from django.core.cache import cache
from django.utils import timezone

from registry.models import Tenant

MICROS = Decimal(1_000_000)
KEPT_SECONDS = 2 * 24 * 3600


def _key(tenant_id: int) -> str:
    return f"tenant-cost:{tenant_id}:{timezone.localdate().isoformat()}"


def payer_id(tenant: Tenant) -> int:
    """The tenant whose quota the runs of `tenant` spend."""
    return tenant.sandbox_of_id or tenant.pk


def tenant_cost_add(tenant_id: int, cost: Decimal) -> None:
    """Add a model turn's estimated cost to the tenant's spend of today."""
    micros = int(cost * MICROS)
    if micros <= 0:
        return
    key = _key(tenant_id)
    cache.add(key, 0, timeout=KEPT_SECONDS)
    try:
        cache.incr(key, micros)
    except ValueError:
        cache.set(key, micros, timeout=KEPT_SECONDS)


def tenant_cost_today(tenant_id: int) -> Decimal:
    return Decimal(cache.get(_key(tenant_id), 0)) / MICROS


def tenant_quota_spent(tenant: Tenant, *, turn_cost: Decimal = Decimal(0)) -> dict | None:
    """None while the tenant (a sandbox's: its tenant) may still spend today, and would have
    some of its quota left once a model turn's context of `turn_cost` is paid for (an answer
    that costs would pass it otherwise); otherwise what the run's result says. The turn's
    answer is paid for after it, whatever is left: a run may pass the quota by the answer of
    one turn, and runs of the tenant turning at once (each reading the spend before the
    others add to it) may each pass it so."""
    tenant = tenant.registry_owner
    if tenant.daily_cost_quota is None:
        return None
    spent = tenant_cost_today(tenant.pk)
    if spent + turn_cost < tenant.daily_cost_quota:
        return None
    tomorrow = timezone.localdate() + timedelta(days=1)
    zone = timezone.get_current_timezone_name()
    return {
        "reason": f"The tenant's daily model cost quota is spent; it resets at {tomorrow} "
        f"00:00 {zone}.",
        "daily_cost_quota": f"{tenant.daily_cost_quota:.4f}",
        "spent_today": f"{spent:.4f}",
        "resets_on": tomorrow.isoformat(),
        "resets_at": timezone.make_aware(datetime.combine(tomorrow, time.min)).isoformat(),
    }
