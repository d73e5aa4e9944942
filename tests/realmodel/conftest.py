"""The real-model tier: one bf16 SmolLM2-135M-Instruct checkpoint, built once per machine (faircast_plugins.real_model)
and shared by every test, process and virtualenv of the tier."""
import pytest

from faircast_plugins.real_model import smollm2_checkpoint


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_checkpoint()
