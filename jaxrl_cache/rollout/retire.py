"""After a decode chunk: stop strings cut rows, finished rows retire into the radix cache,
and a finished call's rows become Samples and a RolloutBatch."""
from __future__ import annotations

import time

import numpy as np

from jaxrl_cache.rollout import scheduler
from jaxrl_cache.rollout.types import RolloutBatch, Sample, WeightAck


def finish_rows(run: scheduler.Run, slots: list, done: list[int], version: int) -> None:
    """Retires the rows of `slots` (the chunk's slots of the run) listed in `done`, after
    stop strings (text) cut them or finished more."""
    if run.text is not None:  # text: stop strings cut rows before they retire
        done = run.text.stop_rows(slots, done)
    for i in done:
        retire(run, i, version)


def retire(run: scheduler.Run, slot: int, version: int) -> None:
    """At the step's `version`: caches the row's full pages under the version that wrote
    all of their KV (none if several did: kv_policy "keep", or if that version left the lag
    window of `version`), then drops its
    references. An episode's turn then goes to its environment (episodes.Driver)."""
    row = run.slots[slot]
    single = len(row.kv_now) == 1  # not mixed ("keep" after an update)
    writer = next(iter(row.kv_now)) if single else None
    run.slots[slot] = None
    run.finished[row.index] = row
    if run.share and single and writer >= version - run.max_policy_lag:
        written = run.packed[row.group].extend(scheduler.written_outputs(row))
        run.cache.insert(run.key_of(writer), written,
                         row.pages[:written.num_tokens // run.ps], release=row.pages)
    else:
        run.cache.release(row.pages)
    if run.episodes is not None:
        run.episodes.turn_done(row, tuple(row.tokens) if run.text is None
                               else run.text.sample_text(row))


def samples(run: scheduler.Run) -> list[Sample]:
    """Every sample of the call, in prompt order (sample j of prompt g at g * n + j)."""
    out = []
    for r in (run.finished[i] for i in sorted(run.finished)):
        versions = np.asarray(r.token_versions, np.int64)
        out.append(Sample(
            prompt_ids=r.prompt, output_ids=tuple(r.tokens),
            output_logprobs=np.asarray(r.logprobs, np.float32),
            behavior_version=int(versions[0]), token_versions=versions,
            cached_tokens=r.cached_tokens, finish_reason=r.finish_reason, group=r.group,
            kv_versions=tuple(sorted(r.kv_versions)),
            mixed_tokens=np.asarray(r.mixed, bool) if any(r.mixed) else None,
            text=None if run.text is None else run.text.sample_text(r)))  # text
    return out


def batch(run: scheduler.Run, start: float, ack: WeightAck | None) -> RolloutBatch:
    """The finished call's batch; start: its perf_counter start; ack: the sync it committed."""
    out = samples(run)
    prompt_tokens = sum(len(s.prompt_ids) for s in out)
    fresh = run.computed - run.recomputed  # prompt tokens computed (not re-prefills)
    return RolloutBatch(
        samples=out, version=run.start_version, sampling=run.sampling,
        prefill_tokens=fresh, reused_tokens=prompt_tokens - fresh,
        cached_tokens=sum(s.cached_tokens for s in out), decode_steps=run.steps,
        decode_chunks=run.chunks, prefill_launches=run.prefills,
        seconds=time.perf_counter() - start, sync_ack=ack,
        recomputed_tokens=run.recomputed, weight_updates=run.updates)
