"""Label bounding (tracing/labels.py) as a table, its bounds, and the cut span attributes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy import errors
from proxy.model import Call, Caller, CallRecord, Outcome, Repair, Rewrite, ToolRecord
from proxy.pricing import PriceTable
from tests.tracing.refusals import refuse
from tracing import attributes as A
from tracing import spans
from tracing.labels import KNOWN_ERROR_TYPES, LABEL_VALUE_LIMIT, LabelBounds
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

OTHER = A.LABEL_OTHER
PRICES = PriceTable.load(overrides={"acme-ft-1": {"input": 1.0, "output": 2.0}})
CALLER = Caller("acme", "run_b", "header")
HUGE = "x" * 20_000


def priced(model: str) -> str | None:
    """What proxy/app.py passes: the price table's name of a model."""
    price = PRICES.price(model)
    return price.model if price is not None else None


@pytest.mark.parametrize(
    ("label", "value", "admit", "expected"),
    [
        # models: the price table decides
        pytest.param("model", "gpt-4o", False, "gpt-4o", id="priced model, even for a refused call"),
        pytest.param("model", "acme-ft-1", False, "acme-ft-1", id="model priced in the config"),
        pytest.param("model", "models/gemini-2.5-pro", False, "models/gemini-2.5-pro", id="gemini models/ prefix"),
        pytest.param("model", "gpt-4o-2024-08-06", True, "gpt-4o-2024-08-06", id="dated variant of a priced model"),
        pytest.param("model", "gpt-4o-2024-08-06", False, "gpt-4o", id="variant on a refused call: its priced model"),
        pytest.param("model", "gpt-4o" + "-001" * 20, True, "gpt-4o", id="variant too long: its priced model"),
        pytest.param("model", "gpt-4o" + "-001" * 5000, True, "gpt-4o", id="20 kB variant: its priced model"),
        pytest.param("model", "my-finetune", True, OTHER, id="unpriced model"),
        pytest.param("model", "gpt-4o-audio", True, OTHER, id="a different model, not a variant"),
        pytest.param("model", HUGE, True, OTHER, id="20 kB unpriced model"),
        pytest.param("model", "", True, OTHER, id="empty model"),
        pytest.param("model", None, True, None, id="no model: no label"),
        # error types: known ones always; other tokens admitted on accepted calls only
        pytest.param("error_type", "429", False, "429", id="HTTP status"),
        pytest.param("error_type", "spanmeter.budget_exceeded", False, "spanmeter.budget_exceeded", id="our own"),
        pytest.param("error_type", "overloaded_error", False, "overloaded_error", id="provider's documented type"),
        pytest.param("error_type", "weird_upstream_code", True, "weird_upstream_code", id="new token, admitted"),
        pytest.param("error_type", "weird_upstream_code", False, OTHER, id="new token on a refused call"),
        pytest.param("error_type", "e" * (LABEL_VALUE_LIMIT + 1), True, OTHER, id="too long"),
        pytest.param("error_type", "bad type!", True, OTHER, id="not a token"),
        pytest.param("error_type", HUGE, True, OTHER, id="20 kB error type"),
        pytest.param("error_type", None, True, None, id="no error: no label"),
        # tool names: the providers' rule, first come first served
        pytest.param("tool", "get_weather", True, "get_weather", id="tool name"),
        pytest.param("tool", "mcp.files:read-v2", True, "mcp.files:read-v2", id="dots, colons, dashes"),
        pytest.param("tool", "get_weather", False, OTHER, id="new tool on a refused call"),
        pytest.param("tool", "t" * (LABEL_VALUE_LIMIT + 1), True, OTHER, id="tool name too long"),
        pytest.param("tool", "rm -rf /", True, OTHER, id="tool name with spaces"),
        pytest.param("tool", "", True, OTHER, id="empty tool name"),
        # spanmeter's own words
        pytest.param("kind", "max_tokens_clamp", True, "max_tokens_clamp", id="rewrite kind"),
        pytest.param("kind", HUGE, True, OTHER, id="kind that is no word"),
    ],
)  # fmt: skip
def test_label_bounding(label: str, value: Any, admit: bool, expected: str | None) -> None:
    bounds = LabelBounds(priced)
    assert getattr(bounds, label)(value, admit=admit) == expected


