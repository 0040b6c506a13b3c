"""Host-side cache bookkeeping: GRPO-shaped match+insert trace and the invalidation ack path."""
import numpy as np

from jaxrl_cache.cache.radix import RadixCache

PAGE = 16


def grpo_trace(num_prompts=64, group=8, prompt_len=512, system_len=256, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, system_len).tolist()
    return [system + rng.integers(0, 32000, prompt_len - system_len).tolist()
            for _ in range(num_prompts)], group


def run_trace(prompts, group):
    cache = RadixCache(4096, PAGE)
    for prompt in prompts:
        for _ in range(group):
            m = cache.match(0, prompt)
            own = cache.alloc(len(prompt) // PAGE - m.pages.size)
            held = np.concatenate([m.pages, own])
            cache.insert(0, prompt, held)
            cache.release(held)
    return cache.stats()


def test_grpo_match_insert(benchmark):
    prompts, group = grpo_trace()
    stats = benchmark(run_trace, prompts, group)
    ops = 2 * len(prompts) * group  # one match + one insert per sample
    benchmark.extra_info["ops_per_s"] = ops / benchmark.stats.stats.mean
    benchmark.extra_info["hit_rate"] = stats.hit_rate
    # first sample of each prompt hits the system prefix only, the other 7 the whole prompt
    assert stats.hit_rate > 0.85


def test_invalidate_2048_pages(benchmark):
    def setup():
        cache = RadixCache(4096, PAGE)
        rng = np.random.default_rng(1)
        for _ in range(128):  # 128 distinct 256-token prompts = 2048 pages
            prompt = rng.integers(0, 32000, 256).tolist()
            pages = cache.alloc(16)
            cache.insert(0, prompt, pages)
            cache.release(pages)
        return (cache,), {}

    dropped = benchmark.pedantic(lambda cache: cache.invalidate_before(1), setup=setup,
                                 rounds=30)
    assert dropped == 2048
    benchmark.extra_info["ms"] = benchmark.stats.stats.mean * 1e3
