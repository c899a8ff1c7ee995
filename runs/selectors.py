"""Reads of the data plane with tenant scope applied: another tenant's run is not found."""

from collections.abc import Iterable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Exists, OuterRef, Q, QuerySet

from config import jsontext
from registry.choices import ABOVE_INTERNAL, DATA_CLASSIFICATION_LEVELS, ROLE_ACTIONS, Action
from registry.models import AgentConfig, Membership, Tenant, ToolVersion
from registry.selectors import tenants_where_user_can, user_can
from runs.models import Attachment, Run, RunEvent, Source, ToolCall
from runs.redaction import sensitive_texts


def runs_visible(*, user: AbstractBaseUser, tenant: Tenant) -> QuerySet[Run]:
    """Every run of the tenant for auditors and admins; one's own runs for everyone else."""
    runs = Run.objects.filter(tenant=tenant)
    if not user_can(user=user, action=Action.RUN_VIEW_ALL, tenant=tenant):
        runs = runs.filter(actor=user)
    return runs


# Roles that may start a run: a run goes on only while its requester holds one of them.
_RUN_ROLES = sorted(role for role, actions in ROLE_ACTIONS.items() if Action.RUN_CREATE in actions)


def requester_standing() -> Q:
    """Whether the run's requester may still start runs in its tenant (`user_can`, as the
    ingress asked): an active tenant, and an active user who is a platform admin or holds a
    role that may. Subqueries, so that a lock on runs takes the run's row alone."""
    active_user = get_user_model().objects.filter(pk=OuterRef("actor_id"), is_active=True)
    return Exists(Tenant.objects.filter(pk=OuterRef("tenant_id"), is_active=True)) & (
        Exists(active_user.filter(is_superuser=True))
        | Exists(
            Membership.objects.filter(
                user_id=OuterRef("actor_id"),
                tenant_id=OuterRef("tenant_id"),
                role__in=_RUN_ROLES,
                user__is_active=True,
            )
        )
    )


def agent_active() -> Exists:
    """Whether the run's agent is still switched on (`AgentConfig.is_active`), as the ingress
    asked; a subquery, so that a lock on runs takes the run's row alone."""
    return Exists(AgentConfig.objects.filter(pk=OuterRef("agent_config_id"), is_active=True))


def run_events(*, run: Run, after_seq: int = 0) -> QuerySet[RunEvent]:
    return RunEvent.objects.filter(run=run, seq__gt=after_seq).order_by("seq")


def attachments_usable(*, user: AbstractBaseUser, tenant: Tenant) -> QuerySet[Attachment]:
    """The attachments a message of `user` in `tenant` may refer to: their own uploads there."""
    return Attachment.objects.filter(tenant=tenant, uploaded_by=user)


def tenants_audited(*, user: AbstractBaseUser) -> dict[int, str]:
    """The tenants (id → slug) where `user` may view every run (auditors, admins)."""
    return dict(
        tenants_where_user_can(user=user, action=Action.RUN_VIEW_ALL).values_list("pk", "slug")
    )


def runs_audited(*, tenant_ids: list[int]) -> QuerySet[Run]:
    """Every run of these tenants (from `tenants_audited`). The ids go into the query as
    values, so the planner walks the (tenant, created_at, id) index instead of sorting the
    tenant's whole history."""
    return Run.objects.filter(tenant_id__in=tenant_ids)


def viewer_cleared(
    *, user: AbstractBaseUser, run: Run, roles: frozenset[str] | None = None
) -> bool:
    """Whether `user` sees `run` unmasked: its requester, or a holder of the clearance in its
    tenant. `roles`: the user's roles there, when the caller has read them."""
    return run.actor_id == user.pk or user_can(
        user=user, action=Action.RUN_VIEW_SENSITIVE, tenant=run.tenant, roles=roles
    )


def contract_sensitive_fields(contract: object) -> frozenset[str]:
    """The fields a result contract marks sensitive. A contract stored before contracts were
    checked may be no object, or name them otherwise: it marks none."""
    names = contract.get("sensitive_fields") if isinstance(contract, dict) else None
    return frozenset(
        name for name in (names if isinstance(names, list) else []) if isinstance(name, str)
    )


