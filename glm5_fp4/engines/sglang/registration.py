"""What the SGLang entry point registers: the CLI name, the runner core, the three method hooks (and the
per-layer timer hooks when ``GLM5_FP4_LAYER_TIMERS=1``)."""

from __future__ import annotations

from glm5_fp4.engines.sglang import NAME


def register_all() -> None:
    # 1. argparse: --moe-runner-backend (and --speculative-moe-runner-backend) accept the name. Must run before
    #    ServerArgs builds its parser, which is why it lives in the plugin and not in a launcher.
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices

    if NAME not in MOE_RUNNER_BACKEND_CHOICES:
        add_moe_runner_backend_choices([NAME])

    # 2. the runner core; MoeRunner checks registered factories before its built-in backends.
    from sglang.srt.layers.moe.moe_runner import register_moe_runner_core
    from sglang.srt.layers.moe.moe_runner.runner import _CUSTOM_RUNNER_CORE_FACTORIES

    from glm5_fp4.engines.sglang.runner import make_runner_core

    if NAME not in _CUSTOM_RUNNER_CORE_FACTORIES:
        register_moe_runner_core(NAME, make_runner_core)

    # 3. ModelOptNvFp4FusedMoEMethod hooks (documented in hooks.py); load_plugins() applies them afterwards.
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from glm5_fp4.engines.sglang.hooks import HOOKS, TARGET

    for method, fn in HOOKS.items():
        HookRegistry.register(f"{TARGET}.{method}", fn, HookType.AROUND)

    # 4. per-layer timers, only with GLM5_FP4_LAYER_TIMERS=1 (glm5_fp4/engines/layer_timers.py documents them).
    from glm5_fp4.engines.layer_timers import sglang_hooks

    for target, fn in sglang_hooks().items():
        HookRegistry.register(target, fn, HookType.AFTER)
