"""Long-term memory under a written write policy (seed 000, stage 3).

What may be kept:
- an explicit preference the user stated (kind `preference`, origin `user_stated`);
- a fact the user confirmed (kind `fact`, origin `user_confirmed`);
- reusable task state a task keeps (kind `task_state`, origin `task`).

What never is: a model's unconfirmed guess; anything that looks like a secret, a token, a
password or a one-time code (refused, not redacted: a memory with a hole in it misleads);
long text such as an attachment's content; an item above `internal` without the user's consent.
The same key again replaces the value (or, for the same value, only renews it); each kind lives
for its TTL. Retrieval happens only for a task that asks for memory, filtered by tenant, user,
purpose, freshness and sensitivity, and each item keeps its source.

A run keeps what it retrieved at its start in `run.state["memory"]`. An item the user deletes
(or that outlives its TTL) leaves that copy in each of their runs that has not finished: at
once in a run nobody holds (one waiting for approval included; an expired one at the hourly
sweep), and in a run a step holds, from that step's save on; an expired one is not given to
a model turn meanwhile (the copy keeps each item's expiry: `runs.context`). An item the user
renews (expired or not) takes its new expiry in the copy of each of their runs not finished,
in the same two ways. An item the user gives another sensitivity, higher or lower, takes
that level in the copy of each of their runs, finished ones too, and leaves the copy of a
run not finished whose data scope is below it, in the same two ways. Only the run's state
changes: its event log is never edited. A viewer of the run without clearance sees the
value of an item above `internal` masked wherever the run shows it
(`runs.selectors.recalled_texts`), also after the item left the run's copy (`memory_left`).
"""

import re
import unicodedata
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Case, QuerySet, When
from django.utils import timezone

from registry.choices import ABOVE_INTERNAL, DATA_CLASSIFICATION_LEVELS, DataClassification
from registry.errors import NotFound, ValidationFailed
from registry.models import Tenant
from runs.choices import ACTIVE_STATUSES, TERMINAL_STATUSES, RunStatus
from runs.models import MemoryItem, Run
from runs.redaction import SECRET_WORDS_ZH, as_read, names_secret, secrets_removed
from runs.selectors import recalled_texts

ALLOWED_ORIGINS = {
    MemoryItem.Kind.PREFERENCE: {MemoryItem.Origin.USER_STATED, MemoryItem.Origin.USER_CONFIRMED},
    MemoryItem.Kind.FACT: {MemoryItem.Origin.USER_CONFIRMED},
    MemoryItem.Kind.TASK_STATE: {MemoryItem.Origin.TASK},
}
_SECRET_TEXT = re.compile(
    r"\b(pass(word|wd|phrase|code)?s?|pwd|secrets?|token|api[ _-]?keys?|private[ _-]?keys?"
    r"|credentials?|one[ -]?time|otps?|2fa|mfa|verification codes?|security codes?)\b"
    r"|\b\d{6}\b.{0,20}\bcodes?\b|\b(code|pin)s?\b.{0,20}\b\d{4,8}\b|\bpw\s*[:=]",
    re.I | re.S,
)
# The same in Chinese: a password, a passphrase, a one-time or verification code, a token, a
# key, a credential (seed 000 names 一次性口令 and 访问令牌 among what is never kept).
_SECRET_TEXT_ZH = re.compile("|".join(SECRET_WORDS_ZH))


def _refuse(reason: str, message: str) -> ValidationFailed:
    return ValidationFailed(message, details={"reason": reason})


def _looks_secret(text: str) -> bool:
    """Read as NFKC, then as the run's redaction reads text (`runs.redaction.as_read`): a
    Chinese input method in full-width mode types letters, digits and punctuation as their
    full-width forms (U+FF01 to U+FF5E), and a Cyrillic er or a looks like a Latin p or a,
    which the patterns, written in ASCII, would not see; and without format characters (a
    zero-width space, a soft hyphen), which show nothing and would hide a word ("to<U+200B>ken")
    or a code from them."""
    text = as_read(unicodedata.normalize("NFKC", text))
    return bool(
        _SECRET_TEXT.search(text) or _SECRET_TEXT_ZH.search(text) or secrets_removed(text) != text
    )


