"""Azure deployments and the models they run: what a call naming a deployment is reserved at.

A deployment is the operator's own name for a model (`prod-chat`), so the price table cannot
know it. The configured map (`azure_deployments`) says which model each runs; a deployment
it does not list is learned from its answers, which name the model that ran. What was
learned is kept per process, bounded, and never overrides the configured map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["Deployments", "unmapped_hint"]

_LEARNED_MAX: Final = 1024  # deployment names come from callers: the memory is bounded


class Deployments:
    def __init__(self, configured: Mapping[str, str]) -> None:
        self._configured = dict(configured)
        self._learned: dict[str, str] = {}

    def model(self, deployment: str) -> str | None:
        """The model the deployment runs: configured, else learned, else None."""
        return self._configured.get(deployment) or self._learned.get(deployment)

    def learn(self, deployment: str, model: str | None) -> None:
        """An answer of `deployment` says `model` ran (a stream's first chunk says "")."""
        if not model or deployment in self._configured:
            return
        if deployment in self._learned or len(self._learned) < _LEARNED_MAX:
            self._learned[deployment] = model


def unmapped_hint(deployment: str) -> str:
    return (f" {deployment!r} is an Azure deployment, and spanmeter does not know yet which model it runs: name "
            f"it under `azure_deployments:` in the config file (e.g. azure_deployments: {{{deployment}: "
            "gpt-4.1-mini}), or SPANMETER_AZURE_DEPLOYMENTS='{\"" + deployment + "\": \"gpt-4.1-mini\"}'. "
            "Without a cost ceiling spanmeter also learns it from the deployment's first answer.")
