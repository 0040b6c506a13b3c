"""The RolloutEngine on a tensor-parallel mesh computes what the single-device engine computes:
same greedy and sampled tokens, logprobs within 1e-5, prefix reuse, version rules, and a sync
that reshards copies of the trainer's params into the engine's layout."""
import jax
import numpy as np
import pytest

from jaxrl_cache.errors import VersionError
from jaxrl_cache.parallel import make_mesh
from jaxrl_cache.rl.audit import CALIBRATED_TOLERANCE, audit_attribution, tolerance_for
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from tests.multidevice import common

CONFIG = common.CONFIG
PROMPTS = [list(range(1, 12)), list(range(3, 9)), [5, 6, 7, 8, 9, 10, 11, 12]]


def engines(tensor):
    cache = CacheConfig(num_pages=40, page_size=4)
    sched = SchedulerConfig(max_num_seqs=4, chunk_steps=3)  # 6 samples queue for 4 slots
    mesh = make_mesh({"tensor": tensor}, jax.devices()[8 - tensor:])  # disjoint from device 0
    return (RolloutEngine(CONFIG, cache, scheduler_config=sched, backend="xla"),
            RolloutEngine(CONFIG, cache, scheduler_config=sched, backend="xla", mesh=mesh))


@pytest.mark.parametrize("tensor", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mesh_engine_equals_single_device(tensor):
    single, sharded = engines(tensor)
    p0, p1 = common.params(0), common.params(1)
    for i, sp in enumerate((SamplingParams(n=2, max_new_tokens=5, temperature=0.0),
                            SamplingParams(n=2, max_new_tokens=5, temperature=1.0, top_k=8))):
        for version, params in ((3 * i, p0), (3 * i + 1, p1)):
            want = single.rollout(params, version, PROMPTS, sp, rng=jax.random.key(version))
            got = sharded.rollout(params, version, PROMPTS, sp, rng=jax.random.key(version))
            assert [s.output_ids for s in got.samples] == [s.output_ids for s in want.samples]
            for a, b in zip(got.samples, want.samples):
                np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
            # the shards add partial sums in another order: not the trainer's bits, so the
            # audit takes the calibrated tolerance (the single-device engine's are exact)
            assert tolerance_for(single) == 0.0
            assert tolerance_for(sharded) == CALIBRATED_TOLERANCE
            report = audit_attribution(got, {version: params}, CONFIG,
                                       tolerance=tolerance_for(sharded))
            assert report.ok and not report.exact
            assert report.max_abs_diff < CALIBRATED_TOLERANCE / 10, report.max_abs_diff
            assert audit_attribution(want, {version: params}, CONFIG).ok
            assert got.cached_tokens == want.cached_tokens
        single.sync_weights(p0, 3 * i + 2)
        ack = sharded.sync_weights(p0, 3 * i + 2)
        assert ack.cached_versions == () and sharded.cache.versions() == []
    leaf = jax.tree.leaves(sharded._weights.params)[0]
    assert {d.id for d in leaf.sharding.device_set} == {d.id for d in sharded.mesh.devices.flat}
    with pytest.raises(VersionError):
        sharded.rollout(p0, 1, PROMPTS, sp, rng=jax.random.key(0))
    sharded.cache.check_invariants()
