"""StreamRepairer: the concatenated output equals the repaired JSON at every split point."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from proxy.model import OutputSpec
from proxy.repair import StreamRepairer
from tests.repair.cases import load

CASES = load("stream.jsonl")


def spec_of(case: dict[str, Any]) -> OutputSpec:
    return OutputSpec(kind=case["spec"]["kind"], schema=case["spec"]["schema"])


def replay(case: dict[str, Any], chunks: list[str]) -> tuple[str, StreamRepairer]:
    r = StreamRepairer(spec_of(case), close_truncated=case["close_truncated"])
    out = [r.feed(c) for c in chunks]
    out.append(r.finish())
    return "".join(out), r


def check(case: dict[str, Any], out: str, r: StreamRepairer) -> None:
    assert out == case["output"]
    repair = r.repair
    if not case["actions"] and case["valid"] is None:
        assert repair is None
        return
    assert repair is not None
    assert sorted(repair.actions) == sorted(case["actions"])
    assert repair.valid == case["valid"]
    if "problems" in case:
        assert list(repair.problems) == case["problems"]


@pytest.mark.parametrize("case", CASES)
def test_whole_stream(case: dict[str, Any]) -> None:
    out, r = replay(case, [case["input"]])
    check(case, out, r)


@pytest.mark.parametrize("case", CASES)
def test_every_split_point(case: dict[str, Any]) -> None:
    text = case["input"]
    for cut in range(len(text) + 1):
        out, r = replay(case, [text[:cut], text[cut:]])
        check(case, out, r)


@pytest.mark.parametrize("case", CASES)
def test_one_character_at_a_time(case: dict[str, Any]) -> None:
    out, r = replay(case, list(case["input"]))
    check(case, out, r)


def test_clean_text_is_emitted_promptly() -> None:
    """Clean JSON is held back only for a pending comma or an unfinished token."""
    r = StreamRepairer(OutputSpec("json_object"))
    assert r.feed('{"a": ') == "{"  # a key waits for its value: a cut member is dropped whole
    assert r.feed('"xy') == '"a": "xy'
    assert r.feed('z", ') == 'z"'  # the comma may still turn out to be trailing
    assert r.feed('"b": [1') == ', "b": ['  # `1` may go on
    assert r.feed(", 2]}") == "1, 2]}"
    assert r.finish() == ""
    assert r.repair is None


def large_record_stream(rng: random.Random, n: int) -> tuple[str, list[Any]]:
    records = [{"id": i, "name": f'item {i} "q" {{x}}', "tags": ["a", "b"], "ok": i % 2 == 0} for i in range(n)]
    return orjson.dumps(records, option=orjson.OPT_INDENT_2).decode(), records


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_of_a_large_clean_stream_pass_byte_for_byte(seed: int) -> None:
    rng = random.Random(seed)
    text, _ = large_record_stream(rng, 300)
    chunks, i = [], 0
    while i < len(text):
        k = rng.randint(1, 97)
        chunks.append(text[i : i + k])
        i += k
    case = {"spec": {"kind": "json_schema", "schema": {"type": "array"}}, "close_truncated": False}
    out, r = replay(case, chunks)
    assert out == text
    assert r.repair is None


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_of_a_large_json5_stream_repair_the_same(seed: int) -> None:
    rng = random.Random(seed)
    text, records = large_record_stream(rng, 200)
    json5 = "Here:\n```json\n" + text.replace('"id"', "id").replace("]", ", ]") + "\n```\n"
    chunks, i = [], 0
    while i < len(json5):
        k = rng.randint(1, 64)
        chunks.append(json5[i : i + k])
        i += k
    case = {"spec": {"kind": "json_schema", "schema": {"type": "array"}}, "close_truncated": False}
    out, r = replay(case, chunks)
    whole, _ = replay(case, [json5])
    assert out == whole
    assert orjson.loads(out) == records
    assert r.repair is not None
    assert set(r.repair.actions) == {"fence", "prose", "unquoted_key", "trailing_comma"}


@pytest.mark.parametrize("case", CASES)
def test_behind_and_diverged_say_whether_the_output_so_far_is_the_input_unchanged(case: dict[str, Any]) -> None:
    """What lets a stream's events go out as they came: while the output is the input with
    its end held back the repairer is `behind`, once it differs it has `diverged`; at the
    end, it diverged exactly when the repaired text is not the text that came in."""
    text = case["input"]
    for chunks in ([text[:cut], text[cut:]] for cut in range(len(text) + 1)):
        r = StreamRepairer(spec_of(case), close_truncated=case["close_truncated"])
        fed = out = ""
        for c in chunks:
            fed, out = fed + c, out + r.feed(c)
            assert r.diverged == (not fed.startswith(out)), (chunks, out)
            assert r.behind == (not r.diverged and out != fed), (chunks, out)
        out += r.finish()
        assert r.diverged == (out != text) and not r.behind, (chunks, out)
