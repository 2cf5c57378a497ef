"""genai-prices' data as we keep it: compiled rows by provider, and lookups over them. Pure,
and free of genai-prices itself: its data is read by proxy/pricing/compiler.py (in a process of
its own, proxy/pricing/bundled.py), and a serving process loads the rows it compiled.

- `PriceSource`: each provider's exact names, then its matchers in the data's order, its
  fallback providers (Azure -> OpenAI), and the clause saying which models it is first party
  for. Lookups are lowercased, as genai-prices does; `PriceTable` memoises them.
- `Matcher`: a match clause as data (eq, starts, ends, contains, regex, or, and).
- `to_json` / `from_json`: the rows as the compiler writes them and the proxy reads them.
- `PROVIDERS`: spanmeter's gen_ai.provider.name -> genai-prices' provider id.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from proxy.pricing.row import STANDARD_FACTOR, LongContext, Price

__all__ = ["FREE_PROVIDERS", "PROVIDERS", "PriceSource", "ProviderPrices"]

# spanmeter's gen_ai.provider.name -> genai-prices' provider id. A name missing here is
# "unknown": its models are priced at their first-party provider's rates.
PROVIDERS: Final[dict[str, str]] = {
    "openai": "openai",
    "anthropic": "anthropic",
    "gcp.gemini": "google",
    "gcp.vertex_ai": "google",
    "gcp.gen_ai": "google",
    "azure.ai.openai": "azure",
    "azure.ai.inference": "azure",
    "aws.bedrock": "aws",
    "groq": "groq",
    "mistral_ai": "mistral",
    "deepseek": "deepseek",
    "x_ai": "x-ai",
    "xai": "x-ai",
    "openrouter": "openrouter",
    "together": "together",
    "together_ai": "together",
    "fireworks": "fireworks",
    "cerebras": "cerebras",
    "zai": "zai",
    "z_ai": "zai",
    "cohere": "cohere",
    "perplexity": "perplexity",
    "moonshot": "moonshotai",
}
# Providers that run on the caller's own hardware: every model is free, deliberately.
FREE_PROVIDERS: Final = frozenset({"ollama"})

_SCALE: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class Matcher:
    """A genai-prices match clause as data: `kind` is eq, starts, ends, contains, regex, or,
    and; `arg` the text, or the clauses of or/and. Data, not a closure, so compiled rows can
    be written to the cache file and read back (`PriceSource.to_json`)."""

    kind: str
    arg: str | tuple[Matcher, ...]

    def __call__(self, name: str) -> bool:
        kind, arg = self.kind, self.arg
        if isinstance(arg, tuple):
            return any(m(name) for m in arg) if kind == "or" else all(m(name) for m in arg)
        if kind == "eq":
            return name == arg
        if kind == "starts":
            return name.startswith(arg)
        if kind == "ends":
            return name.endswith(arg)
        if kind == "contains":
            return arg in name
        return _regex(arg).search(name) is not None

    def to_json(self) -> list[Any]:
        return [self.kind, [m.to_json() for m in self.arg] if isinstance(self.arg, tuple) else self.arg]

    @classmethod
    def from_json(cls, raw: list[Any]) -> Matcher:
        kind, arg = raw
        return cls(kind, tuple(cls.from_json(m) for m in arg) if isinstance(arg, list) else str(arg))


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@dataclass(frozen=True, slots=True)
class ProviderPrices:
    """One genai-prices provider, compiled: exact names, then matchers in data order."""

    id: str
    exact: dict[str, Price]
    patterns: tuple[tuple[Matcher, Price], ...]
    fallbacks: tuple[str, ...]  # genai-prices' fallback_model_providers (Azure -> OpenAI, ...)
    model_match: Matcher | None  # names this provider is first party for ("claude" -> anthropic)

    def find(self, name: str) -> Price | None:
        found = self.exact.get(name)
        if found is not None:
            return found
        return next((price for match, price in self.patterns if match(name)), None)


class PriceSource:
    """Every provider's compiled rows. Lookups scan matchers; callers memoise (PriceTable)."""

    def __init__(self, providers: Sequence[ProviderPrices], label: str) -> None:
        self.label = label  # "genai-prices 0.2.5", or the refreshed file's date
        self._providers = {p.id: p for p in providers}
        self._order = tuple(providers)

    def __len__(self) -> int:
        return sum(len(p.exact) + len(p.patterns) for p in self._order)

    def provider_ids(self) -> list[str]:
        return list(self._providers)

    def find(self, provider_id: str, name: str) -> Price | None:
        """The model's row at `provider_id`, else at that provider's fallbacks (one step)."""
        provider = self._providers.get(provider_id)
        if provider is None:
            return None
        name = name.lower()
        found = provider.find(name)
        for fallback in provider.fallbacks if found is None else ():
            other = self._providers.get(fallback)
            found = other.find(name) if other is not None else None
            if found is not None:
                break
        return found

    def to_json(self) -> dict[str, Any]:
        """The compiled rows as JSON data (each row once, named by its index)."""
        rows: dict[int, int] = {}
        table: list[dict[str, Any]] = []

        def ref(price: Price) -> int:
            if id(price) not in rows:
                rows[id(price)] = len(table)
                table.append(_row_json(price))
            return rows[id(price)]

        providers = [{"id": p.id, "exact": {n: ref(r) for n, r in p.exact.items()},
                      "patterns": [[m.to_json(), ref(r)] for m, r in p.patterns], "fallbacks": list(p.fallbacks),
                      "model_match": p.model_match.to_json() if p.model_match else None}
                     for p in self._order]
        return {"label": self.label, "rows": table, "providers": providers}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PriceSource:
        table = [_row_of(raw) for raw in doc["rows"]]
        return cls([ProviderPrices(p["id"], {n: table[i] for n, i in p["exact"].items()},
                                   tuple((Matcher.from_json(m), table[i]) for m, i in p["patterns"]),
                                   tuple(p["fallbacks"]),
                                   Matcher.from_json(p["model_match"]) if p["model_match"] else None)
                    for p in doc["providers"]], str(doc["label"]))

    def first_party(self, name: str) -> Price | None:
        """The model's row at the first provider whose own models its name looks like."""
        name = name.lower()
        for provider in self._order:
            if provider.model_match is not None and provider.model_match(name):
                found = provider.find(name)
                if found is not None:
                    return found
        return None


