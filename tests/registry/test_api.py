"""The registry API: tokens, tenant isolation, the permission matrix, lifecycle commands,
filters, pagination and the error body of DESIGN.md."""

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings

from config.api import Pagination
from registry.choices import Risk, Role, VersionStatus
from registry.models import ApiToken, Membership, Skill, SkillVersion, Tool, ToolVersion
from registry.services import skills, tenancy, tools
from runs.api.throttles import PasswordTries
from tests.conftest import TEST_HANDLER_MODULES
from tests.registry.factories import PASSWORD, UserFactory, skill_content, tool_content

TOKEN_URL = "/api/v1/auth/token/"
TOOLS = "/api/v1/tools"
SKILLS = "/api/v1/skills"
KINDS = ("tools", "skills")
COMMANDS = ("publish", "deprecate", "revoke", "rollback")
ENDPOINTS = ("list", "detail", "create", *COMMANDS)
# Queries of one list request, whatever the number of rows (measured: 9 and 12). Tools: the
# token, three role checks, two content types and the tenant's guardian grants, the count, the
# page. Skills add the prefetch of pins, their tool versions and tools.
TOOLS_LIST_QUERIES = 9
SKILLS_LIST_QUERIES = 12


# --- helpers -------------------------------------------------------------------------------


def _create_body(kind: str, **overrides) -> dict:
    if kind == "tools":
        return {"name": "web_lookup", "version": "1.0.0", **tool_content(), **overrides}
    return {"name": "incident-review", "version": "1.0.0", **skill_content(), **overrides}


def _call(client, kind: str, endpoint: str, version=None, body=None):
    """One request to a registry endpoint of `kind` ("tools" or "skills")."""
    base = f"/api/v1/{kind}"
    if endpoint == "list":
        return client.get(base)
    if endpoint == "detail":
        return client.get(f"{base}/{version.pk}")
    if endpoint == "create":
        return client.post(base, body if body is not None else _create_body(kind), format="json")
    return client.post(f"{base}/{version.pk}/{endpoint}", body or {}, format="json")


def _registry_state() -> dict:
    """Every version's status and every definition's current version, to prove nothing moved."""
    return {
        "tool_versions": sorted(ToolVersion.objects.values_list("id", "status")),
        "skill_versions": sorted(SkillVersion.objects.values_list("id", "status")),
        "tools": sorted(Tool.objects.values_list("id", "current_version_id")),
        "skills": sorted(Skill.objects.values_list("id", "current_version_id")),
    }


def _error(response) -> dict:
    return response.json()["error"]


def _versions(response) -> list[tuple[str, str]]:
    """(name, version) of each listed result, in the order given."""
    results = response.json()["results"]
    return [
        ((result.get("tool") or result.get("skill"))["name"], result["version"])
        for result in results
    ]


def _publish_tool(make_tool_version, publisher, **kwargs) -> ToolVersion:
    version = make_tool_version(**kwargs)
    return tools.tool_version_publish(tool_version=version, actor=publisher)


def _publish_skill(make_skill_version, publisher, **kwargs) -> SkillVersion:
    version = make_skill_version(**kwargs)
    return skills.skill_version_publish(skill_version=version, actor=publisher)


@pytest.fixture
def catalog(publisher, make_tool_version, make_skill_version):
    """Acme owns, for tools and for skills alike, a published 1.0.0 and a draft 2.0.0."""
    return {
        "tools": {
            "published": _publish_tool(make_tool_version, publisher, version="1.0.0"),
            "draft": make_tool_version(version="2.0.0"),
        },
        "skills": {
            "published": _publish_skill(make_skill_version, publisher, version="1.0.0"),
            "draft": make_skill_version(version="2.0.0"),
        },
    }


# --- POST /api/v1/auth/token/ --------------------------------------------------------------


def test_token_is_issued_for_the_only_tenant_of_a_user(api, member):
    # given alice, a member of acme only
    # when she exchanges her password for a token
    before = datetime.now(UTC)
    response = api.post(TOKEN_URL, {"username": "alice", "password": PASSWORD}, format="json")

    # then she gets a key acting in acme, expiring after the configured lifetime
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"token", "tenant", "expires_at"}
    assert body["tenant"] == "acme"
    assert body["token"].startswith("agt_")
    lifetime = timedelta(hours=settings.API_TOKEN_TTL_HOURS)
    expires_at = datetime.fromisoformat(body["expires_at"])
    assert before + lifetime <= expires_at <= datetime.now(UTC) + lifetime
    token = ApiToken.objects.get()
    assert (token.user, token.tenant.slug, token.prefix) == (member, "acme", body["token"][:8])
    # and the key itself works
    api.credentials(HTTP_AUTHORIZATION=f"Token {body['token']}")
    assert api.get(TOOLS).status_code == 200


def test_the_answer_carrying_a_token_is_never_cached(api, member):
    # when alice exchanges her password for a token
    response = api.post(TOKEN_URL, {"username": "alice", "password": PASSWORD}, format="json")

    # then neither her browser nor a proxy on the way keeps the answer, which holds the key
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    assert "private" in response["Cache-Control"]


@pytest.mark.parametrize("debug", [False, True])
def test_a_token_is_issued_at_the_path_without_its_slash_too(api, member, settings, debug):
    settings.DEBUG = debug

    response = api.post(
        TOKEN_URL.rstrip("/"), {"username": "alice", "password": PASSWORD}, format="json"
    )

    assert response.status_code == 200, response.content
    assert response.json()["tenant"] == "acme"


def test_token_with_a_wrong_password_is_refused(api, member):
    response = api.post(TOKEN_URL, {"username": "alice", "password": "wrong"}, format="json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "Unable to log in with the provided credentials.",
            "details": {"non_field_errors": ["Invalid username or password."]},
        }
    }
    assert ApiToken.objects.count() == 0


def test_token_request_with_an_unknown_field_is_refused(api, member):
    response = api.post(
        TOKEN_URL,
        {"username": "alice", "password": PASSWORD, "scope": "admin"},
        format="json",
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {"scope": ["Unknown field."]}
    assert ApiToken.objects.count() == 0


def test_token_for_a_user_in_two_tenants_must_name_the_tenant(
    api, acme, globex, publisher, globex_publisher, make_tool_version
):
    # given frank, a member of acme and of globex, and one published tool in each tenant
    frank = UserFactory(username="frank")
    tenancy.membership_add(actor=None, user=frank, tenant=acme, role=Role.MEMBER)
    tenancy.membership_add(actor=None, user=frank, tenant=globex, role=Role.MEMBER)
    _publish_tool(make_tool_version, publisher, name="acme_search")
    _publish_tool(
        make_tool_version,
        globex_publisher,
        name="globex_search",
        actor=globex_publisher,
        tenant=globex,
    )
    credentials = {"username": "frank", "password": PASSWORD}

    # when he asks without naming a tenant
    unnamed = api.post(TOKEN_URL, credentials, format="json")

    # then he is told to name one, and no token exists
    assert unnamed.status_code == 400
    assert unnamed.json() == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "Name the tenant this token acts in.",
            "details": {"tenant": ["Required: you belong to several tenants or none."]},
        }
    }
    assert ApiToken.objects.count() == 0

    # when he names globex
    named = api.post(TOKEN_URL, {**credentials, "tenant": "globex"}, format="json")

    # then the token acts in globex: it sees globex's tool and not acme's
    assert named.status_code == 200
    assert named.json()["tenant"] == "globex"
    api.credentials(HTTP_AUTHORIZATION=f"Token {named.json()['token']}")
    listed = api.get(TOOLS)
    assert listed.status_code == 200
    assert _versions(listed) == [("globex_search", "1.0.0")]


