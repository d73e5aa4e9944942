"""One metrics reduction for every adapter: audit.reduce_metrics."""
import pytest
import torch
import torch.distributed as dist

from faircast_plugins import FairCastConfig, FairCaster
from faircast_plugins.audit import reduce_metrics


def _run(caster, steps=4):
    x = torch.linspace(-1, 1, 4000)
    for _ in range(steps):
        caster.cast("w", x)
        x = x + 1e-4
        caster.advance()


ALL_KEYS = {"faircast/version", "faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/bias",
            "faircast/bias_rel", "faircast/lag_steps", "faircast/bias_rel_cumulative"}


def test_without_a_process_group_it_is_the_casters_metrics():
    a, b = (FairCaster(FairCastConfig(enabled=True, audit=True, seed=3)) for _ in range(2))
    _run(a)
    _run(b)
    assert reduce_metrics(a) == b.metrics()
    assert set(reduce_metrics(b)) == {"faircast/version", "faircast/bias_rel_cumulative"}  # nothing new since


def test_without_audit_only_the_version():
    caster = FairCaster(FairCastConfig(enabled=True))
    _run(caster, 2)
    assert reduce_metrics(caster) == {"faircast/version": 2.0}


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_reduced_totals_give_the_same_metrics_set(gloo_world, monkeypatch):
    """Every rank's sums are added before the ratios: two ranks with the same shards report one rank's ratios, and
    the cumulative bias is over the summed totals too."""
    calls = []
    real = dist.all_reduce

    def two_ranks(t, *args, **kwargs):  # this rank's totals plus an identical rank's
        calls.append(t.dtype)
        real(t, *args, **kwargs)
        t.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", two_ranks)
    a, b = (FairCaster(FairCastConfig(enabled=True, audit=True, seed=3)) for _ in range(2))
    _run(a)
    _run(b)
    reduced, local = reduce_metrics(a), b.metrics()
    assert calls == [torch.float64]
    assert set(reduced) == set(local) == ALL_KEYS
    for k in ALL_KEYS:
        assert reduced[k] == pytest.approx(local[k], rel=1e-12)
