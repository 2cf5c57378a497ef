"""The roles an API object plays (proxy/providers/roles.py) stay small, and every API object
spanmeter routes plays each role it is used as, with the role's own method signatures."""

from __future__ import annotations

import inspect
from typing import Any, Generic, Protocol

import pytest

from proxy.providers import bedrock
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.apis import FIXED_PATHS, answering, for_path
from proxy.providers.azure import azure_api
from proxy.providers.base import Exchange, Roles, roles_of
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.providers.roles import (
    AnswerReader,
    ErrorSpeaker,
    Events,
    PromptCache,
    RequestEditor,
    RequestReader,
)
from proxy.providers.translator import Api
from proxy.providers.vertex import VERTEX_ANTHROPIC, VERTEX_GEMINI

ROLES: list[type] = [RequestReader, RequestEditor, PromptCache, Events, AnswerReader, ErrorSpeaker, Api]
# What the shared code holds an API object as: the route, and each role of its calls.
PLAYED: list[type] = [Api, RequestReader, RequestEditor, PromptCache, AnswerReader, ErrorSpeaker]
MOST_MEMBERS = 8


def members(role: type) -> set[str]:
    """The attributes and methods a protocol asks for, its bases' included."""
    found: set[str] = set()
    for cls in role.__mro__:
        if cls in (Protocol, Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        found |= set(inspect.get_annotations(cls))
        found |= {name for name, value in cls.__dict__.items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return found


def _routed() -> dict[str, object]:
    """Every API object a path, an Azure route or an error answer can pick."""
    apis: dict[str, object] = {path: api for path, api in FIXED_PATHS.items()}
    apis["gemini"] = for_path("/v1beta/models/gemini-2.5-flash:generateContent")
    apis["vertex gemini"], apis["vertex anthropic"] = VERTEX_GEMINI, VERTEX_ANTHROPIC
    for kind in ("chat/completions", "responses", "embeddings"):
        for query in ("", "api-version=2024-02-01", "api-version=2024-10-21", "api-version=2025-04-01-preview"):
            apis[f"azure {kind} {query}"] = azure_api(kind, "d", v1=False, query=query)
        apis[f"azure v1 {kind}"] = azure_api(kind, None, v1=True, query="")
    apis["answering"] = answering("/nowhere", {})
    # Bedrock: Converse's route object, and the object of each InvokeModel body family (the
    # invoke route's own object only picks one of those per call: see the test below).
    apis["bedrock converse"] = bedrock.CONVERSE_API
    apis["bedrock invoke anthropic"], apis["bedrock invoke nova"] = bedrock._ANTHROPIC, bedrock._NOVA
    for fam, obj in bedrock._TEXT.items():
        apis[f"bedrock invoke {fam.name}"] = obj
    return apis


ROUTED = _routed()


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.__name__)
def test_every_role_has_at_most_eight_members(role: type) -> None:
    found = members(role)
    assert found, f"{role.__name__} has no members: is it a Protocol?"
    assert len(found) <= MOST_MEMBERS, f"{role.__name__} has {len(found)} members: {sorted(found)}; split it"


def test_the_roles_are_the_members_counted() -> None:
    assert members(AnswerReader) >= members(Events)
    assert members(Api) == {"api", "family", "provider", "upstream_setting", "names_deployment", "auth_headers",
                            "render_error", "open"}


@pytest.mark.parametrize("name", sorted(ROUTED))
@pytest.mark.parametrize("role", PLAYED, ids=lambda r: r.__name__)
def test_every_routed_api_object_plays_its_roles_with_their_signatures(name: str, role: type) -> None:
    api = ROUTED[name]
    assert api is not None
    assert isinstance(api, role), f"{name} ({type(api).__name__}) lacks {sorted(members(role) - set(dir(api)))}"
    for member in members(role):
        want = getattr(role, member, None)
        if not callable(want):
            continue
        have = inspect.signature(getattr(api, member))
        assert list(have.parameters) == list(inspect.signature(want).parameters)[1:], f"{name}.{member}{have}"


def test_the_invoke_route_is_an_api_that_opens_each_call_with_its_familys_object() -> None:
    assert isinstance(bedrock.INVOKE_API, Api)
    tr = bedrock.INVOKE_API.open(b'{"inputText": "hi", "textGenerationConfig": {"maxTokenCount": 9}}',
                                 "/model/amazon.titan-text-express-v1/invoke")
    assert tr.call.model == "amazon.titan-text-express-v1" and tr.call.max_output_tokens == 9


@pytest.mark.parametrize("name", sorted(ROUTED))
def test_an_api_objects_roles_are_itself_each_as_its_role(name: str) -> None:
    api: Any = ROUTED[name]
    roles = api.roles
    assert isinstance(roles, Roles) and roles.api == api.api
    played: list[object] = [roles.reader, roles.editor, roles.answers, roles.errors]
    assert all(role is api for role in played)
    assert roles.cache is api  # every API module so far has one (embeddings places nothing)


def test_an_object_without_a_role_is_refused_naming_the_role() -> None:
    class Half:
        api = "chat"

        def render_error(self, error: Any, request_id: str) -> bytes:
            return b""

        def render_stream_error(self, error: Any) -> bytes:
            return b""

    with pytest.raises(TypeError, match=r"RequestReader.*RequestEditor.*AnswerReader"):
        roles_of(Half())


def test_each_module_plays_the_roles_as_mypy_reads_them() -> None:
    """Run by mypy too (`mypy tests/unit/test_roles.py`): the request's type in the editor and
    the cache is the exchange the modules patch."""
    for api in (CHAT, RESPONSES, ANTHROPIC, GEMINI, EMBEDDINGS, VERTEX_GEMINI, VERTEX_ANTHROPIC):
        reader: RequestReader = api
        editor: RequestEditor[Exchange] = api
        cache: PromptCache[Exchange] = api
        answers: AnswerReader = api
        errors: ErrorSpeaker = api
        route: Api = api
        played: list[object] = [reader, editor, cache, answers, errors, route]
        assert all(role is api for role in played)
