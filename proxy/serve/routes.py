"""Paths -> APIs (proxy/providers/apis.py), and where each call goes upstream with which credentials. No I/O."""

from __future__ import annotations

import functools
import os
import re

from proxy.config import Settings, Upstream
from proxy.errors import ConfigError, UnknownRoute
from proxy.model import Caller, frozen
from proxy.providers.apis import (
    AZURE_PREFIX,
    BEDROCK_PREFIX,
    FIXED_PATHS,
    bedrock_base_url,
    for_azure_path,
    for_bedrock_path,
    for_path,
    for_upstream_path,
    regional_base_url,
)
from proxy.providers.hosts import HOSTS
from proxy.providers.translator import Api
from proxy.serve.aws_sign import AwsSigning
from proxy.serve.upstream import host_port

__all__ = ["SUPPORTED", "Route", "Target", "api_for", "check_upstreams", "match", "provider_name", "target_for",
           "upstream"]

SUPPORTED = (
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/embeddings",
    "POST /v1beta/models/{model}:generateContent",
    "POST /v1beta/models/{model}:streamGenerateContent?alt=sse",
    "POST /v1/projects/{project}/locations/{location}/publishers/google/models/{model}:generateContent "
    "(Vertex AI; also under /v1beta1)",
    "POST /v1/projects/{project}/locations/{location}/publishers/google/models/{model}:streamGenerateContent?alt=sse "
    "(Vertex AI; also under /v1beta1)",
    "POST /v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:rawPredict "
    "(Anthropic on Vertex AI; also under /v1beta1)",
    "POST /v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict "
    "(Anthropic on Vertex AI; also under /v1beta1)",
    "GET /v1/models",
    "POST /openai/deployments/{deployment}/chat/completions, /embeddings and /responses, /openai/responses and "
    "/openai/v1/chat/completions, /responses and /embeddings (Azure OpenAI, ?api-version= as the SDK sends it)",
    "(any of the OpenAI and Anthropic routes under /upstreams/{name}/ with the host's own path, e.g. "
    f"/upstreams/groq/openai/v1/chat/completions, to pick a built-in host ({', '.join(HOSTS)}) or a configured "
    "upstream)",
    "POST /model/{modelId}/converse, /model/{modelId}/converse-stream, /model/{modelId}/invoke and "
    "/model/{modelId}/invoke-with-response-stream (AWS Bedrock; the model id as the SDK encodes it, an inference "
    "profile or an ARN)",
    "POST, GET and DELETE /mcp/{name} (MCP Streamable HTTP, to a server configured under mcp_servers)",
)

_UPSTREAM_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# What an HTTP client or server may rewrite before the upstream sees the path: dot
# segments, empty segments, encoded slashes, dots, backslashes, `?` and `#`.
_AMBIGUOUS = re.compile(r"(?:^|/)\.{1,2}(?:/|$)|//|\\|%(?:2[fFeE3]|5[cC]|3[fF])")


@frozen
class Route:
    api: Api | None  # None: not a metered route
    upstream_name: str | None  # from an /upstreams/{name}/ prefix
    path: str  # the path as it goes upstream, prefix removed, exactly as received
    mcp: str | None = None  # the MCP server of /mcp/{name}


def match(raw_path: str, query: str = "") -> Route:
    """The route for a request path exactly as the client sent it (no query; `query` picks
    an Azure API's variant by its api-version).

    Refuses, for every route, a path that a client or server on the way could normalise
    into another one: what is metered must be what the upstream serves.
    """
    fixed = _FIXED_ROUTES.get(raw_path)
    if fixed is not None:  # the common case, found by one dict lookup
        return fixed
    bedrock = _bedrock_route(raw_path)
    if bedrock is not None:  # before the check below: an ARN's `%2F` is allowed in its model segment alone
        return bedrock
    if _AMBIGUOUS.search(raw_path):
        raise UnknownRoute(
            f"spanmeter does not serve the path {raw_path[:200]!r}: it has dot segments, empty "
            "segments or percent-encoded `/`, `.`, `\\`, `?` or `#`, which HTTP clients rewrite "
            "before sending, so the path metered would not be the path served. Send the path "
            "in its plain form, e.g. /v1beta/models/gemini-2.5-flash:generateContent.")
    if raw_path == "/mcp" or raw_path.startswith("/mcp/"):
        server = raw_path.removeprefix("/mcp").removeprefix("/")
        if not _UPSTREAM_NAME.fullmatch(server):
            raise UnknownRoute(f"{server[:80]!r} is not an MCP server name: the route is /mcp/{{name}}, with the "
                               "name of a server configured under mcp_servers.")
        return Route(None, None, raw_path, mcp=server)
    name = None
    path = raw_path
    if raw_path.startswith("/upstreams/"):
        name, _, rest = raw_path.removeprefix("/upstreams/").partition("/")
        if not _UPSTREAM_NAME.fullmatch(name):
            raise UnknownRoute(f"{name[:80]!r} is not an upstream name: use letters, digits, `.`, `_` and `-`.")
        path = "/" + rest
        return Route(for_upstream_path(path), name, path)
    if raw_path.startswith(AZURE_PREFIX):
        return Route(for_azure_path(raw_path, query), None, raw_path)
    return Route(api_for(path), name, path)