def test_token_for_a_tenant_the_user_is_not_in_is_refused(api, member, globex):
    response = api.post(
        TOKEN_URL, {"username": "alice", "password": PASSWORD, "tenant": "globex"}, format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {"tenant": ["Unknown tenant."]}
    assert ApiToken.objects.count() == 0


def test_token_endpoint_is_throttled_with_retry_after(api, member, monkeypatch):
    # given a rate of two token requests a minute
    monkeypatch.setattr(PasswordTries, "THROTTLE_RATES", {"auth_token": "2/min"})
    credentials = {"username": "alice", "password": PASSWORD}
    first = api.post(TOKEN_URL, credentials, format="json")
    second = api.post(TOKEN_URL, credentials, format="json")

    # when a third arrives within the minute, with correct credentials
    third = api.post(TOKEN_URL, credentials, format="json")

    # then it is refused with 429 and told when to retry; no third token is issued
    assert (first.status_code, second.status_code) == (200, 200)
    assert third.status_code == 429
    assert _error(third)["code"] == "RATE_LIMITED"
    assert _error(third)["details"] == {}
    assert ApiToken.objects.count() == 2
    # the header agrees with the message and never exceeds the throttle's one-minute window
    promised = re.fullmatch(
        r"Request was throttled\. Expected available in (\d+) seconds?\.", _error(third)["message"]
    )
    assert promised is not None, _error(third)["message"]
    assert third["Retry-After"] == promised.group(1)
    assert 1 <= int(third["Retry-After"]) <= 60


def test_asking_what_the_token_exchange_takes_uses_no_password_tries(api, member, monkeypatch):
    # given a rate of two token requests a minute
    monkeypatch.setattr(PasswordTries, "THROTTLE_RATES", {"auth_token": "2/min"})

    # when a client (a browser's CORS preflight) asks what the exchange takes more often than
    # that, and sends methods the exchange does not serve
    described = [api.options(TOKEN_URL).status_code for _ in range(3)]
    unserved = [api.generic(method, TOKEN_URL).status_code for method in ("HEAD", "GET", "PUT")]

    # then it still has its two tries, and only those
    credentials = {"username": "alice", "password": PASSWORD}
    exchanges = [api.post(TOKEN_URL, credentials, format="json").status_code for _ in range(3)]
    assert described == [200] * 3
    assert unserved == [405] * 3
    assert exchanges == [200, 200, 429]


def test_a_forwarded_for_header_of_the_client_s_own_does_not_reset_the_throttle(
    api, member, monkeypatch
):
    # given a client that used up its two token requests of the minute
    monkeypatch.setattr(PasswordTries, "THROTTLE_RATES", {"auth_token": "2/min"})
    wrong = {"username": "alice", "password": "guess"}
    for _ in range(2):
        assert api.post(TOKEN_URL, wrong, format="json").status_code == 400

    # when it claims to be someone else with each further guess
    guesses = [
        api.post(TOKEN_URL, wrong, format="json", HTTP_X_FORWARDED_FOR=f"10.0.0.{n}")
        for n in range(3)
    ]

    # then every guess is throttled: the client is its peer address
    assert [guess.status_code for guess in guesses] == [429] * 3


def test_token_endpoint_default_rate_is_thirty_a_minute(api, db):
    # given the configured rate (AUTH_TOKEN_RATE, 30/min by default)
    assert settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["auth_token"] == "30/min"

    # when 31 requests arrive within a minute (invalid ones count too)
    statuses = [api.post(TOKEN_URL, {}, format="json").status_code for _ in range(31)]

    # then the first 30 are answered and the 31st is throttled
    assert statuses == [400] * 30 + [429]


# --- tenant isolation ----------------------------------------------------------------------


def test_another_tenant_sees_none_of_acmes_private_tools_or_skills(
    api, catalog, globex, globex_member
):
    # given acme's published and draft tools and skills, and erin, a member of globex
    client = api.as_user(globex_member, globex)
    before = _registry_state()

    for kind in KINDS:
        # when erin lists them, then none shows
        listed = client.get(f"/api/v1/{kind}")
        assert listed.status_code == 200
        assert listed.json()["count"] == 0
        assert listed.json()["results"] == []
        for state in ("published", "draft"):
            version = catalog[kind][state]
            # when she asks for one by id, then it does not exist for her
            detail = client.get(f"/api/v1/{kind}/{version.pk}")
            assert detail.status_code == 404
            assert _error(detail)["code"] == "NOT_FOUND"
            # nor can she act on it
            for command in COMMANDS:
                response = client.post(f"/api/v1/{kind}/{version.pk}/{command}", format="json")
                assert response.status_code == 404, (kind, state, command)
                assert _error(response)["code"] == "NOT_FOUND"
    assert _registry_state() == before


def test_filtering_by_name_does_not_reveal_another_tenants_tool(
    api, catalog, globex, globex_member
):
    response = api.as_user(globex_member, globex).get(TOOLS, {"name": "project_search"})

    assert response.status_code == 200
    assert response.json()["count"] == 0


def test_platform_wide_tool_is_visible_to_a_tenant_only_once_granted(
    api, platform_admin, acme, globex, globex_member, member
):
    # given a published platform-wide tool, granted to nobody
    version = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    )
    version = tools.tool_version_publish(tool_version=version, actor=platform_admin)
    client = api.as_user(globex_member, globex)

    # then globex does not see it
    assert client.get(TOOLS).json()["count"] == 0
    assert client.get(f"{TOOLS}/{version.pk}").status_code == 404

    # when a platform admin grants it to globex
    tenancy.definition_grant(actor=platform_admin, definition=version.tool, tenant=globex)

    # then globex sees it, as a platform-wide tool
    listed = client.get(TOOLS)
    assert listed.json()["count"] == 1
    assert listed.json()["results"][0]["tool"] == {
        "id": str(version.tool.pk),
        "name": "web_search",
        "namespace": "core",
        "tenant": None,
    }
    detail = client.get(f"{TOOLS}/{version.pk}")
    assert detail.status_code == 200
    assert detail.json()["id"] == str(version.pk)
    # and acme, which was not granted it, still does not
    assert api.as_user(member, acme).get(TOOLS).json()["count"] == 0

    # when the grant is withdrawn, then globex loses it again
    tenancy.definition_grant(
        actor=platform_admin, definition=version.tool, tenant=globex, granted=False
    )
    client = api.as_user(globex_member, globex)
    assert client.get(TOOLS).json()["count"] == 0
    assert client.get(f"{TOOLS}/{version.pk}").status_code == 404


@pytest.mark.parametrize("role", ["publisher", "auditor"])
def test_a_platform_wide_tool_s_draft_is_not_shown_to_a_granted_tenant(
    api, platform_admin, acme, request, role
):
    # given a platform-wide tool granted to acme, 1.0.0 published and 2.0.0 still a draft
    published = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    )
    published = tools.tool_version_publish(tool_version=published, actor=platform_admin)
    draft = tools.tool_version_create(
        actor=platform_admin,
        tenant=None,
        name="web_search",
        version="2.0.0",
        **tool_content(description="Calls the new crawler; not ready."),
    )
    tenancy.definition_grant(actor=platform_admin, definition=published.tool, tenant=acme)
    client = api.as_user(request.getfixturevalue(role), acme)

    # then acme's publishers and auditors, who see acme's own drafts, see the released
    # version only: the draft is the platform's unreleased work
    assert _versions(client.get(TOOLS)) == [("web_search", "1.0.0")]
    assert client.get(f"{TOOLS}/{draft.pk}").status_code == 404
    # and a platform admin still sees it
    assert _versions(api.as_user(platform_admin, acme).get(TOOLS)) == [
        ("web_search", "2.0.0"),
        ("web_search", "1.0.0"),
    ]


def test_platform_wide_skill_is_visible_to_a_tenant_only_once_granted(
    api, platform_admin, globex, globex_member
):
    version = skills.skill_version_create(
        actor=platform_admin, tenant=None, name="web-research", version="1.0.0", **skill_content()
    )
    version = skills.skill_version_publish(skill_version=version, actor=platform_admin)
    client = api.as_user(globex_member, globex)
    assert client.get(SKILLS).json()["count"] == 0

    tenancy.definition_grant(actor=platform_admin, definition=version.skill, tenant=globex)

    assert _versions(client.get(SKILLS)) == [("web-research", "1.0.0")]
    assert client.get(f"{SKILLS}/{version.pk}").status_code == 200


# --- permission matrix ---------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_anonymous_is_asked_to_authenticate(api, catalog, kind, endpoint):
    before = _registry_state()

    response = _call(api, kind, endpoint, catalog[kind]["published"])

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert response.json() == {
        "error": {
            "code": "AUTHENTICATION_REQUIRED",
            "message": "Authentication credentials were not provided.",
            "details": {},
        }
    }
    assert _registry_state() == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "authorization",
    ["Token agt_not-a-real-key", "Token", "Token two parts"],
    ids=["unknown-key", "no-key", "malformed"],
)
def test_a_bad_token_is_asked_to_authenticate(api, catalog, kind, authorization):
    api.credentials(HTTP_AUTHORIZATION=authorization)

    response = api.get(f"/api/v1/{kind}")

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert _error(response)["code"] == "AUTHENTICATION_REQUIRED"


@pytest.mark.parametrize(
    "authorization",
    ["Token {key}", "token {key}", "Bearer {key}", "bearer  {key} "],
    ids=["token", "lowercase", "bearer", "bearer-lowercase-spaced"],
)
def test_the_key_authenticates_under_either_scheme(api, member, authorization):
    # given alice's key, sent as a bearer token as most HTTP clients send one
    _, key = tenancy.api_token_issue(username="alice", password=PASSWORD)
    api.credentials(HTTP_AUTHORIZATION=authorization.format(key=key))

    # then it authenticates as the documented "Token" scheme does
    assert api.get(TOOLS).status_code == 200


@pytest.mark.parametrize("field", ["expires_at", "revoked_at"])
def test_an_expired_or_revoked_token_is_asked_to_authenticate(api, member, field):
    client = api.as_user(member)
    ApiToken.objects.update(**{field: datetime.now(UTC) - timedelta(seconds=1)})

    response = client.get(TOOLS)

    assert response.status_code == 401
    assert response.json()["error"] == {
        "code": "AUTHENTICATION_REQUIRED",
        "message": "Invalid or expired token.",
        "details": {},
    }


@pytest.mark.parametrize("state", ["published", "draft"])
@pytest.mark.parametrize("endpoint", ["detail", *COMMANDS])
@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_of_another_tenant_gets_404(
    api, catalog, globex, globex_publisher, kind, endpoint, state
):
    client = api.as_user(globex_publisher, globex)
    before = _registry_state()

    response = _call(client, kind, endpoint, catalog[kind][state])

    assert response.status_code == 404
    assert _error(response)["code"] == "NOT_FOUND"
    assert _registry_state() == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_of_another_tenant_lists_nothing(api, catalog, globex, globex_publisher, kind):
    response = api.as_user(globex_publisher, globex).get(f"/api/v1/{kind}")

    assert response.status_code == 200
    assert response.json() == {"count": 0, "next": None, "previous": None, "results": []}


