"""Where a Vertex AI call goes and with which credentials (tests/data/routes/vertex_upstreams.yaml):
the full path goes upstream unchanged, to vertex_base_url or the host of the path's location."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import Settings
from proxy.errors import UnknownRoute
from proxy.model import Caller
from proxy.serve.routes import match, target_for

CASES = yaml.safe_load((Path(__file__).parents[1] / "data" / "routes" / "vertex_upstreams.yaml").read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_vertex_upstream(case: dict[str, Any]) -> None:
    for name, value in (case.get("env") or {}).items():
        os.environ[name] = value  # clean_environ (conftest) restores the environment
    route = match(case["path"])
    assert route.api is not None and route.api.family == "vertex"
    caller = Caller(case.get("tenant", "default"), "run-1", "generated", upstream_key=case.get("caller_key"))
    target = target_for(Settings(**case.get("settings", {})), route.api, caller, None, route.path)
    got = {"base_url": target.base_url, "provider": target.provider, "server_address": target.server_address,
           "server_port": target.server_port, "auth": target.auth, "ambient_token": target.ambient_token}
    assert {k: got[k] for k in case["want"]} == case["want"]


def test_a_path_with_no_location_and_no_base_url_is_refused_naming_the_setting() -> None:
    route = match("/v1/projects/p/locations/us-east5/publishers/google/models/gemini-2.5-flash:generateContent")
    assert route.api is not None
    with pytest.raises(UnknownRoute) as ei:
        target_for(Settings(), route.api, Caller("default", "r", "generated"), None, "/v1/elsewhere")
    assert "SPANMETER_VERTEX_BASE_URL" in ei.value.message