def _bedrock_route(raw_path: str) -> Route | None:
    """A Bedrock model call, also under /upstreams/{name}/: matched whole by its pattern
    (proxy/providers/bedrock_wire.py), in which `%2F` may stand only inside the model id,
    as ARNs have it (`arn%3Aaws%3Abedrock%3A...%3Ainference-profile%2Fus.anthropic...`).
    That segment goes upstream as sent and never becomes a separator on the way: a path
    with `%2F` anywhere else is refused below as every other route refuses it."""
    name, path = None, raw_path
    if raw_path.startswith("/upstreams/"):
        name, _, rest = raw_path.removeprefix("/upstreams/").partition("/")
        if not _UPSTREAM_NAME.fullmatch(name) or name.startswith("."):
            return None
        path = "/" + rest
    if not path.startswith(BEDROCK_PREFIX):
        return None
    api = for_bedrock_path(path)
    return Route(api, name, path) if api is not None else None


# The routes of the fixed paths, as match would build them (none is ambiguous).
_FIXED_ROUTES = {path: Route(api, None, path) for path, api in FIXED_PATHS.items()}


def api_for(path: str) -> Api | None:
    """The API of a metered path (already stripped of any /upstreams/{name} prefix)."""
    return for_path(path)


# Served paths as an SDK whose base URL lacks `/v1` sends them (OpenAI's SDK appends only
# the rest): the 404 says to add it.
_WITHOUT_V1 = ("/chat/completions", "/responses", "/embeddings", "/models", "/messages")


def _base_url_hint(path: str) -> str:
    bare = path.split("?", 1)[0]
    if bare.startswith("/v1/v1/") or bare.startswith("/v1/v1beta/"):
        return ("The path starts with /v1 twice: the SDK's base URL already ends in /v1 and the SDK adds its "
                "own (the Anthropic and Gemini SDKs take the base URL without /v1: http://127.0.0.1:8787). ")
    if any(bare == p or bare.startswith(p + "/") for p in _WITHOUT_V1):
        return (f"Add /v1: the SDK's base URL must end in /v1 (OpenAI(base_url=\"http://127.0.0.1:8787/v1\"), "
                f"or OPENAI_BASE_URL=http://127.0.0.1:8787/v1), so that it calls /v1{bare}. ")
    return ""


def unknown_route(method: str, path: str) -> UnknownRoute:
    return UnknownRoute(
        f"spanmeter does not serve {method} {path}. {_base_url_hint(path)}Supported routes: {'; '.join(SUPPORTED)}. "
        "Unmetered pass-through of other paths is off because it would let calls bypass "
        "budgets; an operator can allow it with SPANMETER_ALLOW_PASSTHROUGH=true."
    )


@frozen
class Target:
    base_url: str
    auth: dict[str, str]
    provider: str  # gen_ai.provider.name
    server_address: str
    server_port: int
    # The upstream's bearer token comes from the machine's own cloud credentials, fetched
    # per call by proxy/serve/cloud_token.py (Vertex AI in tenant mode with no key configured).
    ambient_token: bool = False
    # The call is signed with SigV4 by spanmeter, with these credentials (AWS Bedrock when the
    # caller sent no Bedrock API key: proxy/serve/aws_sign.py).
    aws: AwsSigning | None = None


# Upstream families that take an OAuth token from Application Default Credentials when no
# key is configured for them: Vertex AI has no API keys of the kind the others take.
_AMBIENT_TOKEN_FAMILIES = frozenset({"vertex"})