@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_of_another_tenant_creates_in_its_own_tenant_only(
    api, catalog, globex, globex_publisher, kind
):
    # given acme's project_search / weekly-summary, and gus, a publisher of globex
    name = "project_search" if kind == "tools" else "weekly-summary"
    client = api.as_user(globex_publisher, globex)

    # when he creates a version with the same name
    response = _call(client, kind, "create", body=_create_body(kind, name=name, version="9.0.0"))

    # then it is globex's own definition; acme's is untouched
    assert response.status_code == 201
    created = response.json()["tool" if kind == "tools" else "skill"]
    assert (created["name"], created["tenant"]) == (name, "globex")
    acme_versions = catalog[kind]["published"].parent.versions.values_list("version", flat=True)
    assert sorted(acme_versions) == ["1.0.0", "2.0.0"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_token_whose_membership_was_removed_is_denied(api, catalog, member, kind, endpoint):
    # given alice's token for acme, then her only membership is deleted
    client = api.as_user(member)
    Membership.objects.filter(user=member).delete()
    before = _registry_state()

    response = _call(client, kind, endpoint, catalog[kind]["published"])

    assert response.status_code == 403
    assert response.json() == {
        "error": {
            "code": "PERMISSION_DENIED",
            "message": "You have no role in this tenant.",
            "details": {},
        }
    }
    assert _registry_state() == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_member_reads_published_versions(api, catalog, member, kind):
    client = api.as_user(member)
    published = catalog[kind]["published"]

    listed = _call(client, kind, "list")
    detail = _call(client, kind, "detail", published)

    assert listed.status_code == 200
    assert [result["id"] for result in listed.json()["results"]] == [str(published.pk)]
    assert detail.status_code == 200
    assert detail.json()["id"] == str(published.pk)
    assert detail.json()["status"] == "published"
    assert detail.json()["is_current"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_a_member_may_not_create(api, catalog, member, kind):
    client = api.as_user(member)
    before = _registry_state()

    response = _call(client, kind, "create")

    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_member_may_not_run_lifecycle_commands(api, catalog, member, kind, command):
    # given a version the member can see (so the refusal is about the role, not visibility)
    client = api.as_user(member)
    before = _registry_state()

    response = _call(client, kind, command, catalog[kind]["published"])

    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


@pytest.mark.parametrize("role", ["member", "auditor"])
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_member_or_auditor_may_not_run_lifecycle_commands_whatever_the_body(
    api, catalog, request, kind, command, role
):
    # given a version they can see, and a member or auditor, who may manage no version
    client = api.as_user(request.getfixturevalue(role))
    before = _registry_state()

    # when they post a command with a body that is wrong besides
    response = _call(client, kind, command, catalog[kind]["published"], body={"bogus": 1})

    # then they are told they may not, not what to fix in a body no fix would get in
    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_lifecycle_command_on_another_tenant_s_version_is_404_whatever_the_body(
    api, catalog, globex, globex_publisher, kind, command
):
    before = _registry_state()

    response = _call(
        api.as_user(globex_publisher, globex),
        kind,
        command,
        catalog[kind]["published"],
        body={"bogus": 1},
    )

    assert response.status_code == 404
    assert _error(response)["code"] == "NOT_FOUND"
    assert _registry_state() == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_member_does_not_see_drafts(api, catalog, member, kind):
    client = api.as_user(member)
    draft = catalog[kind]["draft"]

    listed = _call(client, kind, "list")
    detail = _call(client, kind, "detail", draft)

    assert str(draft.pk) not in [result["id"] for result in listed.json()["results"]]
    assert listed.json()["count"] == 1
    assert detail.status_code == 404
    assert _error(detail)["code"] == "NOT_FOUND"


@pytest.mark.parametrize("role", ["publisher", "auditor"])
@pytest.mark.parametrize("kind", KINDS)
def test_publishers_and_auditors_see_drafts(api, catalog, request, kind, role):
    client = api.as_user(request.getfixturevalue(role))
    draft, published = catalog[kind]["draft"], catalog[kind]["published"]

    listed = _call(client, kind, "list")
    detail = _call(client, kind, "detail", draft)

    assert listed.status_code == 200
    assert [result["id"] for result in listed.json()["results"]] == [
        str(draft.pk),
        str(published.pk),
    ]
    assert detail.status_code == 200
    assert (detail.json()["status"], detail.json()["is_current"]) == ("draft", False)


@pytest.mark.parametrize("kind", KINDS)
def test_an_auditor_may_not_create(api, catalog, auditor, kind):
    before = _registry_state()

    response = _call(api.as_user(auditor), kind, "create")

    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


@pytest.mark.parametrize("body", [{}, {"tool_dependencies": ["no_such_tool@1"]}])
@pytest.mark.parametrize("kind", KINDS)
def test_a_member_may_not_create_whatever_the_body(api, catalog, member, kind, body):
    # given a member, who may not create versions at all
    before = _registry_state()

    # when she posts a body that is wrong besides
    response = _call(api.as_user(member), kind, "create", body=body)

    # then she is told she may not create, not what to fix in a body no fix would get in
    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_creates_a_draft(api, catalog, publisher, kind):
    response = _call(api.as_user(publisher), kind, "create")

    assert response.status_code == 201
    body = response.json()
    assert (body["version"], body["status"], body["is_current"]) == ("1.0.0", "draft", False)
    model = ToolVersion if kind == "tools" else SkillVersion
    created = model.objects.get(pk=body["id"])
    assert (created.status, created.parent.tenant.slug, created.created_by) == (
        VersionStatus.DRAFT,
        "acme",
        publisher,
    )


@pytest.mark.parametrize(
    ("command", "target", "status_after"),
    [
        ("publish", "draft", "published"),
        ("deprecate", "published", "deprecated"),
        ("revoke", "published", "revoked"),
        ("rollback", "published", "published"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_runs_lifecycle_commands(
    api, catalog, publisher, kind, command, target, status_after
):
    version = catalog[kind][target]

    response = _call(api.as_user(publisher), kind, command, version)

    assert response.status_code == 200
    assert response.json()["id"] == str(version.pk)
    assert response.json()["status"] == status_after
    version.refresh_from_db()
    assert version.status == status_after


# --- lifecycle -----------------------------------------------------------------------------


def test_publish_makes_the_version_current(api, publisher, make_tool_version):
    first = _publish_tool(make_tool_version, publisher, version="1.0.0")
    draft = make_tool_version(version="1.1.0")
    client = api.as_user(publisher)

    response = client.post(f"{TOOLS}/{draft.pk}/publish", format="json")

    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["is_current"], body["published_by"]) == (
        "published",
        True,
        "dave",
    )
    assert body["published_at"] is not None
    assert client.get(f"{TOOLS}/{first.pk}").json()["is_current"] is False
    assert Tool.objects.get().current_version_id == draft.pk


def test_publish_of_a_version_not_greater_than_a_released_one_is_refused(
    api, publisher, make_tool_version
):
    # given 2.0.0 published and 1.5.0 still a draft
    released = _publish_tool(make_tool_version, publisher, version="2.0.0")
    draft = make_tool_version(version="1.5.0")
    before = _registry_state()

    response = api.as_user(publisher).post(f"{TOOLS}/{draft.pk}/publish", format="json")

    assert response.status_code == 409
    assert _error(response)["code"] == "VERSION_NOT_GREATER"
    assert _error(response)["details"] == {"version": "1.5.0", "existing": ["2.0.0"]}
    assert _registry_state() == before
    assert Tool.objects.get().current_version_id == released.pk


def test_publish_of_an_equal_version_of_a_revoked_release_is_refused(
    api, publisher, make_tool_version, make_skill_version
):
    # given skill 1.0.0 published then revoked; a new draft may not reuse a lower number
    released = _publish_skill(make_skill_version, publisher, version="1.2.0")
    skills.skill_version_revoke(skill_version=released, actor=publisher)
    draft = make_skill_version(version="1.1.0")

    response = api.as_user(publisher).post(f"{SKILLS}/{draft.pk}/publish", format="json")

    assert response.status_code == 409
    assert _error(response)["code"] == "VERSION_NOT_GREATER"
    draft.refresh_from_db()
    assert draft.status == VersionStatus.DRAFT


def test_publish_again_is_a_no_op(api, publisher, make_tool_version):
    version = _publish_tool(make_tool_version, publisher, version="1.0.0")
    published_at = version.published_at
    history = version.history.count()

    response = api.as_user(publisher).post(f"{TOOLS}/{version.pk}/publish", format="json")

    assert response.status_code == 200
    assert (response.json()["status"], response.json()["is_current"]) == ("published", True)
    version.refresh_from_db()
    assert version.published_at == published_at
    assert version.history.count() == history


@pytest.mark.parametrize("kind", KINDS)
def test_deprecate_of_a_draft_is_an_invalid_transition(api, catalog, publisher, kind):
    draft = catalog[kind]["draft"]
    before = _registry_state()

    response = _call(api.as_user(publisher), kind, "deprecate", draft, {"reason": "old"})

    assert response.status_code == 409
    assert _error(response)["code"] == "INVALID_STATUS_TRANSITION"
    assert _error(response)["details"] == {"from": "draft", "to": "deprecated"}
    assert _registry_state() == before


def test_rollback_to_a_draft_is_an_invalid_transition(api, catalog, publisher):
    before = _registry_state()

    response = _call(api.as_user(publisher), "tools", "rollback", catalog["tools"]["draft"])

    assert response.status_code == 409
    assert _error(response)["code"] == "INVALID_STATUS_TRANSITION"
    assert _registry_state() == before


def test_revoke_moves_current_to_the_highest_remaining_published_version(
    api, publisher, make_tool_version
):
    # given 1.1.0 created before 1.0.0, then 1.0.0, 1.1.0 and 2.0.0 published in that order
    v110 = make_tool_version(version="1.1.0")
    v100 = _publish_tool(make_tool_version, publisher, version="1.0.0")
    tools.tool_version_publish(tool_version=v110, actor=publisher)
    v200 = _publish_tool(make_tool_version, publisher, version="2.0.0")
    client = api.as_user(publisher)

    # when the current 2.0.0 is revoked
    response = client.post(f"{TOOLS}/{v200.pk}/revoke", {"reason": "leaks data"}, format="json")

    # then 1.1.0, the highest remaining published version, is current
    assert response.status_code == 200
    assert response.json()["status"] == "revoked"
    assert response.json()["status_reason"] == "leaks data"
    assert response.json()["is_current"] is False
    assert Tool.objects.get().current_version_id == v110.pk
    assert client.get(f"{TOOLS}/{v110.pk}").json()["is_current"] is True
    assert client.get(f"{TOOLS}/{v100.pk}").json()["is_current"] is False


@pytest.mark.parametrize("transition", ["deprecate", "revoke"])
def test_a_long_reason_is_kept_whole_in_the_version_and_its_history(
    api, publisher, make_tool_version, transition
):
    # given a published version and a reason of the longest length the API takes
    version = _publish_tool(make_tool_version, publisher, version="1.0.0")
    reason = "r" * 2000

    # when
    response = api.as_user(publisher).post(
        f"{TOOLS}/{version.pk}/{transition}", {"reason": reason}, format="json"
    )

    # then the version and the history row of the change both say why, in full
    assert response.status_code == 200, response.content
    assert response.json()["status_reason"] == reason
    latest = version.history.latest("history_date")
    assert latest.history_change_reason == f"{response.json()['status']}: {reason}"


def test_revoke_skips_deprecated_versions_when_choosing_the_new_current(
    api, publisher, make_tool_version
):
    v100 = _publish_tool(make_tool_version, publisher, version="1.0.0")
    v110 = _publish_tool(make_tool_version, publisher, version="1.1.0")
    v200 = _publish_tool(make_tool_version, publisher, version="2.0.0")
    client = api.as_user(publisher)
    assert client.post(f"{TOOLS}/{v110.pk}/deprecate", format="json").status_code == 200

    response = client.post(f"{TOOLS}/{v200.pk}/revoke", format="json")

    assert response.status_code == 200
    assert Tool.objects.get().current_version_id == v100.pk


def test_revoke_of_the_only_published_version_leaves_no_current(api, publisher, make_skill_version):
    version = _publish_skill(make_skill_version, publisher, version="1.0.0")

    response = api.as_user(publisher).post(f"{SKILLS}/{version.pk}/revoke", format="json")

    assert response.status_code == 200
    assert response.json()["is_current"] is False
    assert Skill.objects.get().current_version_id is None


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_makes_an_earlier_published_version_current(
    api, publisher, make_tool_version, make_skill_version, kind
):
    # given 1.0.0 and 2.0.0 published; 2.0.0 is current
    if kind == "tools":
        earlier = _publish_tool(make_tool_version, publisher, version="1.0.0")
        later = _publish_tool(make_tool_version, publisher, version="2.0.0")
    else:
        earlier = _publish_skill(make_skill_version, publisher, version="1.0.0")
        later = _publish_skill(make_skill_version, publisher, version="2.0.0")
    client = api.as_user(publisher)

    # when the publisher rolls back to 1.0.0
    response = client.post(f"/api/v1/{kind}/{earlier.pk}/rollback", format="json")

    # then 1.0.0 is current and 2.0.0 stays published, no longer current
    assert response.status_code == 200
    assert (response.json()["status"], response.json()["is_current"]) == ("published", True)
    later_detail = client.get(f"/api/v1/{kind}/{later.pk}").json()
    assert (later_detail["status"], later_detail["is_current"]) == ("published", False)
    earlier.parent.refresh_from_db()
    assert earlier.parent.current_version_id == earlier.pk


def test_create_with_an_invalid_json_schema_is_refused_with_a_readable_message(api, publisher):
    body = _create_body("tools", input_schema={"type": "strin"})

    response = api.as_user(publisher).post(TOOLS, body, format="json")

    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "VALIDATION_ERROR"
    assert error["details"] == {
        "input_schema": [
            "Not a valid JSON Schema (Draft 2020-12) at type: "
            "'strin' is not valid under any of the given schemas"
        ]
    }
    assert (Tool.objects.count(), ToolVersion.objects.count()) == (0, 0)


NOT_AN_OBJECT = ["The input schema must be a JSON object."]
OPEN = 'The input schema must set "additionalProperties": false.'


@pytest.mark.parametrize(
    ("schema", "messages"),
    [
        ([], NOT_AN_OBJECT),
        ("", NOT_AN_OBJECT),
        ({}, ['The input schema must have "type": "object".', OPEN]),
        ({"type": "object", "properties": {"q": {"type": "string"}}}, [OPEN]),
    ],
    ids=["empty-list", "empty-string", "empty-object", "open"],
)
def test_create_with_an_input_schema_that_is_no_closed_object_says_what_it_lacks(
    api, publisher, schema, messages
):
    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {"input_schema": messages}
    assert (Tool.objects.count(), ToolVersion.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    "reference",
    ["http://169.254.169.254/latest/meta-data/", "#/$defs/missing", "#unknown-anchor"],
    ids=["remote", "missing-pointer", "missing-anchor"],
)
def test_create_with_an_input_schema_referring_outside_itself_is_refused(api, publisher, reference):
    schema = {
        "type": "object",
        "properties": {"q": {"$ref": reference}},
        "additionalProperties": False,
    }

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {
        "input_schema": [
            f"A reference must lead to a part of the input schema; these do not: {reference}."
        ]
    }
    assert (Tool.objects.count(), ToolVersion.objects.count()) == (0, 0)


def test_create_with_an_input_schema_holding_a_decimal_past_2_53_is_refused(api, publisher):
    # (before, the draft was created, and PostgreSQL gave 1e20 back as the whole number
    # 100000000000000000000, which RFC 8785 cannot hash: its publish was refused)
    schema = {
        "type": "object",
        "properties": {"amount": {"type": "number", "maximum": 1e20}},
        "additionalProperties": False,
    }

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["details"] == {
        "input_schema": [
            "The input schema holds a number outside the exactly representable range "
            "(integers within ±2^53-1, finite floats); it could not be hashed canonically."
        ]
    }
    assert (Tool.objects.count(), ToolVersion.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("examples", [{"input": "refund order 7", "amount": 1e20}]),
        ("output_contract", {"sections": ["summary"], "max_total": 1.5e300}),
    ],
)
def test_skill_create_holding_a_decimal_past_2_53_is_refused(api, publisher, field, value):
    # (before, the draft was created, and its publish or an eval run of it failed with a
    # server error: PostgreSQL gave the number back whole, and RFC 8785 cannot hash it)
    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", **{field: value}), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {
        field: [
            "Holds a number outside the exactly representable range (integers within "
            "±2^53-1, finite floats); the version could not be hashed canonically."
        ]
    }
    assert (Skill.objects.count(), SkillVersion.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    "properties",
    [
        {"q": {"$ref": "#/properties/q"}},
        {"q": {"$ref": "#/properties/r"}, "r": {"allOf": [{"$ref": "#/properties/q"}]}},
        {"q": {"if": {"$ref": "#/properties/q"}}},
    ],
    ids=["itself", "through-all-of", "through-if"],
)
def test_create_with_an_input_schema_whose_references_loop_is_refused(api, publisher, properties):
    schema = {"type": "object", "properties": properties, "additionalProperties": False}

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {
        "input_schema": [
            "References of the input schema lead back to where they began without descending "
            "into a part of the value; checking arguments would never end."
        ]
    }
    assert (Tool.objects.count(), ToolVersion.objects.count()) == (0, 0)


def test_create_with_an_input_schema_of_a_tree_is_accepted(api, publisher):
    node = {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    }
    schema = {
        "type": "object",
        "$defs": {"node": node},
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "additionalProperties": False,
    }

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 201


def test_create_with_an_input_schema_referring_to_its_own_definitions_is_accepted(api, publisher):
    schema = {
        "type": "object",
        "$defs": {"key": {"type": "string", "pattern": "^[a-z]+$"}},
        "properties": {"q": {"$ref": "#/$defs/key"}},
        "additionalProperties": False,
    }

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", input_schema=schema), format="json"
    )

    assert response.status_code == 201
    assert response.json()["input_schema"] == schema


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("tools", "adapter_config", "x"),
        ("tools", "adapter_config", 1),
        ("tools", "adapter_config", True),
        ("tools", "adapter_config", ["handler"]),
        ("tools", "retry_policy", ""),
        ("tools", "rate_limit", []),
        ("tools", "circuit_breaker", ""),
        ("tools", "result_contract", ["display_name"]),
        ("tools", "result_contract", {"sensitive_fields": "display_name"}),
        ("tools", "timeout_s", "30"),
        ("tools", "timeout_s", 30.0),
        ("tools", "timeout_s", True),
        ("tools", "concurrency_cap", "4"),
        ("skills", "rules", 1),
        ("skills", "rules", True),
    ],
)
def test_create_with_a_field_of_the_wrong_type_is_refused(api, publisher, kind, field, value):
    response = api.as_user(publisher).post(
        f"/api/v1/{kind}", _create_body(kind, **{field: value}), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == [field]
    assert (ToolVersion.objects.count(), SkillVersion.objects.count()) == (0, 0)


def test_a_circuit_breaker_reset_longer_than_a_day_is_refused(api, publisher):
    breaker = {"failure_threshold": 1, "reset_after_s": 10**15}

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", circuit_breaker=breaker), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == ["circuit_breaker"]
    assert ToolVersion.objects.count() == 0


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("rate_limit", {"requests": 5, "per_seconds": 60.0}, "per_seconds"),
        ("rate_limit", {"requests": 5.0, "per_seconds": 60}, "requests"),
        ("circuit_breaker", {"failure_threshold": 3, "reset_after_s": 30.0}, "reset_after_s"),
        ("retry_policy", {"max_attempts": 3.0}, "max_attempts"),
    ],
)
def test_a_limit_s_whole_number_written_as_a_decimal_is_refused(
    api, publisher, field, value, where
):
    # (before, 60.0 passed as an integer and reached Redis as "61.0", which every call of the
    # tool then failed on: "value is not an integer or out of range")
    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", **{field: value}), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["code"] == "VALIDATION_ERROR"
    [message] = _error(response)["details"][field]
    assert message.startswith(f"{where}: ") and "is not of type 'integer'" in message
    assert ToolVersion.objects.count() == 0


