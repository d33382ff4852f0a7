"""``raygym serve``: an OpenAI-compatible endpoint (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) in front of a trained checkpoint, scaled with Ray Serve.

- :mod:`raygym.serve.protocol`: the OpenAI request and response shapes (pydantic);
- :mod:`raygym.serve.front`: requests -> engine ``/generate`` payloads -> answers (no Ray, no HTTP);
- :mod:`raygym.serve.http`: the FastAPI app, API-key check and OpenAI-shaped errors;
- :mod:`raygym.serve.deployment`: the Ray Serve deployment (replicas, autoscaling, placement) and
  :func:`~raygym.serve.deployment.run_server`.

Importing this package loads neither torch nor ray.
"""
