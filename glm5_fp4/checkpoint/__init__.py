"""Tiny GLM-5-family checkpoints in the ModelOpt NVFP4 layout of nvidia/GLM-5-NVFP4, and their validation."""
