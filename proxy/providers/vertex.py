"""Vertex AI: Gemini and Anthropic bodies on Google Cloud's own routes.

- Gemini: `POST /v1[beta1]/projects/{p}/locations/{l}/publishers/google/models/{m}:generateContent`
  and `:streamGenerateContent?alt=sse`. The body is Gemini's and the model is in the path, as
  on AI Studio: the Gemini module reads both as they are.
- Anthropic: `.../publishers/anthropic/models/{m}:rawPredict` and `:streamRawPredict`. The
  body is Anthropic Messages without `model` (it carries `anthropic_version`), streamed when
  it says `stream: true`; the model (`claude-sonnet-4-5@20250929`) is in the path.

So each is its module's API object with three differences, not a copy of the module:
the upstream family (`vertex`: its base URL setting and upstreams), the provider name
(`gcp.vertex_ai`) and the credential (an OAuth bearer token), plus, for Anthropic, the
model read from the path.

The upstream is `vertex_base_url` when set, else the host of the path's location, as both
SDKs build it: `{location}-aiplatform.googleapis.com`, `aiplatform.googleapis.com` for
`global`, `aiplatform.{us|eu}.rep.googleapis.com` for the multi-regions. The full path goes
upstream unchanged. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Final

from proxy.providers.anthropic import AnthropicAdapter
from proxy.providers.gemini import GeminiAdapter

__all__ = ["VERTEX_ANTHROPIC", "VERTEX_GEMINI", "VertexAnthropic", "VertexGemini", "regional_base_url",
           "vertex_route"]

# The whole path, character for character: what is metered (the model) is what runs. The
# location names the upstream host, so it is letters, digits and `-` only. Project ids are
# lower-case letters, digits and `-` (a project number is digits; legacy domain-scoped ids
# read `example.com:name`).
_PATH: Final = re.compile(
    r"/v1(?:beta1)?/projects/[a-z0-9][a-z0-9.:-]*/locations/(?P<location>[a-z][a-z0-9-]{0,40})"
    r"/publishers/(?P<publisher>google|anthropic)/models/(?P<model>[A-Za-z0-9][A-Za-z0-9._@-]*)"
    r":(?P<action>generateContent|streamGenerateContent|rawPredict|streamRawPredict)")
_ACTIONS: Final = {"google": ("generateContent", "streamGenerateContent"),
                   "anthropic": ("rawPredict", "streamRawPredict")}
# Anthropic's token counting on Vertex is `.../models/count-tokens:rawPredict`, free and
# answered with a count, not a message: not a model call (a 404 unless passed through).
_NOT_MODELS: Final = frozenset({"count-tokens"})
_MULTI_REGIONS: Final = frozenset({"us", "eu"})
# Any Vertex path's location (a pass-through goes to the host of its location too).
_LOCATION: Final = re.compile(r"/v1[a-z0-9]*/projects/[^/]+/locations/(?P<location>[a-z][a-z0-9-]{0,40})(?:/|$)")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class VertexGemini(GeminiAdapter):
    """Gemini on Vertex AI: the Gemini module's API object, Vertex's upstream and credential."""

    family = "vertex"
    provider = "gcp.vertex_ai"
    upstream_setting = "vertex_base_url"

    def auth_headers(self, key: str) -> dict[str, str]:
        return _bearer(key)


class VertexAnthropic(AnthropicAdapter):
    """Anthropic on Vertex AI: the Anthropic module's API object, the model read from the path."""

    family = "vertex"
    provider = "gcp.vertex_ai"
    upstream_setting = "vertex_base_url"

    def model_of(self, body: dict[str, Any], path: str) -> str | None:
        m = _PATH.fullmatch(path)
        return m["model"] if m else None

    def auth_headers(self, key: str) -> dict[str, str]:
        return _bearer(key)


VERTEX_GEMINI = VertexGemini()
VERTEX_ANTHROPIC = VertexAnthropic()
_BY_PUBLISHER: Final[dict[str, VertexGemini | VertexAnthropic]] = {"google": VERTEX_GEMINI,
                                                                    "anthropic": VERTEX_ANTHROPIC}


def vertex_route(path: str) -> VertexGemini | VertexAnthropic | None:
    """The API of a Vertex AI model-call path, or None when the path is not exactly one."""
    m = _PATH.fullmatch(path)
    if m is None or m["action"] not in _ACTIONS[m["publisher"]] or m["model"] in _NOT_MODELS:
        return None
    return _BY_PUBLISHER[m["publisher"]]


def regional_base_url(path: str) -> str | None:
    """The Vertex AI host serving the location a Vertex path names, or None for another path."""
    m = _LOCATION.match(path)
    if m is None:
        return None
    location = m["location"]
    if location == "global":
        return "https://aiplatform.googleapis.com"
    if location in _MULTI_REGIONS:
        return f"https://aiplatform.{location}.rep.googleapis.com"
    return f"https://{location}-aiplatform.googleapis.com"
