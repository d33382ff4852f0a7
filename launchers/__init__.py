"""Launchers: thin ways to run ``python -m raygym.train`` somewhere else.

- :mod:`launchers.ray_job` — submit to any running Ray cluster (``ray job submit`` / KubeRay / Anyscale).
- :mod:`launchers.modal_app` — ``modal run launchers/modal_app.py --preset qwen3-4b [flags]``: clustered
  Modal GPU containers become one Ray cluster, then the same job is submitted to it.
- :mod:`launchers.modal_config` — :class:`~launchers.modal_config.ModalConfig`, the Modal-only settings.
- :mod:`launchers.bootstrap` — pure cluster-bootstrap decisions (commands, retries, addresses, watchdog).

Nothing under ``raygym/`` imports this package, and importing it imports neither ``modal`` nor ``ray``.
"""
