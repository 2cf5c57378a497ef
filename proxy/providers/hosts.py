"""The OpenAI-compatible hosts spanmeter serves by name, with no config, on
`/upstreams/{name}/{the host's own path}`. Pure data: no I/O.

Each speaks OpenAI's Chat Completions (most also Embeddings, some Responses) under a path
prefix of its own (`/openai/v1` at Groq, `/api/v1` at OpenRouter, none at DeepSeek). What
each host's usage looks like is read by the chat and responses modules, which accept every
spelling these hosts send (see docs/providers.md).
"""

from __future__ import annotations

from typing import Final

from proxy.model import frozen

__all__ = ["HOSTS", "Host"]


@frozen
class Host:
    base_url: str
    provider: str  # gen_ai.provider.name: the semconv well-known value where there is one
    key_env: str | None  # the environment variable holding its key in tenant mode
    example_path: str  # a chat path as its own SDK or docs send it, for messages and docs


# Semconv v1.41.1 names groq, mistral_ai, deepseek and x_ai; the others have no well-known
# value, and take the host's own name in the same style (a bounded set: these and config's).
HOSTS: Final[dict[str, Host]] = {
    "groq": Host("https://api.groq.com", "groq", "GROQ_API_KEY", "/openai/v1/chat/completions"),
    "mistral": Host("https://api.mistral.ai", "mistral_ai", "MISTRAL_API_KEY", "/v1/chat/completions"),
    "openrouter": Host("https://openrouter.ai", "openrouter", "OPENROUTER_API_KEY", "/api/v1/chat/completions"),
    "deepseek": Host("https://api.deepseek.com", "deepseek", "DEEPSEEK_API_KEY", "/chat/completions"),
    "cerebras": Host("https://api.cerebras.ai", "cerebras", "CEREBRAS_API_KEY", "/v1/chat/completions"),
    "together": Host("https://api.together.xyz", "together_ai", "TOGETHER_API_KEY", "/v1/chat/completions"),
    "fireworks": Host("https://api.fireworks.ai", "fireworks", "FIREWORKS_API_KEY",
                      "/inference/v1/chat/completions"),
    "xai": Host("https://api.x.ai", "x_ai", "XAI_API_KEY", "/v1/chat/completions"),
    "zai": Host("https://api.z.ai", "z_ai", "ZAI_API_KEY", "/api/paas/v4/chat/completions"),
    # A local server: no key, and its models cost nothing (priced $0 in prices.yaml).
    "ollama": Host("http://127.0.0.1:11434", "ollama", None, "/v1/chat/completions"),
}
