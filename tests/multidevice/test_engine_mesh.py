"""The RolloutEngine on a tensor-parallel mesh computes what the single-device engine computes:
same greedy and sampled tokens, logprobs within 1e-5, prefix reuse, version rules, and a sync
that reshards copies of the trainer's params into the engine's layout."""
import jax
import numpy as np
import pytest

from jaxrl_cache.errors import VersionError
from jaxrl_cache.models import init_params
from jaxrl_cache.parallel import make_mesh
from jaxrl_cache.rl.audit import CALIBRATED_TOLERANCE, audit_attribution, tolerance_for
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from kernels_pallas import KERNELS_ENV
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
            # on XLA's dots a shard's columns are tiled unlike the whole weight: not the
            # trainer's bits, so the audit takes the calibrated tolerance (the
            # single-device engine's are exact; under the kernels the mesh's are, below)
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


@pytest.mark.parametrize("tensor", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mesh_engine_is_exact_under_the_invariant_kernels(monkeypatch, tensor):
    """Under JAXRL_CACHE_KERNELS the mesh engine computes the trainer's bits: its recorded
    log-probs equal the one-device engine's and the trainer's teacher-forced ones bit for
    bit (audit at tolerance 0), through admission rounds and a prefix served from the
    cache, with kv heads split (tensor 2) and copied (tensor 4, `make test-full`)."""
    from tests.multidevice.test_tensor_parallel import KERNEL_CONFIG as config
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x,
                          init_params(config, jax.random.key(0)))
    cache = CacheConfig(num_pages=40, page_size=4)
    sched = SchedulerConfig(max_num_seqs=4, chunk_steps=3)  # 6 samples queue for 4 slots
    sp = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, top_k=8)
    single = RolloutEngine(config, cache, scheduler_config=sched)
    want = single.rollout(params, 0, PROMPTS, sp, rng=jax.random.key(0))
    mesh = make_mesh({"tensor": tensor}, jax.devices()[8 - tensor:])
    sharded = RolloutEngine(config, cache, scheduler_config=sched, mesh=mesh)
    assert tolerance_for(sharded) == 0.0
    for call in range(2):  # the second call's prompts are served from the radix cache
        got = sharded.rollout(params, 0, PROMPTS, sp, rng=jax.random.key(0))
        assert (got.cached_tokens > 0) == (call == 1)
        for a, b in zip(got.samples, want.samples):
            assert a.output_ids == b.output_ids
            np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)
        report = audit_attribution(got, {0: params}, config)
        assert report.ok and report.exact and report.max_abs_diff == 0.0
