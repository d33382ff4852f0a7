"""Offline checks of the Modal serving app (no credentials, no network)."""

from __future__ import annotations

import json

import pytest

modal = pytest.importorskip("modal", reason="modal is not installed (pip install modal); it is not a dev dependency")

from raygym.errors import ConfigError  # noqa: E402
from raygym.launchers.modal_app import SERVE_ARGS_ENV, SERVE_PORT, build_serve_app, plan_serve, serve_web  # noqa: E402
from raygym.launchers.modal_config import ModalConfig  # noqa: E402


def test_serving_function_spec():
    served = build_serve_app(["/checkpoints/r1", "--max-replicas", "2", "--gpus-per-replica", "2",
                              "--modal-gpu-type", "L4"])
    info = served.serve_fn.info()
    assert info.gpus == [("L4", 4)]  # 2 GPUs x 2 replicas in one container (one Ray node)
    assert any("raygym-serve-secret" in s for s in info.secrets)
    assert served.launch.serve_args == ["/checkpoints/r1", "--max-replicas", "2", "--gpus-per-replica", "2"]
    assert served.launch.app_name == "raygym-serve" and serve_web.__qualname__ == "serve_web"
    assert SERVE_PORT == 8000 and SERVE_ARGS_ENV == "RAYGYM_MODAL_SERVE_ARGS"


def test_plan_defaults_and_refusals():
    launch = plan_serve(["/checkpoints/r1"], ModalConfig(name="my-endpoint", serve_secret="k"))
    assert launch.serve_args == ["/checkpoints/r1", "--gpus-per-replica", "1"] and launch.gpus == 1
    assert launch.app_name == "my-endpoint"
    json.dumps(launch.serve_args)
    for flag in (["--port", "9000"], ["--api-key-file", "/k"], ["--host=0.0.0.0"], ["--detach"]):
        with pytest.raises(ConfigError, match=flag[0].split("=")[0]):
            plan_serve(["/checkpoints/r1", *flag])
    with pytest.raises(ConfigError, match="checkpoint first"):
        plan_serve(["--replicas", "2"])
