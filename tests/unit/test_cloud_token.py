"""The Vertex AI token in tenant mode: Application Default Credentials through the real
google-auth, against a fake of Google's token endpoint (tests/fixtures/google_token.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import google.oauth2.credentials
import pytest

from proxy.errors import UpstreamConnectError
from proxy.serve.cloud_token import CloudToken, NoCloudCredentials
from tests.fixtures.google_token import TokenEndpoint, service_account_key, token_endpoint  # noqa: F401

SetEnv = Callable[[str, str], None]


def _naive_utc(seconds: float) -> datetime:
    """An expiry as google-auth keeps one: naive, in UTC."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).replace(tzinfo=None)


async def test_adc_from_a_key_file_gives_a_token_fetched_once_while_it_is_fresh(
        token_endpoint: TokenEndpoint, tmp_path: Path, monkeypatch_env: SetEnv) -> None:  # noqa: F811
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    tokens = CloudToken()
    assert [await tokens.token() for _ in range(5)] == ["ya29.fake-1"] * 5
    assert token_endpoint.grants == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]


async def test_concurrent_calls_share_one_refresh(token_endpoint: TokenEndpoint, tmp_path: Path,  # noqa: F811
                                                  monkeypatch_env: SetEnv) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    tokens = CloudToken()
    got = await asyncio.gather(*(tokens.token() for _ in range(20)))
    assert set(got) == {"ya29.fake-1"} and len(token_endpoint.issued) == 1


async def test_a_token_within_the_early_margin_of_its_expiry_is_refreshed(
        token_endpoint: TokenEndpoint, tmp_path: Path, monkeypatch_env: SetEnv) -> None:  # noqa: F811
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    token_endpoint.expires_in = 240  # under the 300 s margin: never good enough to keep
    tokens = CloudToken()
    assert [await tokens.token() for _ in range(3)] == ["ya29.fake-1", "ya29.fake-2", "ya29.fake-3"]
    token_endpoint.expires_in = 3600
    assert [await tokens.token() for _ in range(3)] == ["ya29.fake-4"] * 3


async def test_a_caller_that_goes_away_does_not_cancel_the_refresh(
        token_endpoint: TokenEndpoint, tmp_path: Path, monkeypatch_env: SetEnv) -> None:  # noqa: F811
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    tokens = CloudToken()
    first = asyncio.ensure_future(tokens.token())
    second = asyncio.ensure_future(tokens.token())
    await asyncio.sleep(0)
    first.cancel()
    assert await second == "ya29.fake-1" and len(token_endpoint.issued) == 1


async def test_given_credentials_with_a_fresh_token_are_used_as_they_are() -> None:
    creds = google.oauth2.credentials.Credentials(token="ya29.given", expiry=_naive_utc(3600))
    assert await CloudToken(creds).token() == "ya29.given"


async def test_given_credentials_with_no_expiry_are_kept() -> None:
    tokens = CloudToken(google.oauth2.credentials.Credentials(token="ya29.forever"))
    assert [await tokens.token(), await tokens.token()] == ["ya29.forever"] * 2


async def test_a_token_in_its_last_minutes_that_cannot_be_refreshed_is_used_until_it_lapses() -> None:
    creds = google.oauth2.credentials.Credentials(token="ya29.late", expiry=_naive_utc(120))
    assert await CloudToken(creds).token() == "ya29.late"


async def test_an_expired_token_that_cannot_be_refreshed_is_a_401_naming_the_setting() -> None:
    creds = google.oauth2.credentials.Credentials(token="ya29.old", expiry=_naive_utc(-60))
    with pytest.raises(NoCloudCredentials) as ei:
        await CloudToken(creds).token()
    assert ei.value.status == 401 and "GOOGLE_APPLICATION_CREDENTIALS" in ei.value.message


async def test_no_adc_is_a_401_naming_the_setting_and_is_not_probed_again_at_once(
        tmp_path: Path, monkeypatch_env: SetEnv) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    tokens = CloudToken()
    with pytest.raises(NoCloudCredentials) as ei:
        await tokens.token()
    assert ei.value.status == 401 and "GOOGLE_APPLICATION_CREDENTIALS" in ei.value.message
    assert "missing.json" in ei.value.message, "google-auth's own reason is kept"
    with pytest.raises(NoCloudCredentials) as again:
        await tokens.token()
    assert again.value is ei.value, "answered from the failure, not looked up again"


async def test_a_token_endpoint_that_is_down_is_retryable(tmp_path: Path, monkeypatch_env: SetEnv) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(
        tmp_path / "sa.json", "http://127.0.0.1:9/token")))  # the discard port: nobody answers
    with pytest.raises(UpstreamConnectError) as ei:
        await CloudToken().token()
    assert ei.value.retryable and ei.value.status == 502


async def test_a_refused_grant_is_a_401(token_endpoint: TokenEndpoint, tmp_path: Path,  # noqa: F811
                                        monkeypatch_env: SetEnv) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    token_endpoint.refuse = True
    with pytest.raises(NoCloudCredentials) as ei:
        await CloudToken().token()
    assert ei.value.status == 401 and "Invalid JWT Signature" in ei.value.message
