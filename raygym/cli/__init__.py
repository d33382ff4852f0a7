"""The ``raygym`` command (:func:`raygym.cli.main.main.main`): ``train``, ``plan``, ``export``, ``bench``, ``serve``,
``eval``, ``report`` and ``data``.
"""
