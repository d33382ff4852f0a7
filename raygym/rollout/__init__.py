"""Rollout management: prompts become routed ``/generate`` requests, answers become scored samples, and the kept
groups become a training batch (:class:`raygym.rollout.manager.RolloutManager`); fully asynchronous generation
(the stream and its staleness bookkeeping), dynamic-sampling filters and the tasks environments, judges and
distillation add.

The engines themselves (their actor, fleet, health and routing) live in :mod:`raygym.engines`.
"""
