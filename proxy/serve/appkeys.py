"""Typed application state: one AppKey per resource, set up in app.py's cleanup contexts."""

from __future__ import annotations

from aiohttp import web

from proxy.anatomy import Splits
from proxy.config import Settings
from proxy.govern.caching import PrefixMemory
from proxy.govern.ceilings import Plans
from proxy.govern.runs import Runs
from proxy.ledger.store import Store
from proxy.pricing import PriceTable
from proxy.serve.aws_sign import AwsSigner
from proxy.serve.background import Background
from proxy.serve.cloud_token import CloudToken
from proxy.serve.deployments import Deployments
from proxy.serve.tenants import KeyIndex
from proxy.serve.upstream import Upstream
from tracing.setup import Telemetry

SETTINGS = web.AppKey("settings", Settings)
KEYS = web.AppKey("keys", KeyIndex)
STORE = web.AppKey("store", Store)
PRICES = web.AppKey("prices", PriceTable)
UPSTREAM = web.AppKey("upstream", Upstream)
TEL = web.AppKey("telemetry", Telemetry)
RUNS = web.AppKey("runs", Runs)
BACKGROUND = web.AppKey("background", Background)
PREFIXES = web.AppKey("prefixes", PrefixMemory)  # stable prompt prefixes seen lately (proxy/govern/caching.py)
PLANS = web.AppKey("plans", Plans)  # the plan of each tenant and key (proxy/govern/ceilings.py)
DEPLOYMENTS = web.AppKey("deployments", Deployments)  # Azure deployment -> model (proxy/serve/deployments.py)
SPLITS = web.AppKey("splits", Splits)  # the cost anatomy's last split per run
CLOUD_TOKEN = web.AppKey("cloud_token", CloudToken)  # the machine's own cloud credentials' token (Vertex AI)
AWS_SIGNER = web.AppKey("aws_signer", AwsSigner)  # SigV4 for Bedrock, with AWS credentials kept (aws_sign.py)