# gen_ai.provider.name: the well-known value when the host says which provider serves
# the call, else the instrumentation's best knowledge, the API the client speaks (its
# module's `provider`, one value per API); server.address still names the host. Never the host itself: the
# value is a metric label, and hosts are not a bounded set.
_KNOWN_HOSTS = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "generativelanguage.googleapis.com": "gcp.gemini",
    "aiplatform.googleapis.com": "gcp.vertex_ai",
    "api.deepseek.com": "deepseek",
    "api.groq.com": "groq",
    "api.mistral.ai": "mistral_ai",
    "api.x.ai": "x_ai",
    "api.perplexity.ai": "perplexity",
}
_KNOWN_SUFFIXES = (
    ("-aiplatform.googleapis.com", "gcp.vertex_ai"),  # regional Vertex endpoints
    (".openai.azure.com", "azure.ai.openai"),
    (".services.ai.azure.com", "azure.ai.inference"),
)


def provider_name(api: Api, host: str, configured: str | None = None) -> str:
    """gen_ai.provider.name for a call of `api`'s API to `host` (semconv v1.41.1)."""
    return _provider(api.provider, host, configured)


def _provider(default: str, host: str, configured: str | None) -> str:
    if configured:
        return configured
    host = host.lower()
    known = _KNOWN_HOSTS.get(host)
    if known is not None:
        return known
    for suffix, name in _KNOWN_SUFFIXES:
        if host.endswith(suffix):
            return name
    return default


def upstream(settings: Settings, name: str) -> Upstream | None:
    """A named upstream: the config's entry laid over the built-in host of that name,
    field by field (`upstreams: {groq: {base_url: ...}}` moves Groq and keeps the rest)."""
    configured = settings.upstreams.get(name)
    host = HOSTS.get(name)
    if host is None:
        return configured if configured is not None and configured.base_url else None
    given = configured.model_dump(exclude_unset=True) if configured is not None else {}
    return Upstream.model_construct(**{"dialect": "openai", "base_url": host.base_url, "key_env": host.key_env,
                                       "provider_name": host.provider, **given})


def check_upstreams(settings: Settings) -> None:
    """At start-up and in check-config: each configured upstream can be reached, and each
    tenant's `upstream` names one (ConfigError otherwise)."""
    for name, up in settings.upstreams.items():
        if not up.base_url and name not in HOSTS and up.dialect != "bedrock":  # bedrock: the region's
            raise ConfigError(
                f"Upstream {name!r} has no base_url: only the built-in hosts ({', '.join(HOSTS)}) have one "
                f"already. Add `base_url:` to upstreams.{name}, e.g. http://127.0.0.1:8000.")
    for tenant_name, tenant in settings.tenants.items():
        if tenant.upstream and upstream(settings, tenant.upstream) is None:
            raise ConfigError(
                f"Tenant {tenant_name!r} names upstream {tenant.upstream!r}, which is not defined. Defined "
                f"upstreams: {sorted(settings.upstreams) or 'none'}; built in: {', '.join(HOSTS)}. Add it "
                "under `upstreams:`.")


def target_for(settings: Settings, api: Api, caller: Caller, upstream_name: str | None, path: str = "") -> Target:
    """Where a call goes and with which credentials. `path`: the path as it goes upstream,
    which names the upstream's host when its API's base URL is not set (Vertex AI's location)."""
    if api.family == "bedrock":
        return _bedrock_target(settings, api, caller, upstream_name)
    family = api.family
    tenant = settings.tenants.get(caller.tenant)
    name = upstream_name or (tenant.upstream if tenant else None)
    key_env: str | None
    configured: str | None = None
    if name is not None:
        up = upstream(settings, name)
        if up is None or up.dialect != family or not up.base_url:
            raise UnknownRoute(
                f"No upstream named {name!r} for the {family} dialect. Built in: {', '.join(HOSTS)}; "
                f"configured: {sorted(k for k, u in settings.upstreams.items() if u.dialect == family) or 'none'}."
            )
        base, configured = up.base_url, up.provider_name
        # Keys per host as for the big three: the tenant's `upstream_keys` entry by the
        # host's name, else the config entry's own key_env, else the global entry by the
        # host's name, else the built-in host's variable.
        own = settings.upstreams[name].key_env if name in settings.upstreams else None
        key_env = ((tenant.upstream_keys.get(name) if tenant else None) or own
                   or (settings.upstream_keys.get(name) if name in HOSTS else None) or up.key_env)
    else:
        base = getattr(settings, api.upstream_setting)
        if base is None and api.upstream_setting in _NO_BASE:
            raise ConfigError(_NO_BASE[api.upstream_setting])
        base = base or _base_from_path(api, path)
        key_env = (tenant.upstream_keys.get(family) if tenant else None) or settings.upstream_keys.get(family)
    url, provider, host, port = _endpoint(api.provider, base, configured)
    ambient = not settings.open_mode and not key_env and family in _AMBIENT_TOKEN_FAMILIES
    return Target(url, _auth(settings, api, caller, key_env), provider, host, port, ambient)


