"""The APIs spanmeter meters, by the path a call is sent to, and the API whose words answer
a request that is no metered call. The one place outside the API modules that names them.
No I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.azure import azure_api
from proxy.providers.bedrock import CONVERSE_API, bedrock_route
from proxy.providers.bedrock import regional_base_url as bedrock_base_url
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.providers.translator import Api
from proxy.providers.vertex import VERTEX_ANTHROPIC, VERTEX_GEMINI, regional_base_url, vertex_route

__all__ = ["AZURE_PREFIX", "BEDROCK_PREFIX", "FIXED_PATHS", "answering", "bedrock_base_url", "for_azure_path",
           "for_bedrock_path", "for_path", "for_upstream_path",
           "regional_base_url"]

FIXED_PATHS: Final[Mapping[str, Api]] = {
    "/v1/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/v1/messages": ANTHROPIC,
    "/v1/embeddings": EMBEDDINGS,
}

# Gemini carries the model in the path: the whole path must be this, character for
# character, so the model charged is the model the upstream runs.
_GEMINI: Final = re.compile(r"/v1(?:beta)?/models/[A-Za-z0-9][A-Za-z0-9._-]*:(?:generateContent|streamGenerateContent)")


def for_path(path: str) -> Api | None:
    """The API of a metered path (already stripped of any /upstreams/{name} prefix)."""
    found = FIXED_PATHS.get(path)
    if found is not None:
        return found
    if _GEMINI.fullmatch(path):
        return GEMINI
    if path.startswith(BEDROCK_PREFIX):
        return bedrock_route(path)
    return vertex_route(path) if path.startswith(_VERTEX_PREFIXES) else None


# AWS Bedrock's model calls (proxy/providers/bedrock.py): /model/{modelId}/converse, ...
BEDROCK_PREFIX: Final = "/model/"


# Vertex AI's model calls (proxy/providers/vertex.py), matched as exactly as Gemini's.
_VERTEX_PREFIXES: Final = ("/v1/projects/", "/v1beta1/projects/")


# The APIs an OpenAI-compatible host serves, by how its path ends: hosts put them under a
# prefix of their own (`/openai/v1` at Groq, `/api/v1` at OpenRouter, none at DeepSeek).
_BY_ENDING: Final = (("/chat/completions", CHAT), ("/responses", RESPONSES), ("/embeddings", EMBEDDINGS),
                     ("/v1/messages", ANTHROPIC))


def for_bedrock_path(path: str) -> Api | None:
    """The Bedrock API (Converse or InvokeModel) of a path under /model/, exactly as sent."""
    return bedrock_route(path)


def for_upstream_path(path: str) -> Api | None:
    """The API of a path after `/upstreams/{name}`: one of ours exactly, else an
    OpenAI-compatible API under the host's own prefix. The whole path goes upstream as
    sent, so what is metered is what the host serves at it."""
    found = for_path(path)
    if found is not None:
        return found
    for ending, api in _BY_ENDING:
        if path.endswith(ending):
            return api
    return None


AZURE_PREFIX: Final = "/openai/"
# Azure OpenAI's routes: a deployment in the path (the model the resource runs under that
# name), or the v1 API that names the deployment in the body's `model`.
_AZURE: Final = re.compile(
    r"/openai/(?:deployments/(?P<deployment>[A-Za-z0-9][A-Za-z0-9._-]*)/|v1/)?"
    r"(?P<api>chat/completions|responses|embeddings)")


def for_azure_path(path: str, query: str) -> Api | None:
    """The Azure OpenAI API of a path under /openai/, for the request's `api-version`
    (which decides what the request may be sent with: see proxy/providers/azure.py)."""
    m = _AZURE.fullmatch(path)
    if m is None or (m["api"] != "responses" and m["deployment"] is None and not path.startswith("/openai/v1/")):
        return None
    return azure_api(m["api"], m["deployment"], v1=path.startswith("/openai/v1/"), query=query)


def answering(path: str, headers: Mapping[str, str]) -> Api:
    """The API whose error shape answers a request off the metered routes (a 404, a
    pass-through): the one its SDK's headers or path show, else OpenAI's."""
    if path.startswith(_VERTEX_PREFIXES):
        return VERTEX_ANTHROPIC if "/publishers/anthropic/" in path else VERTEX_GEMINI
    if path.startswith(BEDROCK_PREFIX):
        return bedrock_route(path) or CONVERSE_API
    if "anthropic-version" in headers or path.startswith("/v1/messages"):
        return ANTHROPIC
    if "x-goog-api-key" in headers or path.startswith("/v1beta"):
        return GEMINI
    return CHAT
