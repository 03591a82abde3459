"""Benchmark building blocks shared by ``benchmarks/*.py`` and ``glm5-fp4 selftest`` (part of the installed
package, so a pip-installed self-test measures exactly what the project's benchmarks publish)."""
