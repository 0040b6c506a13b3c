"""The decoder's partition rules (`models.llama` leaf names) and its KV-head split.

A rule set is data (`parallel.mesh` applies it): ((leaf name, spec of its trailing dims),
...), each spec naming the mesh axis of a trailing dim (None = replicated); leading dims (the
[L] axis of stacked layers) are replicated. A family registers its rules with its forward
(`models.families`); every family registered today has this decoder's leaves.
"""
from __future__ import annotations

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.spmd import BATCH_AXES, TENSOR_AXIS

Rules = tuple[tuple[str, tuple], ...]  # ((leaf name, spec of its trailing dims), ...)
FSDP, TENSOR = BATCH_AXES[1], TENSOR_AXIS

# FSDP: every matrix sharded along d_model; vectors replicated. Training batches are split
# over data x fsdp; params are gathered per layer in the forward, gradients reduce-scattered.
TRAIN_RULES: Rules = (
    ("embed", (FSDP, None)),  # [V, d]
    ("lm_head", (FSDP, None)),  # [d, V]
    ("wq", (FSDP, None)), ("wk", (FSDP, None)), ("wv", (FSDP, None)),  # [d, H*D]
    ("wo", (None, FSDP)),  # [Hq*D, d]
    ("w_gate", (FSDP, None)), ("w_up", (FSDP, None)),  # [d, F]
    ("w_down", (None, FSDP)),  # [F, d]
    ("bq", (None,)), ("bk", (None,)), ("bv", (None,)), ("bo", (None,)),
    ("attn_norm", (None,)), ("mlp_norm", (None,)), ("final_norm", (None,)),
    ("q_norm", (None,)), ("k_norm", (None,)),
    ("a", (None, None)), ("b", (None, None)),  # LoRA adapters [L, in, r], [L, r, out]: small
)


def kv_layout(config: ModelConfig, tensor: int) -> tuple[int, int]:
    """(kv heads per shard, copies of each kv head) for a tensor axis of size `tensor`.

    tensor <= Hkv: each shard holds Hkv / tensor kv heads, no copies. tensor > Hkv: each
    shard holds one kv head, each kv head lives on tensor / Hkv shards (the shards whose
    query heads read it), so the pool has `tensor` head slots, slot j a copy of head
    j // (tensor / Hkv).
    """
    hq, hkv = config.n_heads, config.n_kv_heads
    if tensor < 1 or hq % tensor or config.d_ff % tensor or config.d_model % tensor:
        raise ValueError(f"tensor axis {tensor} must divide n_heads={hq}, d_ff={config.d_ff} "
                         f"and d_model={config.d_model}")
    if tensor <= hkv:
        if hkv % tensor:
            raise ValueError(f"tensor axis {tensor} must divide n_kv_heads={hkv}")
        return hkv // tensor, 1
    if tensor % hkv:
        raise ValueError(f"tensor axis {tensor} > n_kv_heads={hkv} must be a multiple of it")
    return 1, tensor // hkv


def rollout_rules(config: ModelConfig, tensor: int) -> Rules:
    """Tensor parallelism for the paged forwards (see `kv_layout`).

    Every matrix is split by its output columns (see tensor_parallel: no partial sums):
    wq/wk/wv (+ biases), w_gate/w_up over heads / FFN; wo and w_down over d_model (their
    input and output all-gathered around the product). When kv heads are copied
    (tensor > Hkv), wk/wv/bk/bv are replicated and each shard slices its own head. embed and
    lm_head are replicated: every shard then holds full-vocab logits for sampling, and no
    logits are gathered per decode step. "kv_pages" is the pool [..., P, Hkv, page_size, D].
    """
    _, copies = kv_layout(config, tensor)
    kv = TENSOR if copies == 1 else None
    return (
        ("embed", (None, None)), ("lm_head", (None, None)),
        ("wq", (None, TENSOR)), ("bq", (TENSOR,)),
        ("wk", (None, kv)), ("wv", (None, kv)), ("bk", (kv,)), ("bv", (kv,)),
        ("wo", (None, TENSOR)), ("bo", (None,)),  # bo added to the gathered output
        ("w_gate", (None, TENSOR)), ("w_up", (None, TENSOR)), ("w_down", (None, TENSOR)),
        ("attn_norm", (None,)), ("mlp_norm", (None,)), ("final_norm", (None,)),
        ("q_norm", (None,)), ("k_norm", (None,)),  # per head, [D]
        ("kv_pages", (None, TENSOR, None, None)),
    )
