"""The HTTP parts raygym's server and its vLLM adapter share: request parsing and checks, ``/generate``, and
the engine side of weight sync.
"""
