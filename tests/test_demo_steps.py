"""The demo's steps fail with one error naming the step, not a traceback from the client library."""

from __future__ import annotations

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.fake_server import spawn_fake_server


def test_an_error_reply_to_the_demo_requests_names_the_step():
    from glm5_fp4.demo import send_requests

    with spawn_fake_server("--http-error-every", "1", "--http-error-status", "500") as srv:
        with pytest.raises(Glm5Fp4Error, match="step 4: the server answered InternalServerError"):
            send_requests(srv.url, "fake-model")


def test_the_demo_requests_against_a_working_server(capsys):
    from glm5_fp4.demo import send_requests

    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1") as srv:
        send_requests(srv.url, "fake-model")
    out = capsys.readouterr().out
    assert "completion:" in out and "chat:" in out and "streaming:" in out
