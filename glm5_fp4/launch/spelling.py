"""Which flag an engine's parser reads a command-line argument as, so a flag the launcher sets (the bind host, a
profile's sizes) cannot come back through extra args under another spelling: ``--hos 0.0.0.0`` binds every
interface in both engines exactly as ``--host 0.0.0.0`` does.

Both engines parse with argparse (abbreviations allowed): an argument is an option when it is one, when its part
before ``=`` is, or when it is a prefix of exactly one option (``--max-running`` is ``--max-running-requests``; a
prefix of several is refused by the engine as ambiguous); a two-character option takes its value glued on
(``-qfp8`` is ``-q fp8``). vLLM's FlexibleArgumentParser first reads ``_`` as ``-`` up to the first ``.``
(``--tensor_parallel_size``), and ``--flag.key V`` as ``--flag '{"key": V}'`` (``-cc.cudagraph_mode=NONE``).

A flag listed as ``--name.key`` stands for that key of the JSON flag ``--name`` only.
tests/test_launch_flag_spellings.py checks the result against vLLM 0.32's and 0.33's and SGLang 0.5.23's own parsers,
for every prefix of every option.
"""

from __future__ import annotations

from collections.abc import Iterable


def read_as(engine: str, arg: str, flags: Iterable[str]) -> list[str]:
    """The flags among ``flags`` that ``engine``'s parser may read ``arg`` as: one, several (a prefix of each, which
    the engine refuses as ambiguous; refused here all the same) or none."""
    if len(arg) < 2 or arg == "--" or not arg.startswith("-"):
        return []  # a value, stdin's "-", or the end of options
    key = arg.split("=", 1)[0]
    head, sub = key, ""
    if engine == "vllm":
        head, _, sub = key.partition(".")
        if head.startswith("--"):
            head = "--" + head[2:].replace("_", "-")
    long = head.startswith("--")
    hits = []
    for flag in flags:
        flag_head, _, flag_sub = flag.partition(".")
        # a dotted flag (-cc.cudagraph_mode) is also set by the whole object (-cc '{...}'): vLLM turns the dotted
        # keys into one JSON after the user's, which then loses every key of its own
        if flag_sub and sub and flag_sub != sub:
            continue
        prefix = len(head) > (2 if long else 1) and flag_head.startswith(head)
        glued = not long and len(flag_head) == 2 and flag_head != "--" and head.startswith(flag_head)
        if flag_head == head or prefix or glued:
            hits.append(flag)
    return hits


def spelled(engine: str, arg: str, flag: str) -> str:
    """``arg``'s flag as the user wrote it, and what the engine reads it as where that differs (for messages)."""
    written = arg.split("=", 1)[0]
    return written if written == flag else f"{written} ({'vLLM' if engine == 'vllm' else 'SGLang'} reads it as {flag})"