@pytest.mark.parametrize(
    "reference",
    [
        "project_search",
        "project_search@",
        "project_search@2..1",
        "project_search@02",
        "/project_search@2",
        "Core/project_search@2",
    ],
)
def test_a_pinned_tool_without_a_well_formed_version_is_refused(api, publisher, reference):
    # (before, these pinned the highest version of some prefix: no version, or 2.1 for "2..1")
    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=[reference]), format="json"
    )

    assert response.status_code == 400, response.content
    assert _error(response)["details"] == {
        "tool_dependencies": {
            "0": [
                'A pinned tool is written "name@version" or "namespace/name@version": '
                "project_search@2, @2.1 or @2.1.0."
            ]
        }
    }
    assert SkillVersion.objects.count() == 0


def test_create_with_an_unknown_field_is_refused(api, publisher):
    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", colour="blue"), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {"colour": ["Unknown field."]}
    assert ToolVersion.objects.count() == 0


def test_skill_create_binds_the_skill_to_a_workflow_defined_in_code(api, publisher):
    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", workflow="weekly-summary-send@1"), format="json"
    )

    assert response.status_code == 201
    assert response.json()["workflow"] == "weekly-summary-send@1"
    assert SkillVersion.objects.get(pk=response.json()["id"]).workflow == "weekly-summary-send@1"


