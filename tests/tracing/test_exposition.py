"""Merging workers' expositions (tracing/exposition.py) over a table of recorded and
hand-written expositions (tests/data/exposition/), and what a scrape composes from the
workers' answers, their slot files and the retired workers' counters (proxy/serve/siblings.py)."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.siblings import WORKER_SERIES, Slot, compose, reset_state, retire
from tracing.exposition import merge

DATA = Path(__file__).resolve().parent.parent / "data" / "exposition"
CASES = [json.loads(line) for line in (DATA / "cases.jsonl").read_text().splitlines() if line.strip()]


def _inputs(case: dict[str, Any]) -> list[str]:
    return [(DATA / i).read_text() if i.endswith(".prom") else i for i in case["inputs"]]


def _options(case: dict[str, Any]) -> dict[str, Any]:
    options = dict(case.get("options", {}))
    if "summed_gauges" in options:
        options["summed_gauges"] = frozenset(options["summed_gauges"])
    return options


def _samples(text: str) -> list[tuple[str, str, dict[str, str], float]]:
    """(family type, sample name, labels, value), as the Prometheus client's own parser reads them."""
    return [(fam.type, s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def _total(text: str, name: str, labels: dict[str, str]) -> float:
    return sum(v for _, n, lab, v in _samples(text) if n == name and labels.items() <= lab.items())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_merge(case: dict[str, Any]) -> None:
    merged = merge(_inputs(case), **_options(case))
    if "output" in case:
        assert merged == case["output"]
    for name, labels, value in case.get("expect", []):
        assert _total(merged, name, labels) == pytest.approx(value), (name, labels)
    for name, count in case.get("series", []):
        assert sum(1 for _, n, _, _ in _samples(merged) if n == name) == count, name
    for name in case.get("absent", []):
        assert f"\n{name}" not in "\n" + merged, name
    # One HELP and one TYPE per family, whatever the inputs repeat.
    for what in ("# HELP ", "# TYPE "):
        declared = Counter(line.split()[2] for line in merged.splitlines() if line.startswith(what))
        assert all(n == 1 for n in declared.values()), (what, declared)


RECORDED = [c for c in CASES if all(i.endswith(".prom") for i in c["inputs"])]


@pytest.mark.parametrize("case", RECORDED, ids=[c["name"] for c in RECORDED])
def test_merge_agrees_with_an_independent_reading_of_the_inputs(case: dict[str, Any]) -> None:
    """Every series of the merge, against the Prometheus client's parse of each input:
    counters and histograms summed, gauges the maximum, nothing added, nothing lost."""
    options = _options(case)
    expected: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    kinds: dict[tuple[str, frozenset[tuple[str, str]]], str] = {}
    for text in _inputs(case):
        for kind, name, labels, value in _samples(text):
            summed = kind in ("counter", "histogram", "summary")
            if options.get("counters_only") and not summed:
                continue
            key = (name, frozenset((k, v) for k, v in labels.items() if v))  # empty: no label
            kinds[key] = kind
            old = expected.get(key)
            expected[key] = value if old is None else (old + value if summed else max(old, value))
    merged = merge(_inputs(case), **options)
    got = {(name, frozenset((k, v) for k, v in labels.items() if v)): value for _, name, labels, value in
           _samples(merged)}
    assert len(got) == len(_samples(merged)), "no two series Prometheus would take for one"
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), (kinds[key], key[0], dict(key[1]))


def test_the_merged_text_is_what_prometheus_clients_read_and_keeps_family_order() -> None:
    texts = [(DATA / f"worker-{n}.prom").read_text() for n in (1, 2, 3)]
    merged = merge(texts)
    first_seen: list[str] = []
    for text in texts:
        first_seen += [f.name for f in text_string_to_metric_families(text) if f.name not in first_seen]
    assert [f.name for f in text_string_to_metric_families(merged)] == first_seen
    assert merge([merged]) == merged  # a merge of one is itself


# --- what a scrape composes -------------------------------------------------------------------


def _exposition(count: float, spent: float, instance: str) -> str:
    return ("# HELP target_info Target metadata\n# TYPE target_info gauge\n"
            f'target_info{{service_instance_id="{instance}"}} 1.0\n'
            "# HELP calls_total Calls.\n# TYPE calls_total counter\n"
            f'calls_total{{tenant="acme"}} {count}\n'
            "# HELP spent_usd Spent.\n# TYPE spent_usd gauge\n"
            f'spent_usd{{tenant="acme"}} {spent}\n')


def _value(text: str, name: str) -> float:
    found = [v for _, n, _, v in _samples(text) if n == name]
    return found[0] if found else math.nan


def test_a_scrape_never_sees_counters_go_down_when_a_sibling_is_slow_or_dies(tmp_path: Path) -> None:
    state = tmp_path / "workers" / "8787"
    reset_state(state)
    scrapes: list[str] = []

    def scrape(by_slot: dict[int, Slot | None]) -> str:
        scrapes.append(compose(state, 2, by_slot))
        return scrapes[-1]

    # Two workers answer: 10 + 5.
    first = scrape({1: Slot(1, 100.0, _exposition(10, 0.5, "a")), 2: Slot(2, 100.0, _exposition(5, 0.7, "b"))})
    assert _value(first, "calls_total") == 15 and _value(first, "spent_usd") == 0.7
    assert _value(first, "spanmeter_metrics_workers") == 2 and _value(first, "spanmeter_metrics_workers_missing") == 0
    assert sum(1 for _, n, _, _ in _samples(first) if n == "target_info") == 2

    # Worker 2 does not answer in time: its last scraped values stand in, and it is counted missing.
    slow = scrape({1: Slot(1, 101.0, _exposition(12, 0.5, "a")), 2: None})
    assert _value(slow, "calls_total") == 17 and _value(slow, "spanmeter_metrics_workers_missing") == 1

    # Worker 2 answers again (it served 3 more), then dies; the supervisor retires it.
    scrape({1: Slot(1, 102.0, _exposition(12, 0.5, "a")), 2: Slot(2, 102.0, _exposition(8, 0.9, "b"))})
    retire(state, 2, 2)
    # A text of the dead worker fetched before its death but composed after the retirement
    # is not counted twice; its replacement (generation 3) starts from zero.
    late = scrape({1: Slot(1, 103.0, _exposition(12, 0.5, "a")), 2: Slot(2, 102.5, _exposition(8, 0.9, "b"))})
    assert _value(late, "calls_total") == 20
    replaced = scrape({1: Slot(1, 104.0, _exposition(13, 0.5, "a")), 2: Slot(3, 104.0, _exposition(1, 0.2, "c"))})
    assert _value(replaced, "calls_total") == 22  # 13 + 1 + the dead worker's 8
    assert {lab["service_instance_id"] for _, n, lab, _ in _samples(replaced) if n == "target_info"} == {"a", "c"}
    # Two scrapers at once: an answer collected before the one another scrape kept for the
    # slot neither replaces it nor is served instead of it.
    scrape({1: Slot(1, 105.0, _exposition(14, 0.5, "a")), 2: Slot(3, 105.0, _exposition(4, 0.2, "c"))})
    older = scrape({1: Slot(1, 104.5, _exposition(13, 0.5, "a")), 2: None})
    assert _value(older, "calls_total") == 8 + 4 + 14
    assert "generation=1 collected=105.0\n" in (state / "metrics" / "slot-1.prom").read_text()
    counts = [_value(s, "calls_total") for s in scrapes]
    assert counts == sorted(counts), counts  # never down
    assert all(name in scrapes[0] for name in WORKER_SERIES)


def test_a_worker_that_died_before_any_scrape_leaves_nothing_to_retire(tmp_path: Path) -> None:
    state = tmp_path / "w"
    reset_state(state)
    retire(state, 1, 1)
    text = compose(state, 2, {1: Slot(3, 1.0, _exposition(1, 0.1, "c")), 2: Slot(2, 1.0, _exposition(2, 0.1, "b"))})
    assert _value(text, "calls_total") == 3
    retire(state, 2, 2)
    reset_state(state)  # a new supervisor: nothing kept
    assert _value(compose(state, 1, {1: Slot(9, 2.0, _exposition(1, 0.1, "z"))}), "calls_total") == 1
    by_file = defaultdict(list)
    for path in (state / "metrics").iterdir():
        by_file[path.suffix].append(path.name)
    assert by_file[".prom"] == ["slot-1.prom"]