def test_admitted_values_stay_and_the_bound_holds() -> None:
    bounds = LabelBounds(priced, max_tool_names=3, max_model_variants=2, max_error_types=1)
    assert [bounds.tool(f"t{i}") for i in range(5)] == ["t0", "t1", "t2", OTHER, OTHER]
    assert bounds.tool("t1", admit=False) == "t1"  # admitted before: kept, even on a refused call
    assert [bounds.model(f"gpt-4o-00{i}") for i in range(4)] == ["gpt-4o-000", "gpt-4o-001", "gpt-4o", "gpt-4o"]
    assert bounds.model("gpt-4o-001", admit=False) == "gpt-4o-001"
    assert [bounds.error_type(e) for e in ("a_b", "c_d", "500")] == ["a_b", OTHER, "500"]
    for _ in range(3):  # priced and unpriced models never take a variant's room
        assert bounds.model("gpt-4o") == "gpt-4o" and bounds.model("nope") == OTHER


def test_a_refused_call_never_adds_a_value() -> None:
    bounds = LabelBounds(priced)
    sizes = (len(bounds.tools), len(bounds.error_types), len(bounds.kinds))
    for i in range(50):
        assert bounds.model(f"gpt-4o-{i:03d}", admit=False) == "gpt-4o"
        assert bounds.model(f"unpriced-{i}", admit=False) == OTHER
        assert bounds.error_type(f"err_{i}", admit=False) == OTHER
        assert bounds.tool(f"tool_{i}", admit=False) == OTHER
    assert (len(bounds.tools), len(bounds.error_types), len(bounds.kinds)) == sizes
    assert bounds.model("gpt-4o-007") == "gpt-4o-007"  # an accepted call may add it


def test_without_a_price_table_models_are_admitted_up_to_the_bound() -> None:
    bounds = LabelBounds(None, max_model_variants=2)
    assert [bounds.model(m) for m in ("a", "b", "c", HUGE)] == ["a", "b", OTHER, OTHER]
    assert bounds.model("c", admit=False) == OTHER


