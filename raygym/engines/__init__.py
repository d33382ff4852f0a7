"""Rollout engines: the actor that owns one inference server (:mod:`raygym.engines.actor`), the run's fleet
of them (lifecycle and the weight-sync owner), spawning, health and routing.

Subpackages by the process they run in: ``launch`` (argv builders, pure), ``serving`` (HTTP parts shared by
raygym's server and the vLLM side), ``raygym_server`` (raygym's own SGLang-compatible server, a child
process) and ``vllm`` (what runs inside vLLM's interpreter).
"""
