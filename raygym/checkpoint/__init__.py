"""Checkpoints through fsspec: whole-model and sharded saves, atomic manifests, resume, HF export, and what
``raygym serve`` / ``raygym eval`` are pointed at.
"""
