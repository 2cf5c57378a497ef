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

from proxy.ledger.pricing import Price, cost
from proxy.model import Anatomy, InputPart, Usage

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
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    if left:
        rests = [total * w % whole for w in weights]
        # sorted is stable, also in reverse: equal remainders go to the earliest parts
        for i in sorted(range(n), key=rests.__getitem__, reverse=True)[:left]:
            shares[i] += 1
    return shares


def anatomy(parts: Sequence[InputPart], usage: Usage, price: Price | None) -> Anatomy | None:
    """The parts' shares of `usage`'s input, or None when the input is unknown."""
    total = usage.input_tokens
    if total is None or not parts:
        return None
    tokens = apportion(total, [p.size for p in parts])
    read, hour, five = _classes(usage, total)
    cached = _prefix(tokens, read)
    if price is None:
        zero = [0] * len(tokens)
        return Anatomy(list(parts), tokens, cached, zero, total, 0, _kinds(parts, tokens, cached, zero))
    whole = cost(price, replace(usage, output_tokens=0))
    r_cached, r_hour, r_five, r_in = _rates(price, usage, total)
    # A part's exact cost: all its tokens at the input rate, less what each of its
    # cached or written tokens bills below (or above) it.
    d_cached = r_in - r_cached
    exact = [t * r_in - c * d_cached for t, c in zip(tokens, cached, strict=True)]
    if hour or five:  # only Anthropic writes: the windows after the reads
        hours = _window(tokens, read, read + hour)
        fives = _window(tokens, read + hour, read + hour + five)
        d_hour, d_five = r_in - r_hour, r_in - r_five
        exact = [e - h * d_hour - f * d_five for e, h, f in zip(exact, hours, fives, strict=True)]
    costs = apportion(whole, exact if any(exact) else tokens)
    return Anatomy(list(parts), tokens, cached, costs, total, whole, _kinds(parts, tokens, cached, costs))


def _kinds(parts: Sequence[InputPart], tokens: list[int], cached: list[int], costs: list[int],
           ) -> dict[str, tuple[int, int, int]]:
    acc: dict[str, tuple[int, int, int]] = {}
    for p, t, c, m in zip(parts, tokens, cached, costs, strict=True):
        row = acc.get(p.kind)
        acc[p.kind] = (t, c, m) if row is None else (row[0] + t, row[1] + c, row[2] + m)
    return acc


def _classes(usage: Usage, total: int) -> tuple[int, int, int]:
    """(cache reads, 1-hour writes, 5-minute writes) tokens, in prompt order, clipped to
    the billed total; the rest is uncached."""
    read = min(usage.cache_read_tokens or 0, total)
    written = min(usage.cache_write_tokens or 0, total - read)
    hour = min(usage.cache_write_1h_tokens or 0, written)
    return read, hour, written - hour


def _prefix(tokens: list[int], limit: int) -> list[int]:
    """Each part's tokens among the first `limit` of the prompt (the parts lie end to end)."""
    out = [0] * len(tokens)
    i = 0
    while limit > 0 and i < len(tokens):
        out[i] = t = min(tokens[i], limit)
        limit -= t
        i += 1
    return out


def _window(tokens: list[int], lo: int, hi: int) -> list[int]:
    """Each part's tokens at positions lo..hi of the prompt."""
    return [b - a for a, b in zip(_prefix(tokens, lo), _prefix(tokens, hi), strict=True)]


def _rates(price: Price, usage: Usage, total: int) -> tuple[int, int, int, int]:
    """Rates of the cached, 1-hour written, 5-minute written and uncached tokens, as
    `pricing.cost` picks them (the tier multiplier applies to all alike, so it changes no share)."""
    size = max(total, (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0))
    r_in, r_cached, r_write, _ = price.rates(size)
    return r_cached, price.cache_write_1h_rate(size), r_write, r_in
