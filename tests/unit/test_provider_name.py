"""gen_ai.provider.name per the semantic conventions: the provider when the host names
one, else the API the client speaks; never the host. Table: tests/data/routes/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import Settings
from proxy.model import Caller
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.serve.routes import target_for
from tests.providers.cases import ApiObject

CASES = yaml.safe_load((Path(__file__).parents[1] / "data" / "routes" / "provider_names.yaml").read_text())
ADAPTERS: dict[str, ApiObject] = {"openai": CHAT, "anthropic": ANTHROPIC, "gemini": GEMINI}
SETTING = {"openai": "openai_base_url", "anthropic": "anthropic_base_url", "gemini": "gemini_base_url"}
CALLER = Caller("default", "run-1", "generated")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_provider_name(case: dict[str, Any]) -> None:
    adapter = ADAPTERS[case["dialect"]]
    up = case.get("upstream")
    if up is None:
        settings = Settings(**{SETTING[case["dialect"]]: case["base_url"]})
    else:
        settings = Settings(upstreams={up["name"]: {**{k: v for k, v in up.items() if k != "name"},
                                                    "dialect": case["dialect"]}})
    target = target_for(settings, adapter, CALLER, up["name"] if up else None)
    got = {"provider": target.provider, "server_address": target.server_address, "server_port": target.server_port}
    assert got == case["want"]


def test_one_value_per_dialect_whatever_the_unknown_host() -> None:
    for dialect, adapter in ADAPTERS.items():
        names = {target_for(Settings(**{SETTING[dialect]: f"http://host-{i}.example:{8000 + i}"}), adapter,
                            CALLER, None).provider for i in range(20)}
        assert names == {{"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini"}[dialect]}
