"""What the SGLang entry point registers: the CLI name, the runner core, the three method hooks (and the
per-layer timer hooks when ``GLM5_FP4_LAYER_TIMERS=1``). Version differences (0.5.23 / 0.5.15) are in
:mod:`glm5_fp4.engines.sglang.compat`."""

from __future__ import annotations

from glm5_fp4.engines.sglang import NAME


def _check_targets(compat) -> None:
    """Resolve every hook target before registering anything: SGLang's HookRegistry logs a target it cannot find and
    goes on, so a class renamed upstream left the name accepted and the server failing later in SGLang's own code."""
    import pkgutil

    from glm5_fp4.engines.layer_timers import sglang_hooks
    from glm5_fp4.engines.sglang.hooks import HOOKS, TARGET
    from glm5_fp4.errors import Glm5Fp4Error

    targets = [f"{TARGET}.{method}" for method in HOOKS]
    if not compat.has_runner_core_registry():
        targets += list(compat.legacy_hooks())
    targets += list(sglang_hooks())
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    if missing:
        raise Glm5Fp4Error(f"SGLang {compat.running_version()} has no {', '.join(missing)}: glm5-fp4 hooks these in "
                           f"SGLang {compat.PRIMARY} (and {compat.VEHICLE}); --moe-runner-backend {NAME} is not "
                           "registered")


def register_all() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from glm5_fp4.engines.sglang import compat

    _check_targets(compat)

    # 1. argparse: --moe-runner-backend (and --speculative-moe-runner-backend) accept the name. Must run before
    #    ServerArgs builds its parser, which is why it lives in the plugin and not in a launcher.
    compat.add_moe_runner_backend_choice(NAME)

    # 2. the runner core; MoeRunner checks registered factories before its built-in backends (0.5.23), or the
    #    two stand-in hooks make it do so (0.5.15).
    from glm5_fp4.engines.sglang.runner import make_runner_core

    for target, fn in compat.register_runner_core(NAME, make_runner_core).items():
        HookRegistry.register(target, fn, HookType.AROUND)

    # 3. ModelOptNvFp4FusedMoEMethod hooks (documented in hooks.py); load_plugins() applies them afterwards.
    from glm5_fp4.engines.sglang.hooks import HOOKS, TARGET

    for method, fn in HOOKS.items():
        HookRegistry.register(f"{TARGET}.{method}", fn, HookType.AROUND)

    # 4. per-layer timers, only with GLM5_FP4_LAYER_TIMERS=1 (glm5_fp4/engines/layer_timers.py documents them).
    from glm5_fp4.engines.layer_timers import sglang_hooks

    for target, fn in sglang_hooks().items():
        HookRegistry.register(target, fn, HookType.AFTER)

    # 5. the host sampler, only with GLM5_FP4_HOST_SAMPLES=DIR (glm5_fp4/profiling/host_sampler.py).
    from glm5_fp4.profiling.host_sampler import start_from_env

    start_from_env()

    # 6. every GLM5_FP4_* value, read now: logged here; the MoE method's construction (hooks.around_init) raises.
    import logging

    from glm5_fp4 import envvars

    envvars.report(logging.getLogger("glm5_fp4"))
