"""glm5-fp4: serve GLM-5 in NVFP4 on vLLM and SGLang, and explain where decode time goes.

Importing the package is cheap on purpose: engines load plugins in every process, so
nothing here touches CUDA or imports an engine at import time.
"""

__version__ = "0.1.0"
