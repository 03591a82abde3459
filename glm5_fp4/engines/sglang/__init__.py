"""glm5-fp4 inside SGLang 0.5.23: the ``glm5_fp4`` MoE runner backend.

* ``registration`` -- what the entry point (``glm5_fp4.engines.sglang_plugin:register``) registers;
* ``runner``       -- the runner core SGLang's ``MoeRunner`` builds for ``--moe-runner-backend glm5_fp4``;
* ``hooks``        -- the three ``ModelOptNvFp4FusedMoEMethod`` hooks, each documented (What/Why/How/Upstream/
                      Remove when).

Every module here imports SGLang; none is imported unless SGLang loads the plugin.
"""

NAME = "glm5_fp4"
