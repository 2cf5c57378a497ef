"""Cost anatomy: a call's billed input tokens and input cost shared among its parts.

Pure arithmetic, no I/O. The API modules split a request into `InputPart`s in prompt
order (proxy/providers/*: `input_parts`); this module shares the usage out:

- **Tokens by bytes.** A part's share of the billed input tokens is its share of the
  parts' bytes. This is an approximation (no tokenizer runs on the hot path): JSON keys,
  punctuation and the chat template tokenize unlike prose, and an image's base64 bytes
  are billed as a few hundred tokens. Bytes are the text's length as the body carries
  it (a part's strings, not its JSON punctuation), counted in code points. Context the
  body only names (a Responses `previous_response_id`) is shared among the visible parts.
- **Cached tokens are the earliest.** A provider caches a prefix of the prompt, so the
  cache reads are the first tokens, then the cache writes (1-hour ones before 5-minute
  ones: Anthropic requires that order), then the uncached rest.
- **Cost at the billed rates.** Each part is priced at the rates of its token classes,
  with the call's long-context tier and service-tier multiplier. The call's input cost is
  `pricing.cost` of the usage without its output; it is shared by each part's exact
  (unrounded) cost, so the parts' micro-USD add up to it exactly.

Integers are shared with the largest-remainder method: floors first, then one more to the
largest remainders (ties to the earliest part), so the shares always sum to the whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from proxy.model import Anatomy, InputPart, PartCost, Usage
from proxy.policy.pricing import Price, cost

__all__ = ["anatomy", "apportion"]


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """`total` shared in proportion to `weights` (non-negative), summing to `total` exactly.
    With no weight at all, the last share takes everything (the newest content)."""
    n = len(weights)
    if n == 0:
        return []
    whole = sum(weights)
    if whole <= 0:
        return [0] * (n - 1) + [total]
    shares = []
    rests = []
    for w in weights:
        q, r = divmod(total * w, whole)
        shares.append(q)
        rests.append(r)
    left = total - sum(shares)
    if left:
        for i in sorted(range(n), key=lambda i: -rests[i])[:left]:  # stable: ties to the earliest
            shares[i] += 1
    return shares


def anatomy(parts: Sequence[InputPart], usage: Usage, price: Price | None) -> Anatomy | None:
    """The parts' shares of `usage`'s input, or None when the input is unknown."""
    total = usage.input_tokens
    if total is None or not parts:
        return None
    tokens = apportion(total, [p.size for p in parts])
    classes = _classes(usage, total)
    split = _split(tokens, classes)
    if price is None:
        costs = [0] * len(parts)
        whole = 0
    else:
        whole = cost(price, replace(usage, output_tokens=0))
        rates = _rates(price, usage, total)
        exact = [sum(c * r for c, r in zip(counts, rates, strict=True)) for counts in split]
        costs = apportion(whole, exact if any(exact) else tokens)
    cached = classes[0]
    out = tuple(PartCost(p, t, counts[0], c) for p, t, counts, c in zip(parts, tokens, split, costs, strict=True))
    return Anatomy(out, total, cached, whole)


def _classes(usage: Usage, total: int) -> tuple[int, int, int, int]:
    """(cache reads, 1-hour writes, 5-minute writes, uncached) tokens, in prompt order,
    clipped to the billed total."""
    read = min(usage.cache_read_tokens or 0, total)
    written = min(usage.cache_write_tokens or 0, total - read)
    hour = min(usage.cache_write_1h_tokens or 0, written)
    return read, hour, written - hour, total - read - written


def _split(tokens: list[int], classes: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """Each part's tokens by class: the parts lie end to end, and so do the classes."""
    bounds = []
    end = 0
    for c in classes:
        end += c
        bounds.append(end)
    out = []
    start = 0
    for t in tokens:
        stop = start + t
        counts = []
        lo = 0
        for hi in bounds:
            counts.append(max(0, min(stop, hi) - max(start, lo)))
            lo = hi
        out.append((counts[0], counts[1], counts[2], counts[3]))
        start = stop
    return out


def _rates(price: Price, usage: Usage, total: int) -> tuple[int, int, int, int]:
    """Rates of the four classes, as `pricing.cost` picks them (the tier multiplier applies
    to all alike, so it changes no share)."""
    size = max(total, (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0))
    r_in, r_cached, r_write, _ = price.rates(size)
    return r_cached, price.cache_write_1h_rate(size), r_write, r_in
