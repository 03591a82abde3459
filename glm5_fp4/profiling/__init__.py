"""Where a decode step goes and how far each part is from the hardware.

`taxonomy` (kernel name -> category, from glm5_fp4/data/taxonomy.yaml), `traces` (Kineto files, one per
rank), `steps` (decode steps from GPU timestamps), `intervals` (summed / exposed time), `collectives`
(all-reduce wait vs work across ranks), `breakdown` (the analysis), `ceilings` (FLOPs / bytes vs peaks),
`report` (markdown, JSON, PNG), `capture` (drive a server's profiler), `layer_timers` (GPU timers that work
inside CUDA graphs), `cli` (`glm5-fp4 profile`). Nothing heavy is imported here.
"""