def _policy_check(
    *, kind: str, key: str, value: str, purpose: str, origin: str, sensitivity: str, consent: bool
):
    if origin == MemoryItem.Origin.MODEL_INFERRED:
        raise _refuse("UNCONFIRMED", "A model's guess is kept only after the user confirms it.")
    if origin not in ALLOWED_ORIGINS.get(kind, set()):
        raise _refuse("ORIGIN_NOT_ALLOWED", f"A {kind} cannot come from {origin}.")
    # The key and the purpose are shown and sent with the value: none of them may hold one.
    if names_secret(key) or any(map(_looks_secret, (f"{key} {value}", key, value, purpose))):
        raise _refuse(
            "SECRET", "Secrets, tokens, passwords and one-time codes are never kept in memory."
        )
    if len(value) > settings.MEMORY_VALUE_MAX_CHARS:
        raise _refuse(
            "TOO_LONG",
            f"At most {settings.MEMORY_VALUE_MAX_CHARS} characters: memory keeps facts and "
            "preferences, never documents or attachment text.",
        )
    if sensitivity not in DATA_CLASSIFICATION_LEVELS:
        raise _refuse("UNKNOWN_SENSITIVITY", f"Unknown sensitivity {sensitivity}.")
    if sensitivity in ABOVE_INTERNAL and not consent:
        raise _refuse("CONSENT_REQUIRED", f"Keeping a {sensitivity} item needs your consent.")


def memory_write(
    *,
    tenant: Tenant,
    user: AbstractBaseUser,
    kind: str,
    key: str,
    value: str,
    origin: str,
    purpose: str | None = None,
    sensitivity: str | None = None,
    consent: bool = False,
    source: dict[str, Any] | None = None,
) -> tuple[MemoryItem, bool]:
    """Keep one item under the write policy, or raise ValidationFailed with the reason.
    Returns it, and whether it is new (not the item of its kind and key, replaced).
    Without a `purpose` or a `sensitivity`, a replaced item keeps its own (never widened
    unasked, which would give it to other tasks, or to runs of a lower data scope); a new
    one is for any purpose, internal."""
    key, value = key.strip(), value.strip()
    now = timezone.now()
    with transaction.atomic():
        # Writes about one user take turns (on the user's own row, which a platform admin
        # without a membership also has), so that two new keys at once cannot both pass the
        # count below. An expired item the hourly sweep has not removed yet is not kept any
        # more: it takes no place, and its key again is a new one.
        get_user_model().objects.select_for_update(no_key=True, of=("self",)).filter(
            pk=user.pk
        ).order_by().values_list("pk").first()
        live = memories_of(tenant=tenant, user=user).filter(expires_at__gt=now)
        # The row of this kind and key, expired or not: the write below renews it.
        existing = (
            memories_of(tenant=tenant, user=user)
            .filter(kind=kind, key=key)
            .values("pk", "purpose", "sensitivity", "expires_at")
            .first()
        )
        replaced = existing if existing and existing["expires_at"] > now else {}
        purpose = purpose or replaced.get("purpose", "any")
        sensitivity = sensitivity or replaced.get("sensitivity", DataClassification.INTERNAL)
        _policy_check(
            kind=kind,
            key=key,
            value=value,
            purpose=purpose,
            origin=origin,
            sensitivity=sensitivity,
            consent=consent,
        )
        if live.count() >= settings.MEMORY_ITEMS_MAX and not replaced:
            raise _refuse(
                "TOO_MANY",
                f"At most {settings.MEMORY_ITEMS_MAX} items are kept about you here: delete "
                "some first, or replace one by its key.",
            )
        fields = {
            "value": value,
            "purpose": purpose,
            "sensitivity": sensitivity,
            "consent_at": now if consent else None,
            "origin": origin,
            "source": source or {},
            "confirmed_at": now,
            "expires_at": now + timedelta(days=settings.MEMORY_TTL_DAYS[kind]),
        }

        def write() -> tuple[MemoryItem, bool]:
            # update_or_create locks an existing row and settles a concurrent insert of the
            # same key.
            return MemoryItem.objects.update_or_create(
                tenant=tenant, user=user, kind=kind, key=key, defaults=fields
            )

        if not existing:
            return write()
        renewed = {"expires_at": fields["expires_at"].isoformat()}
        if sensitivity != existing["sensitivity"]:
            renewed |= {"sensitivity": sensitivity, "value": value}
        return _copies_follow(
            tenant=tenant, user=user, items={str(existing["pk"]): renewed}, change=write
        )


def memories_of(*, tenant: Tenant, user: AbstractBaseUser) -> QuerySet[MemoryItem]:
    """What the platform keeps about `user` in `tenant` (expired items included until the
    sweep removes them), for the user to list and delete."""
    return MemoryItem.objects.filter(tenant=tenant, user=user)


def memory_delete(*, tenant: Tenant, user: AbstractBaseUser, item_id: Any) -> None:
    """Forget one item, and drop it from the copy the user's unfinished runs carry
    (`_copies_follow`)."""

    def delete() -> None:
        deleted, _ = memories_of(tenant=tenant, user=user).filter(pk=item_id).delete()
        if not deleted:
            raise NotFound("No such memory.")

    _copies_follow(tenant=tenant, user=user, items={str(item_id): None}, change=delete)


