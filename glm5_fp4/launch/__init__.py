"""Launch profiles: one YAML file describes a GLM-5 deployment; this package turns it into engine commands
(`commands`), runs them (`runner`), and predicts memory and decode step time for it (`plan`).

Nothing here imports an engine; the engines' own parsers check the generated command lines in the tests.
"""

from glm5_fp4.launch.profile import LaunchProfile, load_profile

__all__ = ["LaunchProfile", "load_profile"]
