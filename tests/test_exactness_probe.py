"""benchmarks.exactness_probe: it finds no difference where the numerics are exact, and
names the block and the kernel where they are not (an attention whose p @ v changes a
row's bits with the row count)."""
import jax
import numpy as np
import pytest

from benchmarks.exactness_probe import probe, summary
from jaxrl_cache.models import ModelConfig, init_params


def _model(head_dim: int, n_heads: int):
    config = ModelConfig.tiny(vocab_size=128, d_model=64, n_layers=2, n_heads=n_heads,
                              n_kv_heads=2, head_dim=head_dim, d_ff=128, max_seq_len=256,
                              dtype="float32")
    return config, init_params(config, jax.random.key(0))


TOKENS = np.random.default_rng(0).integers(1, 128, 53).tolist()


def test_exact_numerics_show_no_difference_at_any_level():
    config, params = _model(64, 2)
    result = probe(params, config, TOKENS, backend="xla")
    assert result["first_depth"] is None
    for row in result["depths"]:
        assert row["prefill_logits"]["differ"] == row["decode_logits"]["differ"] == 0
        assert row["prefill_logits"]["of"] == row["decode_logits"]["of"] == 128
    assert all(c["differ"] == 0 and c["of"] > 0 for c in result["layer0_kv"].values())
    assert result["attention"]["differ"] == 0 and result["logprob"]["differ"] == 0
    assert all(not o["rows_with_other_bits"] for o in result["ops"])
    assert summary(result) == "logits equal at every depth; log-prob equal"


@pytest.fixture
def batch_variant_values(monkeypatch):
    """p @ v made to give a row other bits at few query rows (a decode's) than among many (a
    prefill's), as XLA:CPU's own dot does at some head sizes on some CPUs (which ones is the
    CPU's business: tests/test_numerics.py measures it), here on every CPU; jit caches are
    cleared on both sides, so no program traced one way serves the other."""
    from kernels_pallas import blocked
    real = blocked._values_dot

    def variant(p, v):
        out = real(p, v)
        return out * np.float32(1 + 2**-20) if p.shape[-2] < 8 else out

    jax.clear_caches()
    monkeypatch.setattr(blocked, "_values_dot", variant)
    yield
    monkeypatch.undo()
    jax.clear_caches()


def test_a_batch_variant_attention_is_located_in_the_first_block_not_the_projections(
        batch_variant_values):
    config, params = _model(32, 4)
    result = probe(params, config, TOKENS, backend="xla")
    assert result["depths"][0]["decode_logits"]["differ"] == 0  # norm / LM head: exact
    assert result["first_depth"] == 1
    assert result["depths"][1]["decode_logits"]["differ"] > 0
    assert all(c["differ"] == 0 for c in result["layer0_kv"].values())  # K/V: exact
    assert result["attention"]["differ"] > 0  # decode kernel vs the prefill's last row
    assert "first differ at depth 1" in summary(result)


def test_rejects_a_sequence_too_short_to_prefill_and_decode():
    config, params = _model(64, 2)
    with pytest.raises(ValueError, match="at least 3 ids"):
        probe(params, config, [1, 2], backend="xla")