def hidden_fields(
    *, run: Run, cleared: bool, contracts: dict[str, frozenset[str]] | None = None
) -> frozenset[str]:
    """What a viewer without clearance does not see wherever it shows in a run (its result,
    its events, its actions): every field the contracts of the tools its snapshot allows
    mark sensitive, as the host copies what a tool returned (a recipient's name) elsewhere;
    the snapshot's, so a stream that began before a call hides its fields too. `contracts`
    keeps what was read by tool version id, for a list of runs to read each version once."""
    if cleared:
        return frozenset()
    contracts = {} if contracts is None else contracts
    ids = [str(entry["id"]) for entry in run.capability.get("tools", []) if "id" in entry]
    if missing := [pk for pk in ids if pk not in contracts]:
        for pk, contract in ToolVersion.objects.filter(pk__in=missing).values_list(
            "pk", "result_contract"
        ):
            contracts[str(pk)] = contract_sensitive_fields(contract)
    return frozenset().union(*(contracts.get(pk, frozenset()) for pk in ids))


def texts_under(result: Any, fields: frozenset[str]) -> set[str]:
    """What a tool's result holds under `fields`, wherever they are in it, as
    `redaction.sensitive_texts`; a result given as text (a source's content) is read as
    JSON, and other text, or JSON nested deeper than a run keeps (`jsontext.loads_bounded`),
    holds none that can be told apart."""
    if isinstance(result, str):
        try:
            result = jsontext.loads_bounded(result)
        except ValueError:
            return set()
    found: set[str] = set()
    if isinstance(result, dict):
        for key, item in result.items():
            found |= sensitive_texts(item) if key in fields else texts_under(item, fields)
    elif isinstance(result, list):
        for item in result:
            found |= texts_under(item, fields)
    return found


def recipient_texts(*, run: Run, fields: frozenset[str]) -> set[str]:
    """What the run's recipient snapshot holds under `fields`: a copy of the directory's
    answer, which a run that reuses the recipient confirmed in its session took from an
    earlier run, with no call of its own that returned it."""
    return texts_under(run.state.get("recipient"), fields) if fields else set()


def memory_hidden(entry: dict[str, Any]) -> bool:
    """Whether a viewer of a run without clearance does not see the value of this item of
    the run's copy of its requester's memory (`services.memory.memory_retrieve`): one kept
    above internal, with the user's consent, or one whose copy names no level (recalled
    before copies named it), which may be either."""
    level = entry.get("sensitivity")
    return level in ABOVE_INTERNAL or level not in DATA_CLASSIFICATION_LEVELS


def recalled_texts(memory: Any, masked: Any = None) -> set[str]:
    """What a run's copy of its requester's memory holds that a viewer without clearance
    does not see (`memory_hidden`), as `redaction.sensitive_texts`: the run's model may copy
    a value anywhere (into a draft's body). `masked`: the texts so of the items that left the
    copy since, deleted by the user (`services.memory.memory_left`), which what the run
    wrote before may still quote."""
    return set().union(
        *(
            sensitive_texts(entry.get("value"))
            for entry in (memory if isinstance(memory, list) else [])
            if isinstance(entry, dict) and memory_hidden(entry)
        ),
        (text for text in (masked if isinstance(masked, list) else []) if isinstance(text, str)),
    )


