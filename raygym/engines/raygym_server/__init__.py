"""raygym's own SGLang-compatible inference server (``python -m raygym.engines.raygym_server.server``): a child
process of an :class:`~raygym.engines.actor.EngineActor`, serving a Hugging Face model with pure torch.
"""
