"""Prompts of exact token length from a local tokenizer directory or the server's /tokenize."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.prompts import HfTokenizer, build_prompts
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer with BOS and a chat template, trained here (no download).

    Byte-level BPE on random words is the hard case for exact lengths: decoding random ids and
    re-encoding merges across token boundaries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words, size=40)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(d))
    return str(d)


def _server_side_len(tok, endpoint: str, prompt: str) -> int:
    """What a server would count: BOS on completions, the chat template on chat."""
    if endpoint == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return len(tok.encode(prompt, add_special_tokens=True))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("input_len,seed", [(4, 0), (37, 1), (256, 2), (1000, 3)])
def test_hf_tokenizer_prompts_have_exact_length(tokenizer_dir, endpoint, input_len, seed) -> None:
    tk = HfTokenizer(tokenizer_dir)
    prompts = asyncio.run(build_prompts(tk, 24, input_len, 8, endpoint=endpoint, seed=seed))
    assert len({p.prompt for p in prompts}) == len(prompts)  # distinct prompts: no prefix-cache freebies
    for p in prompts:
        assert p.mismatch == 0
        assert p.prompt_len == input_len
        assert _server_side_len(tk.tok, endpoint, p.prompt) == input_len
        assert p.output_len == 8


def test_prompts_are_deterministic_in_the_seed(tokenizer_dir) -> None:
    tk = HfTokenizer(tokenizer_dir)
    a = asyncio.run(build_prompts(tk, 6, 50, 4, seed=7))
    b = asyncio.run(build_prompts(tk, 6, 50, 4, seed=7))
    c = asyncio.run(build_prompts(tk, 6, 50, 4, seed=8))
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]


def test_range_ratio_spreads_lengths_like_vllm(tokenizer_dir) -> None:
    tk = HfTokenizer(tokenizer_dir)
    prompts = asyncio.run(build_prompts(tk, 200, 100, 40, seed=3, range_ratio=0.25))
    lens = np.array([p.prompt_len for p in prompts])
    outs = np.array([p.output_len for p in prompts])
    assert lens.min() >= 75 and lens.max() <= 125 and lens.std() > 5
    assert outs.min() >= 30 and outs.max() <= 50
    for p in prompts[:20]:
        assert _server_side_len(tk.tok, "completions", p.prompt) == p.prompt_len


def test_bad_tokenizer_dir_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(Glm5Fp4Error, match="not a directory"):
        HfTokenizer(str(tmp_path / "missing"))
    with pytest.raises(Glm5Fp4Error, match="cannot load a tokenizer"):
        HfTokenizer(str(tmp_path))


def test_server_tokenizer_prompts_match_server_counts() -> None:
    # The fake server counts with its own toy tokenizer (+1 BOS on completions, +4 on chat), so an
    # exact match of usage.prompt_tokens shows the prompts were fitted with the server's tokenizer.
    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1") as srv:
        for endpoint in ("completions", "chat"):
            res, rows = run_loadtest_detailed(LoadTestConfig(
                url=srv.url, endpoint=endpoint, concurrency=4, num_prompts=20, input_len=64, output_len=3,
                range_ratio=0.5, num_warmups=0, progress=False, telemetry=False))
            assert res["completed"] == 20 and res["prompt_len_mismatches"] == 0
            assert {r["server_prompt_tokens"] for r in rows} == {r["prompt_len"] for r in rows}
            assert len({r["prompt_len"] for r in rows}) > 5
            assert res["total_input_tokens"] == sum(r["prompt_len"] for r in rows)


@pytest.fixture
def odd_server():
    """An HTTP server on loopback whose replies the test sets: path -> (status, body text)."""
    import threading

    from aiohttp import web

    replies: dict[str, tuple[int, str]] = {}

    async def handle(request):
        status, text = replies.get(request.path, (404, "not found"))
        return web.Response(status=status, text=text, content_type="application/json")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", replies
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


MODELS_OK = '{"object": "list", "data": [{"id": "m", "object": "model"}]}'


@pytest.mark.parametrize("replies,culprit", [
    ({"/v1/models": (200, "<html>wrong port</html>")}, "/v1/models: the reply is not JSON"),
    ({"/v1/models": (200, '{"data": [{"name": "m"}]}')}, "/v1/models: model entry 0 has no string field 'id'"),
    ({"/v1/models": (200, MODELS_OK), "/tokenize": (200, '{"count": 3}')},
     "/tokenize: the reply has no field 'tokens'"),
    ({"/v1/models": (200, MODELS_OK), "/tokenize": (200, "[1, 2]")}, "/tokenize: the reply is a list, not an object"),
    ({"/v1/models": (200, MODELS_OK), "/tokenize": (200, "no json")}, "/tokenize: the reply is not JSON"),
])
def test_a_server_whose_replies_lack_fields_gets_one_error_naming_them(odd_server, replies, culprit, capsys, tmp_path):
    """A server on the wrong port, or one whose /v1/models or /tokenize replies are not vLLM's shapes: one error that
    names the URL and the missing field, no traceback, no result files."""
    from glm5_fp4.cli import main as cli_main

    url, table = odd_server
    table.update(replies)
    out = tmp_path / "res"
    rc = cli_main(["loadtest", "--url", url, "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                   "--num-warmups", "0", "--no-progress", "--no-telemetry", "--timeout", "10",
                   "--result-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and culprit in err and "Traceback" not in err, err
    assert not out.exists()
