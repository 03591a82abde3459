"""Compile one recorded launch for a GPU target on a machine without that GPU, and read what came out.

The launch is specialised by Triton's own JIT binder (the code ``kernel[grid](...)`` runs before it
compiles: argument types, integer-1 constants, 16-byte divisibility hints, options), then compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``. So the cubin is the one the JIT would
build for those arguments on that GPU. From it we read:

* shared memory per block: Triton's metadata (``metadata.shared``, what the launch requests),
* registers, stack frame, spill stores/loads: ptxas's ``-v`` report for this very PTX (captured from
  Triton's own ptxas run, or by re-running the bundled ptxas with Triton's flags when the kernel came from
  Triton's cache), cross-checked against the cubin's resource table from the bundled ``cuobjdump``,
* the instructions the PTX uses: tensor-core MMA forms, the E4M3->f16x2 conversion, native FP4 MMAs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

from glm5_fp4.errors import Glm5Fp4Error


@dataclass
class Instructions:
    """What the PTX asks the tensor cores and converters to do (counts of static instructions)."""

    mma: dict[str, int] = field(default_factory=dict)  # e.g. {"mma.sync m16n8k16 f16": 64}
    cvt_e4m3x2_f16x2: int = 0
    fp4_native: dict[str, int] = field(default_factory=dict)  # mxf4nvf4 / f8f6f4 MMAs

    @property
    def has_mma(self) -> bool:
        return bool(self.mma) or bool(self.fp4_native)

    def mma_summary(self) -> str:
        return ", ".join(sorted(self.mma)) or "none"


@dataclass
class Build:
    """The resources and instructions of one compiled kernel."""

    kernel: str
    cc: int
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int | None
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    stack_bytes: int | None
    tmem_bytes: int | None
    instructions: Instructions
    compile_s: float
    ptxas_log: str = ""
    ptx: str = field(default="", repr=False)
    cubin: bytes = field(default=b"", repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        for raw in ("ptxas_log", "ptx", "cubin"):
            d.pop(raw)
        return d


# ---------------------------------------------------------------------------------------------------------
# Specialisation (Triton's JIT binder, without a driver)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Specialized:
    fn: object
    target: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: object  # the backend's options dataclass

    def key(self) -> tuple:
        """Identical keys compile to identical kernels (used to compile each distinct kernel once)."""
        opts = tuple(sorted((k, repr(v)) for k, v in self.options.__dict__.items() if k != "extern_libs"))
        return (
            self.fn.__name__,
            self.target.arch,
            tuple(sorted(self.signature.items())),
            tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
            tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
            opts,
        )

    def constexpr_values(self) -> dict:
        """Constexpr arguments by parameter name (for reports)."""
        names = self.fn.arg_names
        out = {}
        for path, v in self.constexprs.items():
            name = names[path[0]] if isinstance(path, tuple) else str(path)
            out[name] = getattr(v, "value", v)
        return out


def specialize(launch, cc: int) -> Specialized:
    """What ``launch.fn[grid](*args, **kwargs)`` would compile on a GPU of compute capability ``cc``."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    try:
        from triton.runtime.jit import create_function_from_signature
    except ImportError as exc:  # the binder is Triton-internal; name the version that moved it
        import triton

        raise Glm5Fp4Error(
            f"triton {triton.__version__}: triton.runtime.jit.create_function_from_signature not found; "
            "the compile matrix is written against triton 3.9's JIT internals"
        ) from exc
    # Triton <= 3.9 fuses FP multiply-adds by default (3.9 warns that 3.10 will not): keep what the GPU's
    # Triton (3.6 with torch 2.11) does unless the user chose.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    fn = launch.fn
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    # what JITFunction.run adds before binding
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    # (knobs JITFunction.run passes on in this Triton version; 3.6, the H200 image's, has fewer than 3.9)
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return Specialized(fn, target, signature, constexprs, attrs, options)


# ---------------------------------------------------------------------------------------------------------
# Reading the results
# ---------------------------------------------------------------------------------------------------------
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")

_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col(?:\.kind::(\w+))?[.\w:]*?\.f32\.(\w+)\.(\w+)\.f32\b")
_WGMMA = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)\b")
_TCGEN05 = re.compile(r"\btcgen05\.mma(?:\.ws)?\.cta_group::(\d)\.kind::(\w+)")
_CVT_E4M3 = re.compile(r"\bcvt\.rn\.f16x2\.e4m3x2\b")
# Native FP4 tensor-core forms (block-scaled): SM120 mma.sync kind::mxf4nvf4, SM100 tcgen05 kind::mxf4nvf4.
_FP4_KINDS = ("mxf4nvf4", "mxf4", "mxf8f6f4", "f8f6f4")


def parse_ptxas(log: str, kernel: str | None = None) -> dict:
    """Registers, stack frame and spill bytes from a ``ptxas -v`` report (the entry ``kernel``'s section)."""
    if kernel:
        sec = re.split(r"Compiling entry function '", log)
        for part in sec[1:]:
            if part.startswith(kernel + "'"):
                log = part
                break
    regs = _PTXAS_REGS.search(log)
    spill = _PTXAS_SPILL.search(log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(spill.group(1)) if spill else None,
        "spill_store_bytes": int(spill.group(2)) if spill else None,
        "spill_load_bytes": int(spill.group(3)) if spill else None,
    }