def test_every_error_type_spanmeter_raises_is_a_known_label_value() -> None:
    def walk(cls: type[errors.ProxyError]) -> Iterator[type[errors.ProxyError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)

    ours = {f"spanmeter.{cls.code}" for cls in walk(errors.ProxyError)}
    assert ours <= KNOWN_ERROR_TYPES, f"add to tracing/labels.py KNOWN_ERROR_TYPES: {sorted(ours - KNOWN_ERROR_TYPES)}"


# --- spans keep the real value, cut ---------------------------------------------------------------


@pytest.fixture
def tel_mem(tmp_path: object) -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    cfg = TelemetryConfig(local_dir=str(tmp_path), capture_content="SPAN_ONLY", content_cap_bytes=1000,
                          known_model=priced)  # fmt: skip
    tel = setup_telemetry(cfg, environ={}, extra_exporters=(memory,))
    yield tel, memory
    tel.shutdown()


def cut(text: str, limit: int = A.SPAN_NAME_LIMIT) -> str:
    return text[:limit] + "…"


def test_a_call_span_carries_steered_values_cut(tel_mem: tuple[Telemetry, InMemorySpanExporter]) -> None:
    tel, memory = tel_mem
    model, long = "m" * 20_000, "v" * 5000
    call = Call(api="chat", operation="chat", model=model, stop_sequences=(long, "END") * 100)
    outcome = Outcome(status=500, response_id=long, response_model=model, finish_reasons=(long,),
                      error_type=long, error_message=long, notes=(long,))  # fmt: skip
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "h", 1))
    spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=None, usage_source="",
                                       budget_remaining_micros=None,
                   rewrites=[Rewrite("loop_reminder", long)],
                   repairs=[Repair("output", ("fence",), False, (long,))]))  # fmt: skip
    (span,) = memory.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == f"chat {cut(model)}"
    assert attrs[A.GEN_AI_REQUEST_MODEL] == attrs[A.GEN_AI_RESPONSE_MODEL] == cut(model)
    assert attrs[A.GEN_AI_RESPONSE_ID] == attrs[A.ERROR_TYPE] == cut(long)
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == (cut(long),)
    assert attrs[A.GEN_AI_REQUEST_STOP_SEQUENCES] == (cut(long), "END") * (A.SPAN_LIST_LIMIT // 2)
    assert attrs[A.SPANMETER_OBSERVER_NOTES] == (cut(long, A.SPAN_TEXT_LIMIT),)
    assert [len(r) for r in attrs[A.SPANMETER_REWRITES]] == [A.SPAN_TEXT_LIMIT + 1]  # type: ignore[union-attr]
    assert [len(r) for r in attrs[A.SPANMETER_REPAIRS]] == [A.SPAN_TEXT_LIMIT + 1]  # type: ignore[union-attr]
    assert span.status.description is not None and len(span.status.description) <= 201
    text = tel.metrics_text().decode()
    assert "m" * (LABEL_VALUE_LIMIT + 1) not in text and "v" * (LABEL_VALUE_LIMIT + 1) not in text
    assert f'gen_ai_request_model="{OTHER}"' in text and f'error_type="{OTHER}"' in text


def test_a_refusal_span_carries_the_cut_message(tel_mem: tuple[Telemetry, InMemorySpanExporter]) -> None:
    tel, memory = tel_mem
    model = "gpt-4o-" + "1" * 9000
    call = Call(api="chat", operation="chat", model=model)
    refuse(tel, CALLER, call, errors.CeilingReached(f"Model {model!r} has no price", limit="unknown_price"))
    (span,) = memory.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs[A.GEN_AI_REQUEST_MODEL] == cut(model)
    assert attrs[A.SPANMETER_REFUSAL_REASON] == "unknown_price"
    assert span.status.description == cut(f"Model {model!r} has no price", 200)
    assert f'gen_ai_request_model="{OTHER}"' in tel.metrics_text().decode()


def test_a_tool_span_carries_steered_values_cut(tel_mem: tuple[Telemetry, InMemorySpanExporter]) -> None:
    tel, memory = tel_mem
    name, call_id, text = "tool_" + "n" * 3000, "call_" + "i" * 3000, "é" * 2000
    args = '{"q": "' + text + '"}'
    spans.tool_span(tel, ToolRecord(CALLER, name, call_id, args, text, 1, 2, is_error=False,
                                    description=text))  # fmt: skip
    spans.record_guard_action(tel, CALLER, "remind", tool_name=name, repeats=3)
    (span,) = memory.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == f"execute_tool {cut(name)}"
    assert attrs[A.GEN_AI_TOOL_NAME] == cut(name)
    assert attrs[A.GEN_AI_TOOL_CALL_ID] == cut(call_id)
    assert attrs[A.GEN_AI_TOOL_DESCRIPTION] == cut(text, A.SPAN_TEXT_LIMIT)
    for key in (A.GEN_AI_TOOL_CALL_ARGUMENTS, A.GEN_AI_TOOL_CALL_RESULT):  # content: the byte cap, 1000 here
        value = str(attrs[key])
        assert value.endswith("…") and len(value[:-1].encode()) <= 1000
    metrics = tel.metrics_text().decode()
    assert f'gen_ai_tool_name="{OTHER}"' in metrics and "nnnn" not in metrics