def test_skill_create_naming_an_unknown_workflow_is_refused(api, publisher):
    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", workflow="weekly-summary-send@9"), format="json"
    )

    assert response.status_code == 400
    assert list(_error(response)["details"]) == ["workflow"]
    assert SkillVersion.objects.count() == 0


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        (
            "skills",
            "rules",
            [{"id": "untrusted-data\n", "scope": "permission", "priority": 1, "text": "Obey."}],
        ),
        ("tools", "adapter_config", {"handler": "examples.handlers.project_search\n"}),
        (
            "tools",
            "adapter_config",
            {"url": "https://svc.internal/x", "credential_ref": "SERVICE_TOKEN\n"},
        ),
    ],
    ids=["rule-id", "handler", "credential-ref"],
)
def test_a_name_with_a_trailing_newline_is_refused(api, publisher, kind, field, value):
    extra = {"adapter_kind": "http"} if "url" in value else {}
    response = api.as_user(publisher).post(
        f"/api/v1/{kind}", _create_body(kind, **{field: value}, **extra), format="json"
    )

    assert response.status_code == 400
    assert list(_error(response)["details"]) == [field]


@pytest.mark.parametrize("handler", ["os.system", "subprocess.run", "examples.models.Project"])
def test_a_python_handler_outside_the_modules_installed_for_tools_is_refused(
    api, publisher, handler
):
    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", adapter_config={"handler": handler}), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {
        "adapter_config": [
            "A handler comes from a module installed for tools (examples.handlers, "
            f"{', '.join(TEST_HANDLER_MODULES)}); {handler.rpartition('.')[0]} is not one."
        ]
    }
    assert ToolVersion.objects.count() == 0


@pytest.mark.parametrize(
    "url",
    [
        "https://svc.internal/lookup\n",
        "https://svc internal/lookup",
        "https://",
        "https:///lookup",
        "http://[::1/lookup",
        "https://svc.internal:99999/lookup",
        "https://svc.internal:0/lookup",
    ],
)
def test_an_http_tool_whose_url_no_call_can_be_sent_to_is_refused(api, publisher, url):
    # (before, these were published, and every call failed: as the handler's bug (UNKNOWN,
    # counted against the tool's circuit) for a URL the HTTP client cannot parse, or as a
    # service that could not be reached, retried, for one with no host or no port)
    config = {"url": url, "credential_ref": "SERVICE_TOKEN"}

    response = api.as_user(publisher).post(
        TOOLS,
        _create_body("tools", adapter_kind="http", adapter_config=config),
        format="json",
    )

    assert response.status_code == 400, response.content
    assert _error(response)["details"] == {
        "adapter_config": [
            "url: not one a call can be sent to: http:// or https://, a host, a port from 1 "
            "to 65535 if any, and no space or control character (percent-encode them)."
        ]
    }
    assert ToolVersion.objects.count() == 0


@pytest.mark.parametrize(
    "url",
    ["https://svc.internal:8443/lookup?v=2", "http://10.0.0.7/a%20b", "https://bücher.example/"],
)
def test_an_http_tool_with_a_url_calls_can_be_sent_to_is_created(api, publisher, url):
    response = api.as_user(publisher).post(
        TOOLS,
        _create_body("tools", adapter_kind="http", adapter_config={"url": url}),
        format="json",
    )

    assert response.status_code == 201, response.content
    assert response.json()["adapter_config"] == {"url": url}


def test_create_with_an_unknown_risk_is_refused(api, publisher):
    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", risk="harmless"), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == ["risk"]
    assert ToolVersion.objects.count() == 0


# Credentials as they get pasted: an API key, a bearer token, a password assignment, an AWS
# key id, a JWT, a URL with its password.
PASTED_CREDENTIALS = {
    "api-key": "Use the key sk-proj4f9c2a7e1b8d3f6a0c5e.",
    "bearer": "Send Authorization: Bearer 9f8e7d6c5b4a39281706f5e4.",
    "password": "Sign in with password=Tr0ub4dor3x if asked.",
    "aws-key-id": "The bucket is read with AKIAIOSFODNN7EXAMPLE.",
    "jwt": "Pass eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "url-password": "Records are in postgres://app:s3cretpass@db.internal/prod.",
}
CREDENTIAL_REFUSED = [
    "Holds a credential (a key, a token or a password), which every model call of a run "
    "using this version would send to the provider: remove it."
]


def _holding(field: str, text: str):
    """`text` placed where `field` shows it to the model."""
    if field == "input_schema":
        schema = tool_content()["input_schema"]
        return {
            **schema,
            "properties": {
                name: {**spec, "description": text} for name, spec in schema["properties"].items()
            },
        }
    if field == "rules":
        return [{"id": "evidence-only", "scope": "skill", "priority": 100, "text": text}]
    if field == "examples":
        return [{"input": "weekly status", "output": text}]
    if field == "output_contract":
        return {"sections": ["progress"], "note": text}
    return text


MODEL_VISIBLE_FIELDS = [
    ("tools", "description"),
    ("tools", "when_not_to_use"),
    ("tools", "returns"),
    ("tools", "input_schema"),
    ("skills", "instructions"),
    ("skills", "rules"),
    ("skills", "examples"),
    ("skills", "output_contract"),
]