def scan_ptx(ptx: str) -> Instructions:
    """Count the tensor-core and conversion instructions a PTX module issues."""
    ins = Instructions()

    def bump(d, k):
        d[k] = d.get(k, 0) + 1

    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        if m := _MMA_SYNC.search(s):
            kind = m.group(2)
            if kind and any(kind.startswith(f) for f in _FP4_KINDS):
                bump(ins.fp4_native, f"mma.sync {m.group(1)} kind::{kind}")
            else:
                bump(ins.mma, f"mma.sync {m.group(1)} {m.group(3)}")
        elif m := _WGMMA.search(s):
            bump(ins.mma, f"wgmma {m.group(1)} {m.group(2)}")
        elif m := _TCGEN05.search(s):
            kind = m.group(2)
            target = ins.fp4_native if any(kind.startswith(f) for f in _FP4_KINDS) else ins.mma
            bump(target, f"tcgen05.mma kind::{kind}")
        if _CVT_E4M3.search(s):
            ins.cvt_e4m3x2_f16x2 += len(_CVT_E4M3.findall(s))
    return ins


_CP_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)?\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_LD_GLOBAL = re.compile(r"\bld\.global[\w.:]*?\.(?:v(\d)\.)?[bfsu](\d+)\b")


def global_load_widths(ptx: str) -> dict[str, int]:
    """Bytes per global-memory load or async copy -> how many such static instructions the PTX has
    ("cp.async 16", "ld 4", ...): a tile whose addresses Triton cannot prove contiguous and aligned is
    fetched in narrower pieces (more instructions for the same bytes)."""
    out: dict[str, int] = {}
    for m in _CP_ASYNC.finditer(ptx):
        key = f"cp.async {int(m.group(1), 0)}"
        out[key] = out.get(key, 0) + 1
    for m in _LD_GLOBAL.finditer(ptx):
        key = f"ld {int(m.group(1) or 1) * int(m.group(2)) // 8}"
        out[key] = out.get(key, 0) + 1
    return out


def _nvidia_tool(name: str) -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack bytes from the cubin's resource table (bundled ``cuobjdump -res-usage``)."""
    tool = _nvidia_tool("cuobjdump")
    if tool is None or not cubin:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = _RES_USAGE.search(text)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))} if m else {}


def rerun_ptxas(ptx: str, cc: int, options) -> str:
    """``ptxas -v`` on ``ptx`` with the flags Triton's CUDA backend uses (for kernels served from its cache)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(cc).path
    fmad = [] if options.enable_fp_fusion else ["--fmad=false"]
    extra = options.ptx_options.split(" ") if options.ptx_options else []
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", *extra,
               f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o", os.path.join(d, "k.o")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    return res.stderr + res.stdout


def compile_specialized(sp: Specialized) -> Build:
    """Compile and measure one specialised kernel."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    if sp.fn.is_gluon():  # (kernels/gluon_moe.py: Gluon's explicit-layout dialect has its own front end)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=sp.fn, signature=sp.signature, constexprs=sp.constexprs, attrs=sp.attrs)
    captured = io.StringIO()
    t0 = time.perf_counter()
    # Triton prints ptxas's -v report when asked; capture it rather than running ptxas twice.
    with knobs.nvidia.scope(), contextlib.redirect_stdout(captured):
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(src, target=sp.target, options=sp.options.__dict__)
    elapsed = time.perf_counter() - t0
    cc = int(sp.target.arch)
    log = captured.getvalue()
    name = kernel.metadata.name
    if _PTXAS_REGS.search(log) is None:  # served from Triton's cache: no ptxas ran
        log = rerun_ptxas(kernel.asm["ptx"], cc, sp.options)
    res = parse_ptxas(log, name)
    cub = cubin_resources(kernel.asm.get("cubin", b""))
    if cub and res["registers"] is not None and cub["registers"] != res["registers"]:
        raise Glm5Fp4Error(
            f"{name} sm_{cc}: ptxas reports {res['registers']} registers but the cubin {cub['registers']}"
        )
    md = kernel.metadata
    return Build(
        kernel=sp.fn.__name__,
        cc=cc,
        num_warps=int(md.num_warps),
        num_stages=int(md.num_stages),
        shared_bytes=int(md.shared),
        registers=res["registers"] if res["registers"] is not None else cub.get("registers"),
        spill_store_bytes=res["spill_store_bytes"],
        spill_load_bytes=res["spill_load_bytes"],
        stack_bytes=res["stack_bytes"] if res["stack_bytes"] is not None else cub.get("stack_bytes"),
        tmem_bytes=getattr(md, "tmem_size", None),
        instructions=scan_ptx(kernel.asm["ptx"]),
        compile_s=elapsed,
        ptxas_log=log,
        ptx=kernel.asm["ptx"],
        cubin=kernel.asm.get("cubin", b""),
    )