def _copies_follow(
    *,
    tenant: Tenant,
    user: AbstractBaseUser,
    items: dict[str, dict[str, str] | None],
    change: Callable[[], Any],
) -> Any:
    """Make `change` to the items `items` names by id, in the same transaction as the
    copies of them the user's runs carry follow it (`_copy_followed`): to each its new
    expiry, and its new sensitivity (with its value), higher or lower than its old one
    (which the copies of finished runs take too); or None, no longer kept (which leaves the
    copies of unfinished runs only).

    A run waiting for approval (or finished) is held only for moments (an approval being
    decided, its action starting, its outcome reconciled): it is waited for. It is locked
    before the item, in a step's order (a step locks its run, then, as it saves, the items
    it carries: `memories_kept`): a paused run may be RUNNING by the time it is locked, held
    by a step, and that step then finds the item as it was, keeps it, and the change reaches
    the run after the step. A run a step holds is skipped, not waited for (the step may be
    waiting on a model or a tool): its save waits for this change to commit and follows it."""
    with transaction.atomic():
        leveled = any(item and "sensitivity" in item for item in items.values())
        reached = [*ACTIVE_STATUSES, *(TERMINAL_STATUSES if leveled else [])]
        held_for_moments = [status for status in reached if status not in _STEPPED]
        paused = _runs_carrying(tenant=tenant, user=user, item_ids=items, statuses=held_for_moments)
        runs = Run.objects.filter(status__in=reached).only(
            "pk", "status", "state", "capability", "updated_at"
        )
        waited = list(runs.select_for_update(no_key=True).filter(pk__in=paused).order_by("pk"))
        changed = change()
        # Read again after the change: a run that saved the item meanwhile is found too.
        carrying = _runs_carrying(tenant=tenant, user=user, item_ids=items, statuses=reached)
        skipping = runs.select_for_update(no_key=True, skip_locked=True)
        for run in [*waited, *skipping.filter(pk__in=carrying).exclude(pk__in=paused)]:
            run.state = _copy_followed(
                run.state,
                items,
                scope=_data_scope(run) if run.status in ACTIVE_STATUSES else None,
            )
            # updated_at too: an execution that saved the run before reads it again.
            run.save(update_fields=["state", "updated_at"])
        return changed


# What a step holds: a run in these may wait on a model or a tool.
_STEPPED = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})


def _data_scope(run: Run) -> str:
    return run.capability["data_scope"]["max_data_classification"]


def _runs_carrying(
    *, tenant: Tenant, user: AbstractBaseUser, item_ids: Iterable[str], statuses: Iterable[str]
) -> list[Any]:
    """The ids of the user's runs in `tenant` in one of `statuses` whose copy has one of
    the items, in primary-key order (the order they are locked in)."""
    item_ids = set(item_ids)
    return [
        pk
        for pk, memory in Run.objects.filter(tenant=tenant, actor=user, status__in=statuses)
        .order_by("pk")
        .values_list("pk", "state__memory")
        if isinstance(memory, list)
        and any(isinstance(entry, dict) and entry.get("id") in item_ids for entry in memory)
    ]


def _ranks_above(level: str | None, than: Any) -> bool:
    """Whether `level` is more sensitive than `than`; never for a level a copy does not
    name (recalled before copies named it), which a viewer without clearance never sees."""
    return (
        level in DATA_CLASSIFICATION_LEVELS
        and than in DATA_CLASSIFICATION_LEVELS
        and DATA_CLASSIFICATION_LEVELS.index(level) > DATA_CLASSIFICATION_LEVELS.index(than)
    )


