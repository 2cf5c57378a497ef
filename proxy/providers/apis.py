"""The APIs spanmeter meters, by the path a call is sent to, and the API whose words answer
a request that is no metered call. The one place outside the API modules that names them.
No I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.providers.translator import Api
from proxy.providers.vertex import VERTEX_ANTHROPIC, VERTEX_GEMINI, regional_base_url, vertex_route

__all__ = ["FIXED_PATHS", "answering", "for_path", "regional_base_url"]

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
    return vertex_route(path) if path.startswith(_VERTEX_PREFIXES) else None


# Vertex AI's model calls (proxy/providers/vertex.py), matched as exactly as Gemini's.
_VERTEX_PREFIXES: Final = ("/v1/projects/", "/v1beta1/projects/")


def answering(path: str, headers: Mapping[str, str]) -> Api:
    """The API whose error shape answers a request off the metered routes (a 404, a
    pass-through): the one its SDK's headers or path show, else OpenAI's."""
    if path.startswith(_VERTEX_PREFIXES):
        return VERTEX_ANTHROPIC if "/publishers/anthropic/" in path else VERTEX_GEMINI
    if "anthropic-version" in headers or path.startswith("/v1/messages"):
        return ANTHROPIC
    if "x-goog-api-key" in headers or path.startswith("/v1beta"):
        return GEMINI
    return CHAT