def hidden_texts(
    *, runs: Iterable[Run], contracts: dict[str, frozenset[str]]
) -> dict[Any, frozenset[str]]:
    """By run id: what a viewer without clearance does not see inside any text of the run
    (`redaction.redact`'s `texts`), as the model or the host may copy it anywhere (a name
    into a draft's body): what the run's tool calls returned under the fields their
    versions' contracts mark sensitive, in their envelopes and in the sources they kept (a
    result too large for its envelope is whole there), and what its recipient snapshot holds
    under the fields its snapshot's tools hide (`recipient_texts`), and what it recalled of
    its requester's memory above internal (`recalled_texts`); and what the earlier runs of
    its session returned or recalled so (`texts_of_earlier_runs`). `contracts`: those fields
    by tool version id, as `hidden_fields` read them for these runs. Four reads for any
    number of runs (one where no version hides a field), and one more where a run's history
    names earlier runs."""
    runs = list(runs)
    texts: dict[Any, set[str]] = {
        run.pk: recalled_texts(run.state.get("memory"), run.state.get("memory_masked"))
        | recipient_texts(
            run=run,
            fields=frozenset().union(
                *(
                    contracts.get(str(entry["id"]), frozenset())
                    for entry in run.capability.get("tools", [])
                    if "id" in entry
                )
            ),
        )
        for run in runs
    }
    versions = [pk for pk, fields in contracts.items() if fields]
    if runs and versions:
        calls = ToolCall.objects.filter(run__in=runs, tool_version_id__in=versions)
        sources = Source.objects.filter(run__in=runs, tool_call__tool_version_id__in=versions)
        for rows in (
            calls.values_list("run_id", "tool_version_id", "envelope"),
            sources.values_list("run_id", "tool_call__tool_version_id", "content"),
        ):
            for run_id, version_id, result in rows:
                texts[run_id] |= texts_under(result, contracts[str(version_id)])
    earlier = texts_of_earlier_runs(runs=runs)
    return {pk: frozenset(found | earlier[pk]) for pk, found in texts.items()}


def texts_of_earlier_runs(*, runs: list[Run]) -> dict[Any, frozenset[str]]:
    """By id of each of `runs`: what the runs of its session begun before it returned under
    the fields their tools' contracts mark sensitive (their calls' envelopes and the sources
    they kept), and what they recalled of their requester's memory above internal
    (`recalled_texts`). A run's history quotes what those runs said back
    (`runs.loop._history`), and its model may copy it further. One read for any number of
    runs, one more where such calls were made, and one more where a run's history names
    earlier runs (read at its start: without one, none of their memory reached it)."""
    if not runs:
        return {}
    sessions = {run.session_id for run in runs}
    quoting = {run.session_id for run in runs if run.state.get("history")}
    before = max(run.created_at for run in runs)
    calls = {
        pk: (session_id, created_at, contract_sensitive_fields(contract), envelope)
        for pk, session_id, created_at, contract, envelope in ToolCall.objects.filter(
            run__session_id__in=sessions,
            run__created_at__lt=before,
            tool_version__result_contract__has_key="sensitive_fields",
        ).values_list(
            "pk", "run__session_id", "run__created_at", "tool_version__result_contract", "envelope"
        )
    }
    results = [(pk, envelope) for pk, (*_, envelope) in calls.items()]
    if calls:
        results += Source.objects.filter(tool_call_id__in=calls).values_list(
            "tool_call_id", "content"
        )
    # (session, when its run began, what it holds) of each result and each recalled memory.
    found: list[tuple[Any, Any, set[str]]] = [
        (calls[call_id][0], calls[call_id][1], texts_under(result, calls[call_id][2]))
        for call_id, result in results
    ]
    if quoting:
        found += [
            (session_id, created_at, recalled_texts(memory, masked))
            for session_id, created_at, memory, masked in Run.objects.filter(
                session_id__in=quoting,
                created_at__lt=before,
                state__has_any_keys=["memory", "memory_masked"],
            ).values_list("session_id", "created_at", "state__memory", "state__memory_masked")
        ]
    of_session: dict[Any, list[Run]] = {}
    for run in runs:
        of_session.setdefault(run.session_id, []).append(run)
    texts: dict[Any, set[str]] = {run.pk: set() for run in runs}
    for session_id, created_at, held in found:
        for run in of_session[session_id]:
            if created_at < run.created_at:
                texts[run.pk] |= held
    return {pk: frozenset(held) for pk, held in texts.items()}


def runs_of_skill(runs: QuerySet[Run], skill: str) -> QuerySet[Run]:
    """The runs of `skill` as a filter names it: `name@version` is that version, a bare name
    every version of the skill (and not another skill whose name begins with it)."""
    if "@" in skill:
        return runs.filter(skill=skill)
    return runs.filter(skill__startswith=f"{skill}@")
