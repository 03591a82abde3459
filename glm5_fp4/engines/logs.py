"""Inside a server, the package's own log records (``glm5_fp4`` and below: kernels, warm-up, telemetry, layer
timers) go through the engine's logger, so they appear in the server log with the engine's format and level.

Why: vLLM configures handlers on its ``vllm`` logger only; records of ``glm5_fp4`` reached Python's last-resort
handler, which drops INFO (on the H200 the warm-up's "compiled the MoE kernels ..." line was missing from every
vLLM log). SGLang configures the root logger, which already prints them: its plugin does not route.
"""

from __future__ import annotations

import logging

PACKAGE = "glm5_fp4"


class _ToEngine(logging.Handler):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        # The handlers from the target up to (not including) the root: the record reaches the root's own handlers
        # by propagating from ``glm5_fp4`` already, and must not be printed (or captured) twice.
        logger, root = logging.getLogger(self.target), logging.getLogger()
        while logger is not None and logger is not root:
            for handler in logger.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)
            if not logger.propagate:
                break
            logger = logger.parent


def route_to(engine_logger: str) -> None:
    """Send ``glm5_fp4`` records (INFO and up) to ``engine_logger``; idempotent (one route per process)."""
    pkg = logging.getLogger(PACKAGE)
    if any(isinstance(h, _ToEngine) for h in pkg.handlers):
        return
    pkg.addHandler(_ToEngine(engine_logger))
    if pkg.level == logging.NOTSET or pkg.level > logging.INFO:
        pkg.setLevel(logging.INFO)  # else the root's WARNING drops INFO before any handler sees it
    # Still propagates: a root without handlers (vLLM's) prints nothing more, and the last-resort handler is
    # not used once a handler was found.
