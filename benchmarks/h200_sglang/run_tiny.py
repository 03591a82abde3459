"""Issue 19 item 2: tiny GLM-5 (real DSA) and GLM-4.5 in NVFP4 served by SGLang 0.5.15: ours vs Marlin vs the BF16 twin.

One device call; the engine-free part (checkpoints, waves, comparison, verdicts) is benchmarks/h200/tiny.py, the
same as vLLM's. Each server is a launch profile (glm5_fp4.launch, spelled for SGLang 0.5.15; every command is
parsed by 0.5.15's own ServerArgs in tests/sglang/test_sglang_versions.py), TP1, loopback, on checkpoints of the
``routed-only`` recipe (only routed experts NVFP4, as GLM-5.1/5.2-NVFP4: SGLang 0.5.15 runs NVFP4 *linear*
layers on SM90 through a Marlin GEMM it JIT-compiles at the first forward, minutes of nvcc per server, which held
every NVFP4 server of the first H200 run at /health 503; prewarm_jit.py says more). The servers of both
architectures start in two stages (``STAGES``; ten at once on 16 cores competed for the CPU): the references and
ours with graphs, then, once those are collected and stopped, the rest; the stock Marlin server starts only after
the JIT pre-warm (prewarm_jit.py, started after install) is done (fleet.PrewarmGate, bounded), so its start-up
clock starts then:

* ``ours`` / ``ours-eager``   ``--moe-runner-backend glm5_fp4`` (our plugin, backend triton) with
  ``--disable-shared-experts-fusion``: decode full CUDA graphs + prefill breakable graphs (SGLang's defaults, the
  prefill ones at ``PREFILL_GRAPH_TOKENS`` only) / graphs disabled
* ``bf16`` / ``bf16-graphs``   stock SGLang on the BF16 twin (no quantization, its own Triton MoE): graphs
  disabled (the reference) / graphs
* ``marlin``                   stock ``--moe-runner-backend marlin`` under ``modelopt_fp4`` (W4A16 on SM90; what
  ``auto`` resolves to there), graphs disabled, ``--disable-shared-experts-fusion`` (the shared expert is BF16 in
  a routed-only checkpoint; SGLang's fusion would load it as a 257th NVFP4 expert: sgl-project/sglang#29562)

What every server shares (and why): ``--attention-backend triton`` for GLM-4.5 and the GLM-5 dense-attention view
(FlashAttention 3's kernels, ``sgl_kernel/flash_ops``, are not shipped; Triton MHA/MLA needs no JIT); GLM-5 with
real DSA uses SGLang's ``dsa`` backend with an FP8 KV cache, which on SM90 selects FlashMLA (``flashmla_kv``) for
prefill and decode, its dense-MHA prefill (FA3 on SM90) switched off (fleet.DSA_ARGS, DSA_ENV say why);
``--sampling-backend pytorch`` and ``--grammar-backend none`` (no FlashInfer sampling JIT, no xgrammar);
``--disable-radix-cache`` (the teacher-forced pass never starts from the greedy pass's cached prefix);
``--mem-fraction-static`` high with the KV pool capped by ``--max-total-tokens``: SGLang sizes its KV cache from
memory free at two moments, which other servers starting at the same time change, and refuses to start when the
difference is negative.

On a CPU machine SGLang cannot serve: ``--fake-servers`` (default there) runs the same matrix, in the same stages, with
benchmarks/h200/fake_sglang.py standing in for each server (the real command recorded beside it), to rehearse the
orchestration, the client calls and the verdicts; no number it prints is a measurement.

    OUT=/dir python benchmarks/h200_sglang/run_tiny.py [--deadline-s 510] [--tokens 32] [--prompts 4]
Output: $OUT/h200_sglang_tiny_summary.json and $OUT/h200_sglang_tiny.tar.gz (logs, collections, summary). Exit 1
if any check failed or a needed server did not start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "h200")]

import tiny  # noqa: E402
from fleet import DSA_KV_CACHE, PrewarmGate, SglangSpec, add_fake_servers_option, gpu_and_fake  # noqa: E402

# Up to six tiny servers at once: the static fraction only has to pass SGLang's start-up check (see the module
# docstring); each KV pool is 8192 tokens (8 sequences x 512 + room).
MEM_FRACTION, MAX_TOTAL_TOKENS, MAX_RUNNING, CONTEXT = 0.9, 8192, 8, 512
RECIPE = "routed-only"
# Stage 1: the references and ours with graphs (4 servers); stage 2: ours eager, the twin with graphs and stock
# Marlin (6, four of them eager: no capture), Marlin last so the others start while it waits for the pre-warm.
STAGES = (("bf16", "ours"), ("ours-eager", "bf16-graphs", "marlin"))
# Prefill (breakable) CUDA graphs at a few token counts instead of SGLang's 30 up to the context (the first H200
# run's tiny servers captured [4, 8, ..., 512]); the teacher-forced pass sends 4 x 48 tokens.
PREFILL_GRAPH_TOKENS = [16, 64, 192, CONTEXT]
# A stock server waits at most this long for the pre-warm before it starts anyway (and builds for itself).
PREWARM_WAIT_S = 240.0


def matrix(arch: str, ckpts: dict[str, Path]) -> list[SglangSpec]:
    """Ours and the twin both with graphs and eager (the graph yardstick); stock Marlin eager (the kernel yardstick)."""
    dsa = arch == "glm5"
    base = ["--disable-radix-cache", "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
    graphs = [*base, "--cuda-graph-bs-prefill", *map(str, PREFILL_GRAPH_TOKENS)]
    common = dict(attention_backend="dsa" if dsa else "triton", kv_cache_dtype=DSA_KV_CACHE if dsa else "auto",
                  mem_fraction=MEM_FRACTION, max_running=MAX_RUNNING, context_length=CONTEXT)
    twin, quant = ckpts[f"{arch}-bf16"], ckpts[arch]
    return [SglangSpec(f"{arch}-bf16", twin, "auto", "none", eager=True, extra_args=base, **common),
            SglangSpec(f"{arch}-bf16-graphs", twin, "auto", "none", extra_args=graphs, **common),
            SglangSpec(f"{arch}-ours", quant, "glm5_fp4", "modelopt_fp4", extra_args=graphs, **common),
            SglangSpec(f"{arch}-ours-eager", quant, "glm5_fp4", "modelopt_fp4", eager=True, extra_args=base, **common),
            SglangSpec(f"{arch}-marlin", quant, "marlin", "modelopt_fp4", eager=True,
                       extra_args=[*base, "--disable-shared-experts-fusion"], **common)]


def all_specs(root: Path) -> list[SglangSpec]:
    """Every server this script can start (both waves and the dense-view fallback), checkpoints under ``root``
    (tiny.make_checkpoints puts the routed-only ones in ``root / RECIPE``)."""
    root = root / RECIPE
    ckpts = {k: root / k for a in ("glm5", "glm5dense", "glm4moe") for k in (a, f"{a}-bf16")}
    return [s for a in ("glm5", "glm5dense", "glm4moe") for s in matrix(a, ckpts)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tiny.add_arguments(ap)
    add_fake_servers_option(ap)
    args = ap.parse_args(argv)
    gpu, fake = gpu_and_fake(ap, args)

    def gate(run) -> dict:
        # bounded when the wait begins: Marlin still needs ~2 min to start after it
        return {"gate": PrewarmGate(lambda: min(PREWARM_WAIT_S, run.left() - 150),
                                    on_record=lambda r: run.summary.__setitem__("prewarm", r))}

    return tiny.run("h200_sglang_tiny", "sglang", matrix, {"fake": fake}, gpu, dsa=True, gpu_dims=True,
                    default_archs=["glm5", "glm4moe"], args=args, stages=STAGES, recipe=RECIPE, on_fleet=gate)


if __name__ == "__main__":
    sys.exit(main())
