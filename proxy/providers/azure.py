"""Azure OpenAI: OpenAI's Chat Completions, Responses and Embeddings on Azure's own routes.
Pure: no I/O.

The bodies are OpenAI's; what differs is where a call goes and what it names:

- `/openai/deployments/{deployment}/...?api-version=...` runs the deployment the path names,
  whatever the body's `model` says, so the deployment is the call's model; the v1 API
  (`/openai/v1/...`, `/openai/responses`) names the deployment in the body's `model`.
- A deployment is the operator's name for a model; the answer names the model that ran
  (`gpt-4.1-mini-2025-04-14`; a stream's first chunk says `""`). Pricing maps one to the
  other (proxy/serve/deployments.py); this module only reads the request.
- The key goes in `api-key`, or a Microsoft Entra token as a bearer.
- Older api-versions refuse fields they do not know with a 400, so `stream_options` (the
  stream's usage) and `prompt_cache_key` are sent only where the api-version takes them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Final

from proxy.model import NO_BYTE_FACTS, ByteFacts, Call, Rewrite
from proxy.providers.base import Exchange
from proxy.providers.cache import CacheScope
from proxy.providers.chat import ChatAdapter, openai_cache_key
from proxy.providers.embeddings import EmbeddingsAdapter
from proxy.providers.responses import ResponsesAdapter
from proxy.providers.translator import Api

__all__ = ["AZURE_PROVIDER", "azure_api", "deployment_of", "takes_stream_usage"]

AZURE_PROVIDER: Final = "azure.ai.openai"
# The first GA api-version that takes stream_options (2024-09-01-preview was the first
# preview); prompt_cache_key came with the 2025-04-01-preview surface.
_STREAM_USAGE_SINCE: Final = "2024-09-01"
_CACHE_KEY_SINCE: Final = "2025-04-01"
_DEPLOYMENT: Final = re.compile(r"/openai/deployments/([^/]+)/")
_API_VERSION: Final = re.compile(r"(?:^|&)api-version=([0-9]{4}-[0-9]{2}-[0-9]{2})")


def deployment_of(path: str) -> str | None:
    m = _DEPLOYMENT.match(path)
    return m[1] if m else None


class _Azure:
    """What Azure changes in an OpenAI API: its upstream, its key header, the deployment."""

    family = "azure"
    provider = AZURE_PROVIDER
    upstream_setting = "azure_openai_base_url"
    names_deployment = True
    stream_usage = False  # the api-version takes stream_options
    cache_key = False  # the api-version takes prompt_cache_key

    def auth_headers(self, key: str) -> dict[str, str]:
        # A Microsoft Entra access token is a JWT (three base64url parts, the first `eyJ`);
        # an Azure OpenAI key is 32 or 84 plain characters.
        if key.startswith("eyJ") and key.count(".") == 2:
            return {"Authorization": f"Bearer {key}"}
        return {"api-key": key}

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        if not self.cache_key:
            return []
        caller = scope.caller
        return openai_cache_key(ex, caller.tenant, caller.run_id, caller.agent_name)


def _in_path(call: Call, path: str) -> Call:
    """The call as the deployment in its path runs it."""
    deployment = deployment_of(path)
    return call if deployment is None or deployment == call.model else replace(call, model=deployment)


class AzureChat(_Azure, ChatAdapter):
    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        return _in_path(super().parse_request(body, path, facts), path)

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return super().prepare(ex) if self.stream_usage else []


class AzureResponses(_Azure, ResponsesAdapter):
    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        return _in_path(super().parse_request(body, path, facts), path)


class AzureEmbeddings(_Azure, EmbeddingsAdapter):
    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        return _in_path(super().parse_request(body, path, facts), path)


def _variant(cls: type[_Azure], stream_usage: bool, cache_key: bool) -> Api:
    api = cls()
    api.stream_usage, api.cache_key = stream_usage, cache_key
    return api  # type: ignore[return-value]  # each class is an Api through its OpenAI base


_KINDS: Final[dict[str, type[_Azure]]] = {"chat/completions": AzureChat, "responses": AzureResponses,
                                           "embeddings": AzureEmbeddings}
_VARIANTS: Final = {(kind, usage, key): _variant(cls, usage, key and kind != "embeddings")
                    for kind, cls in _KINDS.items() for usage in (False, True) for key in (False, True)}


def takes_stream_usage(query: str, *, v1: bool) -> tuple[bool, bool]:
    """(stream_options, prompt_cache_key) for a request's query: the v1 API takes both; a
    dated api-version takes each from its release on; no api-version takes neither."""
    if v1:
        return True, True
    m = _API_VERSION.search(query)
    if m is None:
        return False, False
    return m[1] >= _STREAM_USAGE_SINCE, m[1] >= _CACHE_KEY_SINCE


def azure_api(kind: str, deployment: str | None, *, v1: bool, query: str) -> Api:
    """The Azure API object for a route (`kind`: chat/completions, responses, embeddings)."""
    usage, key = takes_stream_usage(query, v1=v1 or deployment is None)
    return _VARIANTS[(kind, usage, key)]
