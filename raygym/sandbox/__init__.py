"""Sandboxed execution of generated code (namespaces + resource limits + a pool of Ray actors) and the
code-execution reward built on it."""

from raygym.sandbox.harness import TestReport, run_tests
from raygym.sandbox.isolation import Limits, SandboxUnavailable, detect_backend
from raygym.sandbox.runner import RunResult, Sandbox

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable", "TestReport", "detect_backend", "run_tests"]
