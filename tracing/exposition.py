"""Merging Prometheus text expositions: several workers' `/metrics` as one process's.

`merge(texts)` gives ONE exposition of the same shape a single process emits, so
dashboards and alert rules need no change: each family (`# TYPE`) merged by its own rule.
The rules: docs/scale.md, "Merging expositions".
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.utils import floatToGoString

__all__ = ["SUMMED_GAUGES", "SUMMED_TYPES", "Family", "merge", "parse", "render"]

SUMMED_TYPES: Final = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
# Gauges that are a per-worker quantity (summed, not maxed). spanmeter has none yet.
SUMMED_GAUGES: Final[frozenset[str]] = frozenset()
_SUFFIXES: Final = ("_total", "_bucket", "_sum", "_count", "_created", "_gsum", "_gcount", "_info")

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)'  # name
    r'(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?'  # labels, quoted values may hold } and \"
    r'[ \t]+(\S+)'  # value
    r'(?:[ \t]+\S+)?[ \t]*$'  # an optional timestamp, dropped
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted (label, escaped value)


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    # key -> (the sample's name and label text as first written, value)
    samples: dict[Key, tuple[str, float]] = field(default_factory=dict)


def _value(text: str) -> float | None:
    try:
        return float(text)  # accepts NaN, +Inf, -Inf as Prometheus writes them
    except ValueError:
        return None


def _belongs(sample: str, family: str) -> bool:
    return sample == family or (sample.startswith(family) and sample[len(family):] in _SUFFIXES)


def parse(text: str) -> list[Family]:
    """The families of one exposition, in order. A line that is not a valid sample is
    skipped; a sample outside any declared family makes an untyped family of its own."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                fam = families.get(name)
                if fam is None:
                    fam = families[name] = Family(name)
                if parts[1] == "HELP":
                    fam.help = parts[3] if len(parts) > 3 else ""
                else:
                    fam.type = parts[3].strip().lower() if len(parts) > 3 else "untyped"
                current = fam
            continue
        m = _SAMPLE.match(line)
        value = _value(m.group(3)) if m else None
        if m is None or value is None:
            continue
        name, labels = m.group(1), m.group(2) or ""
        if current is None or not _belongs(name, current.name):
            current = families.get(name) or families.setdefault(name, Family(name))
        # An empty label value is no label (Prometheus' rule): the exporter writes `x=""`
        # where another series of the family has `x`, and workers' families differ.
        key = (name, tuple(sorted((k, v) for k, v in _LABEL.findall(labels) if v)))
        current.samples[key] = (name + labels, value)
    return list(families.values())


def _rule(fam: Family, summed_gauges: frozenset[str]) -> str:
    if fam.type in SUMMED_TYPES or fam.name in summed_gauges:
        return "sum"
    return "min" if fam.name.endswith("_created") else "max"


def _combine(rule: str, key: Key, old: float, new: float) -> float:
    name = key[0]
    if name.endswith("_created"):
        rule = "min"
    elif rule == "sum" and any(label == "quantile" for label, _ in key[1]):
        rule = "max"
    if rule == "sum":
        return old + new
    if math.isnan(old):
        return new
    if math.isnan(new):
        return old
    return max(old, new) if rule == "max" else min(old, new)


def merge(texts: Iterable[str], *, summed_gauges: frozenset[str] = SUMMED_GAUGES,
          counters_only: bool = False) -> str:
    """One exposition out of several, by the rules in the module docstring."""
    merged: dict[str, Family] = {}
    for text in texts:
        for fam in parse(text):
            if counters_only and _rule(fam, summed_gauges) != "sum":
                continue
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Family(fam.name, fam.type, fam.help)
            elif into.help is None:
                into.help = fam.help
            rule = _rule(into, summed_gauges)
            for key, (spelling, value) in fam.samples.items():
                had = into.samples.get(key)
                into.samples[key] = (spelling, value) if had is None else (
                    had[0], _combine(rule, key, had[1], value))
    return render(merged.values())


def _go(value: float) -> str:
    """A value as the Prometheus client writes it (`+Inf`, `NaN`, `1e+06`)."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def render(families: Iterable[Family]) -> str:
    """Families as Prometheus text exposition (format 0.0.4)."""
    out: list[str] = []
    for fam in families:
        if fam.help is not None:
            out.append(f"# HELP {fam.name} {fam.help}\n")
        out.append(f"# TYPE {fam.name} {fam.type}\n")
        out.extend(f"{spelling} {_go(value)}\n" for spelling, value in fam.samples.values())
    return "".join(out)
