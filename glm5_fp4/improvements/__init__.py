"""Improvement write-ups: numbered markdown files under improvements/ with a generated index."""
