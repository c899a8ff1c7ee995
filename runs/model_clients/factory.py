"""The one place a model config becomes a client. Called per model turn, so the credential is
read from the environment at call time: a rotated key takes effect on the next turn, and no
secret is ever stored in the registry or its history."""

from collections.abc import Callable
from typing import Any

from config.credentials import credential_refusal, credential_value
from registry.choices import ModelProvider
from registry.models import ModelConfig
from registry.models.configs import (
    MODEL_OPERATIONAL_PARAMETERS,
    TIMEOUT_PARAMETER,
    timeout_problem,
)
from runs.model_clients.adversarial import AdversarialPlanner
from runs.model_clients.anthropic_messages import AnthropicClient
from runs.model_clients.base import ModelClient, ModelError
from runs.model_clients.offline import OfflinePlanner
from runs.model_clients.openai_compatible import OpenAICompatibleClient

DEFAULT_TIMEOUT_S = 60.0
# Planners that answer in this process, at once, without a network or a provider to wait for.
IN_PROCESS_PROVIDERS = frozenset({ModelProvider.OFFLINE, ModelProvider.ADVERSARIAL})

PROVIDER_CLIENTS: dict[str, Callable[..., ModelClient]] = {
    ModelProvider.OPENAI_COMPATIBLE: OpenAICompatibleClient,
    ModelProvider.ANTHROPIC: AnthropicClient,
}


def model_client_for(model_config: ModelConfig, *, within_s: float | None = None) -> ModelClient:
    """The client of the config's provider, whose call ends within its timeout, or within
    `within_s` (what its run and its step's task have left, `loop._calls_deadline`) when
    that is shorter. Every refusal here is a ModelError that is not retryable: a missing
    credential or a bad setting stays wrong until an operator fixes it."""
    if model_config.provider == ModelProvider.OFFLINE:
        return _offline_planner(model_config)
    if model_config.provider == ModelProvider.ADVERSARIAL:
        return AdversarialPlanner(model_config)
    client_class = PROVIDER_CLIENTS.get(model_config.provider)
    if client_class is None:
        raise ModelError(
            f"Model config {model_config.name!r} names the unknown provider "
            f"{model_config.provider!r}.",
            retryable=False,
        )
    configured = model_config.parameters
    timeout_s = _timeout_s(model_config, configured.get(TIMEOUT_PARAMETER, DEFAULT_TIMEOUT_S))
    if within_s is not None:
        timeout_s = max(min(timeout_s, within_s), 0.0)
    # What only bounds the call stays here; the rest goes to the provider with each call.
    parameters = {
        key: value for key, value in configured.items() if key not in MODEL_OPERATIONAL_PARAMETERS
    }
    return client_class(
        model_config,
        api_key=_credential(model_config),
        timeout_s=timeout_s,
        parameters=parameters,
    )


def _credential(model_config: ModelConfig) -> str:
    """The secret held by the environment variable the config names; only the name is ever
    put into a message."""
    variable = model_config.credential_ref
    if not variable:
        raise ModelError(
            f"Model config {model_config.name!r} has no credential_ref: name the environment "
            "variable that holds its API key.",
            retryable=False,
        )
    refusal = credential_refusal(variable, owner=model_config.tenant)
    if refusal:
        raise ModelError(f"Model config {model_config.name!r}: {refusal}", retryable=False)
    secret = credential_value(variable, owner=model_config.tenant)
    if not secret:
        raise ModelError(
            f"The environment variable {variable} (credential of model config "
            f"{model_config.name!r}) is not set or empty.",
            retryable=False,
        )
    return secret


def _timeout_s(model_config: ModelConfig, value: Any) -> float:
    """The config's timeout; one saved before it was checked on save fails the call."""
    if problem := timeout_problem(value):
        raise ModelError(f"Model config {model_config.name!r}: {problem}", retryable=False)
    return float(value)


def _offline_planner(model_config: ModelConfig) -> ModelClient:
    return OfflinePlanner(model_config)