_BEDROCK_HOST = re.compile(r"bedrock-runtime(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com")


def _bedrock_target(settings: Settings, api: Api, caller: Caller, upstream_name: str | None) -> Target:
    """Where a Bedrock call goes, and how it is authorised: the caller's Bedrock API key in
    open mode, a key from a variable in tenant mode, else spanmeter's own SigV4 signature
    with the credentials of the tenant's upstream entry or AWS's standard chain."""
    tenant = settings.tenants.get(caller.tenant)
    name = upstream_name or (tenant.upstream if tenant else None)
    up = settings.upstreams.get(name) if name is not None else None
    if name is not None and (up is None or up.dialect != "bedrock"):
        raise UnknownRoute(
            f"No upstream named {name!r} for Bedrock's routes; configured: "
            f"{sorted(k for k, u in settings.upstreams.items() if u.dialect == 'bedrock') or 'none'}. "
            "Add it under `upstreams:` with `dialect: bedrock`.")
    region = ((up.aws_region if up else None) or settings.bedrock_region or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION"))
    base = (up.base_url if up else None) or settings.bedrock_base_url or (bedrock_base_url(region) if region else None)
    if base is None:
        raise ConfigError(
            "This proxy does not know which AWS region to send Bedrock calls to: set SPANMETER_BEDROCK_REGION "
            "(or AWS_REGION in spanmeter's environment), or SPANMETER_BEDROCK_BASE_URL, and restart.")
    url, provider, host, port = _endpoint(api.provider, base, up.provider_name if up else None)
    key = caller.upstream_key
    if settings.open_mode and key and not key.startswith("AWS4-"):
        return Target(url, api.auth_headers(key), provider, host, port)  # a Bedrock API key
    key_env = (up.key_env if up else None) or (tenant.upstream_keys.get("bedrock") if tenant else None) \
        or settings.upstream_keys.get("bedrock")
    if not settings.open_mode and key_env:
        return Target(url, _auth(settings, api, caller, key_env), provider, host, port)
    at = _BEDROCK_HOST.fullmatch(host)
    signing_region = region or (at["region"] if at else None)
    if signing_region is None:
        raise ConfigError(
            f"spanmeter signs Bedrock calls for a region, and none is set for {base!r}: set "
            "SPANMETER_BEDROCK_REGION (or AWS_REGION), or `aws_region:` on the upstream entry.")
    key_envs = ((up.aws_access_key_id_env, up.aws_secret_access_key_env, up.aws_session_token_env)
                if up and up.aws_access_key_id_env and up.aws_secret_access_key_env else None)
    return Target(url, {}, provider, host, port,
                  aws=AwsSigning(signing_region, up.aws_profile if up else None, key_envs))


def _base_from_path(api: Api, path: str) -> str:
    """The upstream named by the path itself, for an API whose base URL setting is unset."""
    base = regional_base_url(path)
    if base is None:
        raise UnknownRoute(
            f"spanmeter does not know where to send {path[:200]!r}: the {api.upstream_setting} setting is unset "
            "and the path names no location (/v1/projects/{project}/locations/{location}/...). Send the path "
            f"with its location, or set SPANMETER_{api.upstream_setting.upper()}.")
    return base


_NO_BASE = {
    "azure_openai_base_url": (
        "This proxy has no Azure OpenAI endpoint: set SPANMETER_AZURE_OPENAI_BASE_URL (or azure_openai_base_url "
        "in the config file) to your resource's endpoint, e.g. https://my-resource.openai.azure.com, and restart. "
        "A tenant whose calls go to another resource names it under `upstreams:`."),
}


@functools.lru_cache(maxsize=256)
def _endpoint(default_provider: str, base: str, configured: str | None) -> tuple[str, str, str, int]:
    """What a base URL names: parsed once per upstream, not per call (urlsplit and the
    provider's host lookup are pure, and a process has a handful of upstreams)."""
    host, port = host_port(base)
    return base.rstrip("/"), _provider(default_provider, host, configured), host, port


def _auth(settings: Settings, api: Api, caller: Caller, key_env: str | None) -> dict[str, str]:
    if settings.open_mode:
        return api.auth_headers(caller.upstream_key) if caller.upstream_key else {}
    if not key_env:
        return {}
    key = os.environ.get(key_env)
    if key is None:
        raise ConfigError(
            f"This proxy has no key for the {api.family} API: the upstream key for tenant {caller.tenant!r} "
            f"is read from the environment variable {key_env}, which is not set in the proxy's environment. "
            f"Set {key_env} and restart spanmeter (or call an API whose key is set)."
        )
    return api.auth_headers(key) if key else {}