@pytest.mark.parametrize("credential", PASTED_CREDENTIALS.values(), ids=PASTED_CREDENTIALS)
@pytest.mark.parametrize(("kind", "field"), MODEL_VISIBLE_FIELDS)
def test_create_with_a_credential_in_what_the_model_is_shown_is_refused(
    api, publisher, kind, field, credential
):
    response = api.as_user(publisher).post(
        f"/api/v1/{kind}", _create_body(kind, **{field: _holding(field, credential)}), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {field: CREDENTIAL_REFUSED}
    assert credential not in response.content.decode()
    assert (ToolVersion.objects.count(), SkillVersion.objects.count()) == (0, 0)


@pytest.mark.parametrize(("kind", "field"), MODEL_VISIBLE_FIELDS)
def test_create_with_ordinary_words_about_tokens_and_passwords_is_accepted(
    api, publisher, kind, field
):
    text = (
        "Keep the answer within the token budget; a password reset or an API key request "
        "goes to the service desk, key: see the runbook."
    )

    response = api.as_user(publisher).post(
        f"/api/v1/{kind}", _create_body(kind, **{field: _holding(field, text)}), format="json"
    )

    assert response.status_code == 201, response.json()


@pytest.mark.parametrize("kind", KINDS)
def test_publish_of_a_draft_holding_a_credential_is_refused(
    api, publisher, make_tool_version, make_skill_version, kind
):
    # given a draft stored before credentials were refused, its procedure holding a key
    if kind == "tools":
        draft = make_tool_version()
        ToolVersion.objects.filter(pk=draft.pk).update(description=PASTED_CREDENTIALS["api-key"])
        field = "description"
    else:
        draft = make_skill_version()
        SkillVersion.objects.filter(pk=draft.pk).update(instructions=PASTED_CREDENTIALS["api-key"])
        field = "instructions"
    before = _registry_state()

    # when it is published
    response = api.as_user(publisher).post(f"/api/v1/{kind}/{draft.pk}/publish", format="json")

    # then it is refused, naming the field; it stays a draft and nothing becomes current
    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {field: CREDENTIAL_REFUSED}
    assert _registry_state() == before


def test_skill_create_pins_the_highest_published_version_of_a_major(
    api, publisher, make_tool_version
):
    # given project_search 1.0.0, 1.2.0 and 2.0.0 published, and 1.3.0 a draft
    _publish_tool(make_tool_version, publisher, version="1.0.0")
    v120 = _publish_tool(make_tool_version, publisher, version="1.2.0")
    _publish_tool(make_tool_version, publisher, version="2.0.0")
    make_tool_version(version="1.3.0")

    # when a skill pins "project_search@1"
    response = api.as_user(publisher).post(
        SKILLS,
        _create_body("skills", tool_dependencies=["project_search@1"]),
        format="json",
    )

    # then it pins 1.2.0 exactly
    assert response.status_code == 201
    assert response.json()["tool_dependencies"] == [
        {"id": str(v120.pk), "name": "project_search", "version": "1.2.0", "status": "published"}
    ]
    skill_version = SkillVersion.objects.get(pk=response.json()["id"])
    assert [d.tool_version_id for d in skill_version.tool_dependencies.all()] == [v120.pk]


@pytest.mark.parametrize(
    ("reference", "pinned"),
    [("project_search@2", "2.0.0"), ("project_search@2.1.0-rc.1", "2.1.0-rc.1")],
)
def test_a_range_pin_never_pins_a_pre_release(api, publisher, make_tool_version, reference, pinned):
    # given project_search 2.0.0 published, then 2.1.0-rc.1 published (and made current)
    _publish_tool(make_tool_version, publisher, version="2.0.0")
    _publish_tool(make_tool_version, publisher, version="2.1.0-rc.1")

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=[reference]), format="json"
    )

    # then a major pins its highest release; only a pin naming the pre-release whole pins it
    assert response.status_code == 201, response.json()
    assert [pin["version"] for pin in response.json()["tool_dependencies"]] == [pinned]


def test_a_pin_naming_a_tool_of_two_namespaces_is_refused_naming_both(
    api, publisher, make_tool_version
):
    # given acme's web_fetch published in the core and the beta namespaces
    for namespace in ("core", "beta"):
        _publish_tool(make_tool_version, publisher, name="web_fetch", namespace=namespace)
    before = _registry_state()

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=["web_fetch@1"]), format="json"
    )

    # then neither is pinned behind the publisher's back: the pin must name its namespace
    assert response.status_code == 400, response.json()
    message = (
        "'web_fetch@1' names tools of several namespaces: acme/beta/web_fetch, "
        "acme/core/web_fetch; pin one as namespace/name@version."
    )
    assert _error(response)["message"] == message
    assert _error(response)["details"] == {"tool_dependencies": [message]}
    assert _registry_state() == before


@pytest.mark.parametrize("namespace", ["core", "beta"])
def test_a_pin_names_the_namespace_of_its_tool(api, publisher, make_tool_version, namespace):
    # given acme's web_fetch published in the core and the beta namespaces
    published = {
        name: _publish_tool(make_tool_version, publisher, name="web_fetch", namespace=name)
        for name in ("core", "beta")
    }

    response = api.as_user(publisher).post(
        SKILLS,
        _create_body("skills", tool_dependencies=[f"{namespace}/web_fetch@1"]),
        format="json",
    )

    # then the tool of that namespace is pinned
    assert response.status_code == 201, response.json()
    assert [pin["id"] for pin in response.json()["tool_dependencies"]] == [
        str(published[namespace].pk)
    ]


def test_a_range_pin_matching_only_a_pre_release_is_refused(api, publisher, make_tool_version):
    # given project_search 2.0.0 and 2.1.0-rc.1 published: 2.1 has no release yet
    _publish_tool(make_tool_version, publisher, version="2.0.0")
    _publish_tool(make_tool_version, publisher, version="2.1.0-rc.1")
    before = _registry_state()

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=["project_search@2.1"]), format="json"
    )

    # then the pin is refused, not bound to the release candidate
    assert response.status_code == 400, response.json()
    assert _error(response)["details"] == {
        "tool_dependencies": [
            "No published version of acme/core/project_search matches 'project_search@2.1'."
        ]
    }
    assert _registry_state() == before


@pytest.mark.parametrize(
    ("reference", "pinned"),
    [
        ("project_search@2.1.0", "2.1.0+build.7"),
        ("project_search@2.1.0+build.7", "2.1.0+build.7"),
        ("project_search@2.2.0-rc.1", "2.2.0-rc.1"),
    ],
)
def test_skill_create_pins_the_version_a_whole_version_names(
    api, publisher, make_tool_version, reference, pinned
):
    # given project_search 2.1.0 published with build metadata, then 2.2.0-rc.1
    _publish_tool(make_tool_version, publisher, version="2.1.0+build.7")
    _publish_tool(make_tool_version, publisher, version="2.2.0-rc.1")

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=[reference]), format="json"
    )

    # then the version of that precedence is pinned (build metadata names no other version)
    assert response.status_code == 201, response.json()
    assert [pin["version"] for pin in response.json()["tool_dependencies"]] == [pinned]


@pytest.mark.parametrize("reference", ["project_search@2.2.0-rc", "project_search@2.1.0+build.8"])
def test_skill_create_pinning_a_version_no_published_one_is_refused(
    api, publisher, make_tool_version, reference
):
    # given project_search 2.1.0+build.7 and 2.2.0-rc.1 published
    _publish_tool(make_tool_version, publisher, version="2.1.0+build.7")
    _publish_tool(make_tool_version, publisher, version="2.2.0-rc.1")
    before = _registry_state()

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=[reference]), format="json"
    )

    # then neither is pinned in place of the version named
    assert response.status_code == 400
    assert _error(response)["details"] == {
        "tool_dependencies": [
            f"No published version of acme/core/project_search matches '{reference}'."
        ]
    }
    assert _registry_state() == before


@pytest.mark.parametrize(
    "reference",
    ["project_search@2", "nowhere@1", "globex_only@1"],
    ids=["draft-only", "unknown-tool", "other-tenants-tool"],
)
def test_skill_create_with_an_unresolvable_pin_is_a_validation_error(
    api, publisher, globex, globex_publisher, make_tool_version, reference
):
    # given project_search 1.0.0 published, 2.0.0 a draft, and a tool published by globex
    _publish_tool(make_tool_version, publisher, version="1.0.0")
    make_tool_version(version="2.0.0")
    _publish_tool(
        make_tool_version,
        globex_publisher,
        name="globex_only",
        actor=globex_publisher,
        tenant=globex,
    )
    before = _registry_state()

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=[reference]), format="json"
    )

    # then the body is invalid (400), not the URL (404); nothing is created
    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert "tool_dependencies" in _error(response)["details"]
    assert _registry_state() == before


def test_skill_publish_with_a_revoked_pinned_tool_is_refused(api, publisher, make_tool_version):
    # given a draft skill pinning project_search 1.0.0, which then gets revoked
    pinned = _publish_tool(make_tool_version, publisher, version="1.0.0")
    client = api.as_user(publisher)
    created = client.post(
        SKILLS, _create_body("skills", tool_dependencies=["project_search@1.0.0"]), format="json"
    )
    assert created.status_code == 201
    revoked = client.post(f"{TOOLS}/{pinned.pk}/revoke", {"reason": "broken"}, format="json")
    assert revoked.status_code == 200
    before = _registry_state()

    # when the skill is published
    response = client.post(f"{SKILLS}/{created.json()['id']}/publish", format="json")

    # then it is refused, naming the unusable pin; the skill stays a draft
    assert response.status_code == 409
    assert _error(response)["code"] == "DEPENDENCY_UNAVAILABLE"
    assert _error(response)["details"] == {
        "tool_dependencies": {"project_search@1.0.0": "is revoked, not published"}
    }
    assert _registry_state() == before


def test_create_of_an_existing_version_number_is_a_validation_error(
    api, publisher, make_tool_version
):
    make_tool_version(version="1.0.0")
    before = _registry_state()

    response = api.as_user(publisher).post(
        TOOLS, _create_body("tools", name="project_search", version="1.0.0"), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _registry_state() == before


@pytest.mark.parametrize(
    "references",
    [
        ["project_search@1.0.0", "project_search@1.1.0"],
        ["project_search@1.0.0", "project_search@1.0.0"],
    ],
    ids=["two-versions", "one-version-twice"],
)
def test_skill_create_pinning_one_tool_twice_is_a_validation_error(
    api, publisher, make_tool_version, references
):
    _publish_tool(make_tool_version, publisher, version="1.0.0")
    _publish_tool(make_tool_version, publisher, version="1.1.0")
    before = _registry_state()

    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=references), format="json"
    )

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {"tool_dependencies": ["The same tool is pinned twice."]}
    assert _registry_state() == before


def test_skill_create_pinning_more_tools_than_a_skill_may_is_refused(api, publisher):
    before = _registry_state()

    # when a skill pins 33 tools
    references = [f"tool_{index}@1" for index in range(33)]
    response = api.as_user(publisher).post(
        SKILLS, _create_body("skills", tool_dependencies=references), format="json"
    )

    # then it is refused for their number, not one by one
    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {
        "tool_dependencies": ["Ensure this field has no more than 32 elements."]
    }
    assert _registry_state() == before


