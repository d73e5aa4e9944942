"""The torchrun launches of tests/megatron/worker.py that test_megatron.py and test_policy.py share (session-scoped:
one launch per world size for both files; test_verl_engine.py's own ``ws1`` / ``ws2`` override these there)."""
import pytest


@pytest.fixture(scope="session")
def ws1(tmp_path_factory):
    from tests.megatron.test_megatron import WS1, launch

    return launch(1, WS1, tmp_path_factory)


@pytest.fixture(scope="session")
def ws2(tmp_path_factory):
    from tests.megatron.test_megatron import WS2, launch

    return launch(2, WS2, tmp_path_factory)


@pytest.fixture(scope="session")
def ws4(tmp_path_factory):
    from tests.megatron.test_megatron import WS4, launch

    return launch(4, WS4, tmp_path_factory)