def memory_left(state: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's `state` with its copy of its requester's memory cut to `kept`. What an item
    above internal that leaves it held stays among the texts a viewer without clearance
    sees masked (`runs.selectors.recalled_texts`), for that only, never given to the model:
    the run's events, never edited, and its draft may quote it still."""
    left = [entry for entry in state.get("memory") or [] if entry not in kept]
    masked = set(state.get("memory_masked") or []) | recalled_texts(left)
    return {**state, "memory": kept, **({"memory_masked": sorted(masked)} if masked else {})}


def _copy_followed(
    state: dict[str, Any], items: dict[str, dict[str, str] | None], *, scope: str | None
) -> dict[str, Any]:
    """A run's `state` with each item of its copy that `items` names by id as it is named
    there (its expiry, its level), and leaving the copy when it is None (the item is no
    longer kept) or its level is above `scope`, the run's data scope (None: a finished run,
    whose copy keeps what it was given). A copy takes a higher level always, a lower one
    only while it holds the value the user lowered: an older value stays at the level it was
    kept at."""
    allowed = (
        DATA_CLASSIFICATION_LEVELS[: DATA_CLASSIFICATION_LEVELS.index(scope) + 1]
        if scope
        else DATA_CLASSIFICATION_LEVELS
    )
    memory, kept = [], []
    for entry in state.get("memory") or []:
        if not isinstance(entry, dict):
            continue
        item = items.get(entry.get("id"), {})
        if item is None:
            memory.append(entry)
            continue
        level = item.get("sensitivity")
        if _ranks_above(level, entry.get("sensitivity")) or (
            _ranks_above(entry.get("sensitivity"), level)
            and entry.get("value") == item.get("value")
        ):
            entry = {**entry, "sensitivity": level}
        if "expires_at" in item:
            entry = {**entry, "expires_at": item["expires_at"]}
        memory.append(entry)
        if level is None or level in allowed:
            kept.append(entry)
    return memory_left({**state, "memory": memory}, kept)


def memories_kept(run: Run) -> dict[str, Any]:
    """The state of `run` (its copy as `memory_retrieve` made it) without the items the
    user has deleted since or that outlived their TTL, with those the user raised or lowered
    at their new level (`_copy_followed`; leaving the copy above the run's data scope) and
    each kept one with its expiry as it is now (one the user renewed goes on to the next
    turns), for the step that saves the run: the items stay locked until it commits, so that
    a change either committed before (and is followed here) or waits for the step's save (and
    then reaches the run itself)."""
    if not run.state.get("memory"):
        return run.state
    ids = {entry.get("id") for entry in run.state["memory"] if isinstance(entry, dict)}
    kept = (
        MemoryItem.objects.filter(
            tenant_id=run.tenant_id,
            user_id=run.actor_id,
            pk__in=ids,
            expires_at__gt=timezone.now(),
        )
        .select_for_update(no_key=True)
        .order_by("pk")
    )
    found = {
        str(pk): {"sensitivity": level, "value": value, "expires_at": expires_at.isoformat()}
        for pk, level, value, expires_at in kept.values_list(
            "pk", "sensitivity", "value", "expires_at"
        )
    }
    return _copy_followed(
        run.state,
        {item_id: found.get(item_id) for item_id in ids if isinstance(item_id, str)},
        scope=_data_scope(run),
    )


def memory_retrieve(
    *, tenant: Tenant, user: AbstractBaseUser, purpose: str, max_sensitivity: str
) -> list[dict[str, Any]]:
    """The live items a task may use: this tenant and user, this purpose (or any), not
    expired, not above `max_sensitivity`; each with its source, its sensitivity (a viewer
    of the run without clearance does not see the value of one above internal:
    `runs.selectors.memory_hidden`) and when it expires (a model turn is not given it after
    that, before the sweep or the step's save drops it: `runs.context`). Of more than
    MEMORY_RETRIEVE_MAX, those kept for this purpose come first, then the latest confirmed."""
    allowed = DATA_CLASSIFICATION_LEVELS[: DATA_CLASSIFICATION_LEVELS.index(max_sensitivity) + 1]
    items = memories_of(tenant=tenant, user=user).filter(
        expires_at__gt=timezone.now(),
        purpose__in=[purpose, "any"],
        sensitivity__in=allowed,
    )
    return [
        {
            "id": str(item.pk),
            "kind": item.kind,
            "key": item.key,
            "value": item.value,
            "sensitivity": item.sensitivity,
            "confirmed_at": item.confirmed_at.isoformat(),
            "expires_at": item.expires_at.isoformat(),
            "source": {"origin": item.origin, **item.source},
        }
        for item in sorted(
            items.order_by(
                Case(When(purpose=purpose, then=0), default=1), "-confirmed_at", "kind", "key"
            )[: settings.MEMORY_RETRIEVE_MAX],
            key=lambda item: (item.kind, item.key),
        )
    ]


def memories_expire() -> int:
    """Remove what outlived its TTL, and drop it from the copy its user's unfinished runs
    carry, as a deletion does (`_copies_follow`). Writes about one user take turns with
    `memory_write`, which may renew an expired item: one renewed meanwhile stays."""
    removed = 0
    for tenant_id, user_id in (
        MemoryItem.objects.filter(expires_at__lte=timezone.now())
        .order_by("tenant_id", "user_id")
        .values_list("tenant_id", "user_id")
        .distinct()
    ):
        with transaction.atomic():
            user = get_user_model().objects.select_for_update(no_key=True).get(pk=user_id)
            tenant = Tenant.objects.get(pk=tenant_id)
            expired = memories_of(tenant=tenant, user=user).filter(expires_at__lte=timezone.now())
            removed += _copies_follow(
                tenant=tenant,
                user=user,
                items={str(pk): None for pk in expired.values_list("pk", flat=True)},
                change=lambda expired=expired: expired.delete()[0],
            )
    return removed
