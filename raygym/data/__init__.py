"""Prompt datasets: loading (jsonl/parquet through fsspec), checks before a run starts, and
``raygym data prepare``.
"""
