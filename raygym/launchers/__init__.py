"""Launchers: thin ways to run ``python -m raygym.train`` somewhere else.

- :mod:`raygym.launchers.ray_job` — submit to any running Ray cluster (``raygym submit``, ``ray job submit``,
  KubeRay, Anyscale).
- :mod:`raygym.launchers.modal_app` — ``modal run -m raygym.launchers.modal_app --preset qwen3-4b [flags]``:
  clustered Modal GPU containers become one Ray cluster, then the same job is submitted to it.
- :mod:`raygym.launchers.modal_config` — :class:`~raygym.launchers.modal_config.ModalConfig`, the Modal-only
  settings.
- :mod:`raygym.launchers.bootstrap` — pure cluster-bootstrap decisions (commands, retries, addresses, watchdog).
- :mod:`raygym.launchers.source` — where the shipped raygym comes from (a checkout or an installed package).

Only ``modal_app`` imports ``modal``, and nothing else in raygym imports ``modal_app``; importing this package
imports neither ``modal`` nor ``ray``.
"""
