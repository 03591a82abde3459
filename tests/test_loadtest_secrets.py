"""Secrets given to a load test never reach its result files, which get committed: the --api-key value (either
form) and the password of a user:password URL are redacted in everything the run writes."""

from __future__ import annotations

import asyncio
import base64
import sys

import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.client import base_url, make_session, redact_url, url_auth
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig

SECRET = "sk-hunter2-7f3a"


@pytest.fixture
def server():
    # every 4th request fails, so failure messages are written too; a fresh server per test: it counts arrivals
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--http-error-every", "4") as srv:
        yield srv


def _files_holding(root, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.parametrize("form", ["--api-key SECRET", "--api-key=SECRET", "--api-k SECRET", "url-password",
                                  "--url=url-password"])
def test_secrets_are_redacted_in_every_file_the_run_writes(server, tmp_path, monkeypatch, capsys, form) -> None:
    """Before: metadata.argv held the --api-key value and metadata.url (and tokenizer_id, built from it) the
    password."""
    url = server.url
    if "url-password" in form:
        url = url.replace("http://", f"http://bench:{SECRET}@")
        auth = [f"--url={url}"] if form.startswith("--url=") else ["--url", url]
    else:
        auth = ["--url", url, *form.replace("SECRET", SECRET).split()]
    argv = ["glm5-fp4", "loadtest", *auth, "--model", "fake-model", "--concurrency", "2,4", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "4", "--num-warmups", "1", "--no-progress", "--timeout", "30",
            "--max-failed-fraction", "0.5", "--result-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)  # what the run records
    assert cli_main() == 0
    assert len(list(tmp_path.glob("c*.json"))) == 2 and (tmp_path / "sweep.json").is_file()
    assert _files_holding(tmp_path, SECRET) == []
    assert SECRET not in capsys.readouterr().out
    assert _files_holding(tmp_path, "***"), "the redaction is marked where the secret was"


def test_a_url_password_is_still_sent() -> None:
    """The password leaves the URL the load test prints and records, not the requests: they carry it as basic
    auth, as aiohttp did for a URL with one; an --api-key beside it would be a second Authorization header."""
    url = f"http://bench:{SECRET}@127.0.0.1:8000/v1"
    assert base_url(url) == "http://127.0.0.1:8000"

    async def headers() -> dict:
        async with make_session(1, request_timeout_s=1, read_timeout_s=1, auth=url_auth(url)) as session:
            return dict(session.headers)

    want = "Basic " + base64.b64encode(f"bench:{SECRET}".encode()).decode()
    assert asyncio.run(headers())["Authorization"] == want
    with pytest.raises(Glm5Fp4Error, match="--api-key and a user:password in --url"):
        LoadTestConfig(url=url, api_key="k")


@pytest.mark.parametrize("text,want", [
    ("http://u:pw@127.0.0.1:8000", "http://u:***@127.0.0.1:8000"),
    ("see https://u:p@ss@[::1]:80/v1 and http://127.0.0.1:1", "see https://u:***@[::1]:80/v1 and http://127.0.0.1:1"),
    ("--url=http://user:pw@localhost/x?y=1", "--url=http://user:***@localhost/x?y=1"),
    ("http://token@127.0.0.1", "http://token@127.0.0.1"),  # a user name alone is no secret
    ("http://127.0.0.1:8000/a@b", "http://127.0.0.1:8000/a@b"),
])
def test_redact_url(text: str, want: str) -> None:
    assert redact_url(text) == want
