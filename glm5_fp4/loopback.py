"""The loopback rule, in one place: servers bind 127.0.0.1 and load tools target this machine unless the user
opts in (``--allow-remote``)."""

from __future__ import annotations

import ipaddress

from glm5_fp4.errors import Glm5Fp4Error

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a name for them (0.0.0.0 and :: are every interface, not loopback)."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_host(host: str, allow_remote: bool, where: str = "--host") -> None:
    """A server's bind address: loopback, or the user said --allow-remote (the API has no authentication)."""
    if allow_remote or is_loopback(host):
        return
    raise Glm5Fp4Error(
        f"{where} {host}: the server's OpenAI API has no authentication and would be open to other machines. "
        "Bind 127.0.0.1 (the default), or pass --allow-remote to expose it on purpose and give it a key: "
        "vLLM `-- --api-key KEY` (or VLLM_API_KEY), SGLang `--api-key KEY` in the profile's extra_args"
    )
