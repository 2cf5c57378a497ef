"""Loads the recorded fixtures of tests/data/<dialect>/ as test cases.

- `<stem>.request.json` ({path, body}, recorded from the real SDK by record_requests.py)
  + `<stem>.call.json` ({name, call}): parse_request gives that Call.
- `<stem>.response.json` ({name, body, outcome}): parse_response folded gives that Outcome.
- `<stem>.sse` (raw bytes, real framing) + `<stem>.outcome.json` ({name, outcome}).

Expected objects list only the fields that differ from the dataclass defaults; every
other field must still equal its default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.model import Call, Outcome
from proxy.providers.anthropic import ANTHROPIC, AnthropicAdapter
from proxy.providers.chat import CHAT, ChatAdapter
from proxy.providers.embeddings import EMBEDDINGS, EmbeddingsAdapter
from proxy.providers.gemini import GEMINI, GeminiAdapter
from proxy.providers.responses import RESPONSES, ResponsesAdapter

# An API object of any module, with every role it plays (proxy/providers/roles.py).
ApiObject = ChatAdapter | ResponsesAdapter | AnthropicAdapter | GeminiAdapter | EmbeddingsAdapter

DATA = Path(__file__).resolve().parent.parent / "data"

ADAPTERS: dict[str, ApiObject] = {
    "chat": CHAT, "responses": RESPONSES, "anthropic": ANTHROPIC, "gemini": GEMINI,
    "embeddings": EMBEDDINGS,
}


@dataclass(frozen=True)
class Case:
    dialect: str
    name: str
    input: Any  # request {path, body} | response body | SSE bytes
    expected: dict[str, Any]

    @property
    def adapter(self) -> ApiObject:
        return ADAPTERS[self.dialect]

    def __str__(self) -> str:
        return f"{self.dialect}: {self.name}"


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def request_cases() -> list[Case]:
    out = []
    for dialect in ADAPTERS:
        for f in sorted((DATA / dialect).glob("*.call.json")):
            spec = _load(f)
            recorded = _load(f.with_name(f.name.replace(".call.json", ".request.json")))
            out.append(Case(dialect, spec["name"], recorded, spec["call"]))
    return out


def response_cases() -> list[Case]:
    return [Case(d, (s := _load(f))["name"], s["body"], s["outcome"])
            for d in ADAPTERS for f in sorted((DATA / d).glob("*.response.json"))]


def stream_cases() -> list[Case]:
    out = []
    for dialect in ADAPTERS:
        for f in sorted((DATA / dialect).glob("*.sse")):
            spec = _load(f.with_suffix(".outcome.json"))
            out.append(Case(dialect, spec["name"], f.read_bytes(), spec["outcome"]))
    return out


def normalised(obj: Any) -> Any:
    """A dataclass as plain JSON values (tuples become lists, named tuples objects)."""
    return json.loads(json.dumps(_plain(obj)))


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {k: _plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def expected_call(fields: dict[str, Any]) -> Any:
    base = normalised(Call(api=fields["api"], operation=fields["operation"], model=None))
    return {**base, **fields}


def expected_outcome(fields: dict[str, Any]) -> Any:
    return {**normalised(Outcome()), **fields}


def repair_cases() -> list[Case]:
    """`<dialect>/repairs.json`: a request, the tenant's repair policy, the upstream's answer
    (a whole body, or an SSE stream as text) and what the agent receives."""
    return [Case(d, c["name"], c, c["expected"])
            for d in ADAPTERS if (f := DATA / d / "repairs.json").exists() for c in _load(f)]


def input_message_cases() -> list[Case]:
    """`<dialect>/input_messages.json`: each recorded request's content as captured."""
    out = []
    for dialect in ADAPTERS:
        f = DATA / dialect / "input_messages.json"
        for stem, expected in _load(f).items() if f.exists() else ():
            body = _load(DATA / dialect / f"{stem}.request.json")["body"]
            out.append(Case(dialect, stem, body, expected))
    return out


def retry_cases() -> list[Case]:
    """`exchange/retry.jsonl`: a request asked once more, with the answer and the feedback."""
    lines = (DATA / "exchange" / "retry.jsonl").read_text().splitlines()
    return [Case((c := json.loads(line))["api"], c["name"], c, c["expected"]) for line in lines if line.strip()]
