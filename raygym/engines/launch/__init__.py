"""Command lines for the inference servers an :class:`~raygym.engines.actor.EngineActor` owns (pure: no I/O,
no torch).
"""
