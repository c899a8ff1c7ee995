from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from registry.errors import ValidationFailed
from registry.models import AgentConfig, ApiToken, ModelConfig, Policy, RolloutFlag, Skill
from registry.services import skills
from registry.services.common import api_tokens_revoke, registry_object_save
from registry.services.tenancy import api_token_issue, definition_grant
from tests.registry.factories import PASSWORD, agent_form_data


@pytest.fixture
def offline_model(db):
    return ModelConfig.objects.create(name="offline", provider="offline", model_name="planner")


def _refused_save(platform_admin, parameters: dict) -> ValidationFailed:
    """What saving a model config with these parameters was refused with."""
    config = ModelConfig(
        name="gpt", provider="openai_compatible", model_name="gpt-x", parameters=parameters
    )
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=platform_admin)
    return refused.value


def test_a_model_config_refuses_secrets_in_its_parameters(platform_admin):
    refused = _refused_save(platform_admin, {"temperature": 0.2, "api_key": "sk-live-123"})

    assert "api_key look like credentials" in refused.details["parameters"][0]
    assert not ModelConfig.objects.exists()


def test_a_model_config_refuses_secrets_nested_in_its_parameters(platform_admin):
    refused = _refused_save(
        platform_admin,
        {
            "extra_headers": {"Authorization": "Bearer sk-proj-0123456789"},
            "extra_body": {"routes": [{"client_secret": "s3cr3t-value"}]},
        },
    )

    assert refused.details["parameters"][0].startswith(
        "extra_body.routes.client_secret, extra_headers.Authorization look like credentials"
    )
    assert not ModelConfig.objects.exists()


@pytest.mark.parametrize("timeout_s", ["abc", -1, 0, True, None, [30]])
def test_a_model_config_refuses_a_timeout_no_call_could_be_made_with(platform_admin, timeout_s):
    # given a timeout every call of the config would be refused for, at each run
    parameters = {"temperature": 0.2, "timeout_s": timeout_s}

    # when it is saved
    refused = _refused_save(platform_admin, parameters)

    # then it is refused, saying what the setting must be
    assert refused.details["parameters"] == [
        f"timeout_s must be a positive number of seconds, not {timeout_s!r}."
    ]
    assert not ModelConfig.objects.exists()


def test_a_model_config_keeps_a_timeout_of_a_positive_number_of_seconds(platform_admin):
    config = ModelConfig(
        name="gpt",
        provider="openai_compatible",
        model_name="gpt-x",
        parameters={"timeout_s": 12.5},
    )

    registry_object_save(instance=config, actor=platform_admin)

    assert ModelConfig.objects.get().parameters == {"timeout_s": 12.5}


def test_a_model_config_refuses_secrets_under_names_written_with_look_alike_letters(
    platform_admin,
):
    # given parameters whose names are written with letters of another script (Cyrillic A,
    # er and a, dze) or with a character that shows nothing (a zero-width non-joiner)
    parameters = {
        "extra_headers": {"\u0410uthorization": "Bearer sk-proj-0123456789"},
        "extra_body": {"\u0440\u0430ssword": "hunter22", "client_\u0455ecret": "s3cr3t"},
        "pass\u200cword": "hunter22",
    }

    # when it is saved
    refused = _refused_save(platform_admin, parameters)

    # then it is refused, naming each as it was typed, and nothing is stored
    assert refused.details["parameters"][0].startswith(
        "extra_body.client_\u0455ecret, extra_body.\u0440\u0430ssword, "
        "extra_headers.\u0410uthorization, pass\u200cword look like credentials"
    )
    assert not ModelConfig.objects.exists()


def test_a_model_config_keeps_parameters_that_only_sound_like_credentials(platform_admin):
    config = ModelConfig(
        name="gemini",
        provider="openai_compatible",
        model_name="gemini-x",
        parameters={"max_output_tokens": 512, "top_k": 40, "thinking": {"budget_tokens": 64}},
    )

    registry_object_save(instance=config, actor=platform_admin)

    assert ModelConfig.objects.get(name="gemini").parameters["max_output_tokens"] == 512


@pytest.mark.parametrize(
    ("base_url", "refusal"),
    [
        ("https://acme:sk-live-123@llm.example/v1", "A URL names no user or password"),
        ("https://llm.example/v1?api_key=sk-live-123", "The query parameter api_key looks like"),
        ("https://llm.example/v1?api-version=2024-06-01", None),
    ],
    ids=["password", "secret-parameter", "plain-parameter"],
)
def test_a_model_config_refuses_a_secret_written_in_its_base_url(platform_admin, base_url, refusal):
    config = ModelConfig(
        name="gpt", provider="openai_compatible", model_name="gpt-x", base_url=base_url
    )

    if refusal is None:
        registry_object_save(instance=config, actor=platform_admin)
        assert ModelConfig.objects.get().base_url == base_url
        return
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=platform_admin)
    assert refused.value.details["base_url"][0].startswith(refusal)
    assert not ModelConfig.objects.exists()


def test_a_credential_reference_is_a_variable_name_not_a_secret(platform_admin):
    config = ModelConfig(
        name="gpt", provider="openai_compatible", model_name="gpt-x", credential_ref="sk-live-1"
    )

    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=platform_admin)

    assert "credential_ref" in refused.value.details