def _row_json(p: Price) -> dict[str, Any]:
    lc = p.long_context
    return {"model": p.model, "input": p.input, "cached_input": p.cached_input, "cache_write": p.cache_write,
            "output": p.output, "source": p.source, "as_of": p.as_of, "max_output_tokens": p.max_output_tokens,
            "cache_write_1h": p.cache_write_1h,
            "long_context": None if lc is None else [lc.threshold_tokens, lc.input, lc.cached_input, lc.cache_write,
                                                     lc.output, lc.cache_write_1h],
            "service_tiers": [[n, str(f)] for n, f in p.service_tiers],
            "inference_geos": [[n, str(f)] for n, f in p.inference_geos]}


def _row_of(raw: dict[str, Any]) -> Price:
    lc = raw["long_context"]
    return Price(model=raw["model"], input=raw["input"], cached_input=raw["cached_input"],
                 cache_write=raw["cache_write"], output=raw["output"], source=raw["source"], as_of=raw["as_of"],
                 max_output_tokens=raw["max_output_tokens"], cache_write_1h=raw["cache_write_1h"],
                 long_context=None if lc is None else LongContext(*lc),
                 service_tiers=tuple((n, _factor(f)) for n, f in raw["service_tiers"]),
                 inference_geos=tuple((n, _factor(f)) for n, f in raw["inference_geos"]))


def _factor(text: str) -> Fraction:
    f = Fraction(text)
    return STANDARD_FACTOR if f == 1 else f


