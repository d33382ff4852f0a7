"""The weight-update rendezvous against SGLang's own ``init_custom_process_group`` (run by the SGLang
interpreter), in both directions."""

from __future__ import annotations

import pytest

from tests.weightsync.test_rendezvous import raygym_receives_from, raygym_sends_to

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.timeout(1200)]


def test_raygyms_sender_meets_sglangs_own_rendezvous(sglang_python):
    raygym_sends_to(sglang_python, "sglang")


def test_sglangs_own_rendezvous_as_sender_meets_raygyms_receiver(sglang_python):
    raygym_receives_from(sglang_python, "sglang")
