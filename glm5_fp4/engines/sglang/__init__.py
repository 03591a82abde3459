"""glm5-fp4 inside SGLang 0.5.23 (and 0.5.15, the H200 test vehicle): the ``glm5_fp4`` MoE runner backend.

* ``registration`` -- what the entry point (``glm5_fp4.engines.sglang_plugin:register``) registers;
* ``runner``       -- the runner core SGLang's ``MoeRunner`` builds for ``--moe-runner-backend glm5_fp4``;
* ``hooks``        -- the three ``ModelOptNvFp4FusedMoEMethod`` hooks, each documented (What/Why/How/Upstream/
                      Remove when);
* ``compat``       -- every difference between the SGLang versions the plugin runs on (importable without
                      SGLang: the launch profiles use its flag spellings).

The modules other than ``compat`` import SGLang; none is imported unless SGLang loads the plugin.
"""

NAME = "glm5_fp4"