@pytest.mark.parametrize(
    ("tenant", "granted", "refused"),
    [(None, {}, False), ("acme", {"acme": ["ACME_OPENAI_KEY"]}, False), ("acme", {}, True)],
)
def test_a_tenants_model_config_names_only_a_credential_granted_to_the_tenant(
    platform_admin, acme, settings, tenant, granted, refused
):
    # given the credentials the operator granted
    settings.TENANT_CREDENTIALS = granted
    config = ModelConfig(
        tenant=acme if tenant else None,
        name="gpt",
        provider="openai_compatible",
        model_name="gpt-x",
        credential_ref="ACME_OPENAI_KEY",
    )

    # when it is saved
    try:
        registry_object_save(instance=config, actor=platform_admin)
    except ValidationFailed as error:
        details = error.details
    else:
        details = {}

    # then only a tenant's config without the grant is refused (a platform one may name any)
    assert bool(details) is refused
    assert ModelConfig.objects.filter(name="gpt").exists() is not refused
    if refused:
        assert details["credential_ref"] == [
            "The credential ACME_OPENAI_KEY is not granted to tenant acme: the operator grants "
            "it in TENANT_CREDENTIALS."
        ]


def test_a_model_config_records_who_changed_it(platform_admin):
    config = ModelConfig(
        name="gpt",
        provider="openai_compatible",
        model_name="gpt-x",
        base_url="http://127.0.0.1:9000/v1",
        credential_ref="OPENAI_API_KEY",
        price_per_1k_input=Decimal("0.0025"),
    )
    registry_object_save(instance=config, actor=platform_admin, reason="added")

    record = config.history.get()
    assert (record.history_user, record.history_change_reason) == (platform_admin, "added")


def test_an_agent_cannot_use_another_tenants_policy(acme, globex, offline_model, platform_admin):
    foreign_policy = Policy.objects.create(tenant=globex, name="strict")
    agent = AgentConfig(
        tenant=acme, name="reporter", model_config=offline_model, policy=foreign_policy
    )

    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=agent, actor=platform_admin)

    assert set(refused.value.details) == {"policy"}
    assert not AgentConfig.objects.exists()


def test_a_rollout_must_serve_a_published_version_of_its_own_skill(
    make_skill_version, publisher, platform_admin
):
    published = skills.skill_version_publish(
        skill_version=make_skill_version(version="1.0.0"), actor=publisher
    )
    draft = make_skill_version(version="1.1.0")
    other = skills.skill_version_publish(
        skill_version=make_skill_version(name="other-skill"), actor=publisher
    )

    for version, message in [
        (draft, "Only a published version can be rolled out."),
        (other, "This version belongs to another skill."),
    ]:
        flag = RolloutFlag(key="try", skill=published.skill, skill_version=version, percentage=10)
        with pytest.raises(ValidationFailed) as refused:
            registry_object_save(instance=flag, actor=platform_admin)
        assert refused.value.details["skill_version"] == [message]
    assert not RolloutFlag.objects.exists()


def test_a_revoked_token_authenticates_nothing(api, member, acme):
    client = api.as_user(member, acme)
    assert client.get("/api/v1/tools").status_code == 200

    assert api_tokens_revoke(tokens=ApiToken.objects.filter(user=member)) == 1

    response = client.get("/api/v1/tools")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "AUTHENTICATION_REQUIRED"


def test_an_expired_token_authenticates_nothing(api, member, acme):
    token, key = api_token_issue(username=member.username, password=PASSWORD)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")

    assert api.get("/api/v1/tools").status_code == 401


def test_only_a_hash_of_the_token_is_stored(member, acme):
    token, key = api_token_issue(username=member.username, password=PASSWORD)

    stored = ApiToken.objects.filter(pk=token.pk).values().get()
    assert key not in {str(value) for value in stored.values()}
    assert token.prefix == key[:8]


def test_an_agent_is_bound_only_to_its_tenants_skills_or_granted_platform_ones(
    acme, globex, offline_model, platform_admin
):
    policy = Policy.objects.create(tenant=acme, name="default")
    own = Skill.objects.create(tenant=acme, name="weekly-summary")
    foreign = Skill.objects.create(tenant=globex, name="weekly-summary")
    granted = Skill.objects.create(tenant=None, name="triage")
    ungranted = Skill.objects.create(tenant=None, name="escalate")
    definition_grant(actor=platform_admin, definition=granted, tenant=acme)
    agent = AgentConfig(tenant=acme, name="reporter", model_config=offline_model, policy=policy)

    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(
            instance=agent,
            actor=platform_admin,
            skills=Skill.objects.filter(pk__in=[own.pk, foreign.pk, granted.pk, ungranted.pk]),
        )

    assert refused.value.details == {
        "skills": [
            "globex/core/weekly-summary belongs to another tenant.",
            "platform/core/escalate is not granted to acme.",
        ]
    }
    assert not AgentConfig.objects.exists()
    registry_object_save(
        instance=agent,
        actor=platform_admin,
        skills=Skill.objects.filter(pk__in=[own.pk, granted.pk]),
    )
    assert set(AgentConfig.objects.get().skills.all()) == {own, granted}


def test_the_admin_refuses_another_tenants_skill_on_the_skills_field(
    client, acme, globex, offline_model, platform_admin
):
    policy = Policy.objects.create(tenant=acme, name="default")
    foreign = Skill.objects.create(tenant=globex, name="weekly-summary")
    client.force_login(platform_admin)

    response = client.post(
        "/admin/registry/agentconfig/add/",
        agent_form_data(
            tenant=acme.pk, model_config=offline_model.pk, policy=policy.pk, skills=[foreign.pk]
        ),
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["skills"] == [
        "globex/core/weekly-summary belongs to another tenant."
    ]
    assert not AgentConfig.objects.exists()
