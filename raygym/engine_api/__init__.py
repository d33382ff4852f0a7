"""The engine API: the protocol every rollout engine speaks (one model per route), the one client, the
per-run API key, and what each engine kind can do.

Below everything that talks to an engine (``raygym.engines``, ``raygym.rollout``, ``raygym.weightsync``,
``raygym.serve``); it imports nothing of raygym but :mod:`raygym.errors`.
"""