@pytest.mark.parametrize("body", [{}, {"bogus": 1}])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_tenant_granted_a_platform_tool_may_use_but_not_manage_it(
    api, platform_admin, globex, globex_publisher, command, body
):
    # given a published platform-wide tool granted to globex
    version = tools.tool_version_create(
        actor=platform_admin, tenant=None, name="web_search", version="1.0.0", **tool_content()
    )
    version = tools.tool_version_publish(tool_version=version, actor=platform_admin)
    tenancy.definition_grant(actor=platform_admin, definition=version.tool, tenant=globex)
    client = api.as_user(globex_publisher, globex)
    assert client.get(f"{TOOLS}/{version.pk}").status_code == 200
    before = _registry_state()

    # when globex's publisher runs a lifecycle command on it, with a body wrong or not
    response = client.post(f"{TOOLS}/{version.pk}/{command}", body, format="json")

    # then only platform admins manage platform-wide tools
    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _registry_state() == before


def test_a_token_of_a_deactivated_tenant_is_asked_to_authenticate(api, acme, member):
    client = api.as_user(member)
    acme.is_active = False
    acme.save()

    response = client.get(TOOLS)

    assert response.status_code == 401
    assert _error(response)["code"] == "AUTHENTICATION_REQUIRED"


def test_a_token_issued_before_its_user_s_password_changed_is_asked_to_authenticate(api, member):
    # given alice's token, then her password is changed (she fears it was seen)
    client = api.as_user(member)
    member.set_password("a new password, never seen")
    member.save()

    # when the token is used
    response = client.get(TOOLS)

    # then it no longer authenticates, and says why
    assert response.status_code == 401
    assert response.json()["error"] == {
        "code": "AUTHENTICATION_REQUIRED",
        "message": "The password changed after this token was issued; ask for a new token.",
        "details": {},
    }
    # and a token exchanged for the new password works
    fresh = api.post(
        TOKEN_URL,
        {"username": "alice", "password": "a new password, never seen"},
        format="json",
    )
    api.credentials(HTTP_AUTHORIZATION=f"Token {fresh.json()['token']}")
    assert api.get(TOOLS).status_code == 200


def test_a_token_outlives_its_user_signing_in_and_other_changes_to_the_user(client, api, member):
    # given alice's token
    token_client = api.as_user(member)

    # when she signs in on the pages (her last sign-in is recorded) and her e-mail changes
    assert client.post("/accounts/login/", {"username": "alice", "password": PASSWORD}).status_code
    member.refresh_from_db()
    member.email = "alice@new.example"
    member.save()

    # then the token still authenticates
    assert token_client.get(TOOLS).status_code == 200


def test_lifecycle_command_with_an_unknown_field_is_refused(api, catalog, publisher):
    version = catalog["tools"]["published"]
    before = _registry_state()

    response = api.as_user(publisher).post(
        f"{TOOLS}/{version.pk}/deprecate", {"why": "old"}, format="json"
    )

    assert response.status_code == 400
    assert _error(response)["details"] == {"why": ["Unknown field."]}
    assert _registry_state() == before


@pytest.mark.parametrize(
    ("kind", "command", "version", "body", "field"),
    [
        ("tools", "publish", "draft", {"reason": "ready"}, "reason"),
        ("skills", "publish", "draft", {"override_reason": 1}, "override_reason"),
        ("tools", "rollback", "published", {"to": "1.0.0"}, "to"),
        ("tools", "deprecate", "published", {"reason": 1}, "reason"),
    ],
)
def test_a_command_body_with_a_field_it_does_not_take_or_of_the_wrong_type_is_refused(
    api, catalog, publisher, kind, command, version, body, field
):
    before = _registry_state()

    response = api.as_user(publisher).post(
        f"/api/v1/{kind}/{catalog[kind][version].pk}/{command}", body, format="json"
    )

    assert response.status_code == 400, response.content
    assert list(_error(response)["details"]) == [field]
    assert _registry_state() == before


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("tools", "description", 1),
        ("tools", "is_idempotent", 1),
        ("tools", "namespace", 7),
        ("skills", "instructions", 1),
        ("skills", "tool_dependencies", [2]),
    ],
)
def test_a_create_with_a_number_where_a_string_or_boolean_belongs_is_refused(
    api, publisher, kind, field, value
):
    response = api.as_user(publisher).post(
        f"/api/v1/{kind}", _create_body(kind, **{field: value}), format="json"
    )

    assert response.status_code == 400, response.content
    assert list(_error(response)["details"]) == [field]
    assert (ToolVersion.objects.count(), SkillVersion.objects.count()) == (0, 0)


# --- filters and pagination ----------------------------------------------------------------


@pytest.fixture
def tool_shelf(publisher, make_tool_version):
    """project_search 1.0.0 published, 2.0.0 draft; mail_send 1.0.0 published (external side
    effect), 1.1.0 deprecated."""
    search_100 = _publish_tool(make_tool_version, publisher, version="1.0.0")
    search_200 = make_tool_version(version="2.0.0")
    mail_100 = _publish_tool(
        make_tool_version, publisher, name="mail_send", risk=Risk.EXTERNAL_SIDE_EFFECT
    )
    mail_110 = _publish_tool(
        make_tool_version,
        publisher,
        name="mail_send",
        version="1.1.0",
        risk=Risk.EXTERNAL_SIDE_EFFECT,
    )
    tools.tool_version_deprecate(tool_version=mail_110, actor=publisher, reason="superseded")
    return search_100, search_200, mail_100, mail_110


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, [("mail_send", "1.1.0"), ("mail_send", "1.0.0"), ("project_search", "2.0.0"),
              ("project_search", "1.0.0")]),
        ({"name": "project_search"}, [("project_search", "2.0.0"), ("project_search", "1.0.0")]),
        ({"name": "project"}, []),
        ({"status": "draft"}, [("project_search", "2.0.0")]),
        ({"status": "deprecated"}, [("mail_send", "1.1.0")]),
        ({"status": ["published", "deprecated"]},
         [("mail_send", "1.1.0"), ("mail_send", "1.0.0"), ("project_search", "1.0.0")]),
        ({"risk": "external_side_effect"}, [("mail_send", "1.1.0"), ("mail_send", "1.0.0")]),
        ({"risk": "read", "status": "published"}, [("project_search", "1.0.0")]),
    ],
)  # fmt: skip
def test_tools_list_filters(api, publisher, tool_shelf, query, expected):
    response = api.as_user(publisher).get(TOOLS, query)

    assert response.status_code == 200
    assert response.json()["count"] == len(expected)
    assert _versions(response) == expected


@pytest.mark.parametrize("query", [{"status": "live"}, {"risk": "harmless"}])
def test_tools_list_with_an_unknown_choice_is_a_validation_error(api, publisher, tool_shelf, query):
    response = api.as_user(publisher).get(TOOLS, query)

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == list(query)


@pytest.mark.parametrize(
    ("kind", "parameter", "choices"),
    [
        ("tools", "status", VersionStatus),
        ("tools", "risk", Risk),
        ("skills", "status", VersionStatus),
    ],
)
def test_an_unknown_choice_is_refused_naming_the_choices_without_echoing_the_value(
    api, publisher, kind, parameter, choices
):
    response = api.as_user(publisher).get(f"/api/v1/{kind}", {parameter: "x" * 10_000})

    assert response.status_code == 400
    message = f"Not one of the choices: {', '.join(choices.values)}."
    assert _error(response)["details"] == {parameter: [message]}


def test_a_filter_of_tools_given_to_skills_is_refused_rather_than_ignored(api, publisher, catalog):
    response = api.as_user(publisher).get(SKILLS, {"risk": "destructive"})

    assert response.status_code == 400
    assert _error(response) == {
        "code": "VALIDATION_ERROR",
        "message": "Unknown parameters. This list takes: name, namespace, status, page, "
        "page_size, format.",
        "details": {"risk": ["Unknown parameter."]},
    }


def test_skills_list_filters(api, publisher, make_skill_version):
    _publish_skill(make_skill_version, publisher, version="1.0.0")
    make_skill_version(version="1.1.0")
    _publish_skill(make_skill_version, publisher, name="incident-review")
    client = api.as_user(publisher)

    by_name = client.get(SKILLS, {"name": "weekly-summary"})
    by_status = client.get(SKILLS, {"status": "published"})
    by_both = client.get(SKILLS, {"name": "weekly-summary", "status": "draft"})

    assert _versions(by_name) == [("weekly-summary", "1.1.0"), ("weekly-summary", "1.0.0")]
    assert _versions(by_status) == [("incident-review", "1.0.0"), ("weekly-summary", "1.0.0")]
    assert _versions(by_both) == [("weekly-summary", "1.1.0")]
    assert by_both.json()["count"] == 1


def test_tools_list_is_paginated(api, publisher, make_tool_version):
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        make_tool_version(version=version)
    client = api.as_user(publisher)

    first = client.get(TOOLS, {"page_size": 2})

    assert first.status_code == 200
    assert first.json()["count"] == 3
    assert first.json()["previous"] is None
    assert first.json()["next"] == "http://testserver/api/v1/tools?page=2&page_size=2"
    assert _versions(first) == [("project_search", "1.2.0"), ("project_search", "1.1.0")]

    second = client.get(first.json()["next"])

    assert second.json()["count"] == 3
    assert second.json()["next"] is None
    assert second.json()["previous"] == "http://testserver/api/v1/tools?page_size=2"
    assert _versions(second) == [("project_search", "1.0.0")]


@pytest.mark.parametrize("kind", KINDS)
def test_versions_are_listed_highest_precedence_first(
    api, publisher, make_tool_version, make_skill_version, kind
):
    # given versions created in an order that is not their precedence
    make = make_tool_version if kind == "tools" else make_skill_version
    name = "project_search" if kind == "tools" else "weekly-summary"
    for version in ("1.10.0", "1.9.0", "1.10.0-rc.1", "1.10.0-alpha", "2.0.0-rc.1"):
        make(version=version)
    client = api.as_user(publisher)

    # when they are listed, one per page
    pages = [client.get(f"/api/v1/{kind}", {"page_size": 1, "page": page}) for page in range(1, 6)]

    # then by semver precedence, highest first, a pre-release below its release
    assert [version for page in pages for version in _versions(page)] == [
        (name, "2.0.0-rc.1"),
        (name, "1.10.0"),
        (name, "1.10.0-rc.1"),
        (name, "1.10.0-alpha"),
        (name, "1.9.0"),
    ]


def test_skills_list_is_paginated(api, publisher, make_skill_version):
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        make_skill_version(version=version)

    response = api.as_user(publisher).get(SKILLS, {"page_size": 1, "page": 3})

    assert response.json()["count"] == 3
    assert response.json()["next"] is None
    assert _versions(response) == [("weekly-summary", "1.0.0")]


def test_a_page_past_the_end_is_not_found(api, publisher, make_tool_version):
    make_tool_version()

    response = api.as_user(publisher).get(TOOLS, {"page": 5})

    assert response.status_code == 404
    assert _error(response)["code"] == "NOT_FOUND"


@pytest.mark.parametrize("page", ["abc", "0", "000", "-1", "2.5", "", "1\n", ["1", "2"]])
def test_a_page_that_is_not_one_whole_number_is_refused(api, publisher, make_tool_version, page):
    make_tool_version()

    response = api.as_user(publisher).get(TOOLS, {"page": page})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == ["page"]


def test_the_first_page_may_be_asked_for_with_leading_zeros(api, publisher, make_tool_version):
    make_tool_version()

    response = api.as_user(publisher).get(TOOLS, {"page": "01"})

    assert (response.status_code, response.json()["count"]) == (200, 1)


def test_a_page_size_past_the_largest_page_gets_the_largest_page(
    api, publisher, make_tool_version, monkeypatch
):
    monkeypatch.setattr(Pagination, "max_page_size", 2)
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        make_tool_version(version=version)

    for page_size in ("3", "10", "9" * 5000):
        response = api.as_user(publisher).get(TOOLS, {"page_size": page_size})

        assert response.status_code == 200
        assert (response.json()["count"], len(response.json()["results"])) == (3, 2)


@pytest.mark.parametrize("page_size", ["ten", "0", "000", "-1", "2.5", "", "2\n", ["2", "3"]])
def test_a_page_size_that_is_not_one_whole_number_is_refused(
    api, publisher, make_tool_version, page_size
):
    make_tool_version()

    response = api.as_user(publisher).get(TOOLS, {"page_size": page_size})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert list(_error(response)["details"]) == ["page_size"]


# --- error body ----------------------------------------------------------------------------


def _bad_request(api, ctx):
    return api.as_user(ctx["publisher"]).post(TOOLS, {"name": "x"}, format="json")


def _unauthenticated(api, ctx):
    return api.get(TOOLS)


def _forbidden(api, ctx):
    return api.as_user(ctx["member"]).post(TOOLS, _create_body("tools"), format="json")


def _not_found(api, ctx):
    return api.as_user(ctx["member"]).get(f"{TOOLS}/{uuid.uuid4()}")


def _conflict(api, ctx):
    draft = ctx["catalog"]["tools"]["draft"]
    return api.as_user(ctx["publisher"]).post(f"{TOOLS}/{draft.pk}/deprecate", format="json")


def _unsupported_media_type(api, ctx):
    return api.as_user(ctx["publisher"]).post(TOOLS, "name=x", content_type="text/plain")


def _method_not_allowed(api, ctx):
    published = ctx["catalog"]["tools"]["published"]
    return api.as_user(ctx["publisher"]).delete(f"{TOOLS}/{published.pk}")


@pytest.mark.parametrize(
    ("make_request", "status", "code"),
    [
        (_bad_request, 400, "VALIDATION_ERROR"),
        (_unauthenticated, 401, "AUTHENTICATION_REQUIRED"),
        (_forbidden, 403, "PERMISSION_DENIED"),
        (_not_found, 404, "NOT_FOUND"),
        (_conflict, 409, "INVALID_STATUS_TRANSITION"),
        (_method_not_allowed, 405, "METHOD_NOT_ALLOWED"),
        (_unsupported_media_type, 415, "UNSUPPORTED_MEDIA_TYPE"),
    ],
    ids=["400", "401", "403", "404", "409", "405", "415"],
)
def test_every_error_has_the_documented_body(
    api, catalog, member, publisher, make_request, status, code
):
    ctx = {"catalog": catalog, "member": member, "publisher": publisher}
    before = _registry_state()

    response = make_request(api, ctx)

    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    assert sorted(body["error"]) == ["code", "details", "message"]
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"].strip()
    assert isinstance(body["error"]["details"], dict)
    assert _registry_state() == before


def test_method_not_allowed_names_the_method(api, catalog, publisher):
    published = catalog["tools"]["published"]

    response = api.as_user(publisher).delete(f"{TOOLS}/{published.pk}")

    assert response.status_code == 405
    assert response.json() == {
        "error": {
            "code": "METHOD_NOT_ALLOWED",
            "message": 'Method "DELETE" not allowed.',
            "details": {},
        }
    }
    assert ToolVersion.objects.filter(pk=published.pk).exists()


@pytest.mark.parametrize("url", [TOKEN_URL, TOOLS])
def test_malformed_json_is_a_validation_error(api, publisher, url):
    if url == TOOLS:
        api.as_user(publisher)

    response = api.generic("POST", url, '{"name": "x",', content_type="application/json")

    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "VALIDATION_ERROR"
    assert error["message"].startswith("JSON parse error")
    assert error["details"] == {}
    assert (ToolVersion.objects.count(), ApiToken.objects.count()) == (0, 1 if url == TOOLS else 0)


@pytest.mark.parametrize("suffix", ["", "/publish", "/revoke"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_non_uuid_id_is_not_found(api, member, kind, suffix):
    client = api.as_user(member)
    method = client.get if suffix == "" else client.post

    response = method(f"/api/v1/{kind}/not-a-uuid{suffix}")

    assert response.status_code == 404
    assert response.json() == {
        "error": {"code": "NOT_FOUND", "message": "No such version.", "details": {}}
    }


@pytest.mark.parametrize("path", ["/api/v1/nowhere", "/api/v1/tools/1/2/3", "/api/nothing/"])
def test_an_unknown_api_path_answers_a_json_404(api, db, path):
    response = api.get(path)

    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "error": {"code": "NOT_FOUND", "message": "No such resource.", "details": {}}
    }


# --- query count ---------------------------------------------------------------------------


def test_tools_list_runs_a_bounded_number_of_queries(
    api, publisher, make_tool_version, django_assert_max_num_queries
):
    # given 20 versions of 5 tools, some published
    for index in range(5):
        for minor in range(4):
            version = make_tool_version(name=f"tool_{index}", version=f"1.{minor}.0")
            if minor < 2:
                tools.tool_version_publish(tool_version=version, actor=publisher)
    client = api.as_user(publisher)

    # when the publisher lists them, then the queries do not grow with the rows
    with django_assert_max_num_queries(TOOLS_LIST_QUERIES):
        response = client.get(TOOLS)

    assert response.status_code == 200
    assert response.json()["count"] == 20
    assert len(response.json()["results"]) == 20


def test_skills_list_runs_a_bounded_number_of_queries(
    api, publisher, make_tool_version, make_skill_version, django_assert_max_num_queries
):
    pinned = _publish_tool(make_tool_version, publisher, version="1.0.0")
    for index in range(20):
        make_skill_version(name=f"skill-{index}", tool_versions=[pinned])
    client = api.as_user(publisher)

    with django_assert_max_num_queries(SKILLS_LIST_QUERIES):
        response = client.get(SKILLS)

    assert response.json()["count"] == 20
    assert all(len(result["tool_dependencies"]) == 1 for result in response.json()["results"])


@pytest.mark.parametrize("kind", KINDS)
def test_options_describes_the_body_a_create_reads(api, publisher, kind):
    body = _create_body(kind)

    response = api.as_user(publisher).options(f"/api/v1/{kind}")

    assert response.status_code == 200
    post = response.json()["actions"]["POST"]
    assert set(body) <= set(post)
    assert not any(field["read_only"] for field in post.values())
    assert {"id", "status", "is_current", "created_at"}.isdisjoint(post)
    assert post["name"]["required"] is True


def test_options_of_a_command_describes_the_body_it_reads(api, publisher, make_skill_version):
    version = make_skill_version()
    client = api.as_user(publisher)

    publish = client.options(f"/api/v1/skills/{version.pk}/publish").json()
    deprecate = client.options(f"/api/v1/skills/{version.pk}/deprecate").json()
    rollback = client.options(f"/api/v1/skills/{version.pk}/rollback").json()

    assert list(publish["actions"]["POST"]) == ["override_reason"]
    assert list(deprecate["actions"]["POST"]) == ["reason"]
    assert list(rollback["actions"]["POST"]) == ["override_reason"]
