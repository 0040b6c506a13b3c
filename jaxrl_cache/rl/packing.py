"""Samples packed into micro-batches under a token budget.

Sequences are packed first-fit-decreasing into rows of R tokens (several per row, each
starting on a multiple of TILE: segment ids keep attention inside a sequence,
positions restart at 0), rows are grouped into M
micro-batches of B rows (B x R <= token budget) for each of U mini-batches, all of one
shape [U, M, B, R], so one compiled step serves every micro-batch. Samples of a mini-batch
that share a prompt (a GRPO group) share its whole TILEs (`shared_prefix`): a row holds
that prefix once, then each sample's rest from a tile edge, attending to the prefix through
`parents` (a sample's keys stay in the blocks, and the order, the sampler reduced them in, so
its log-probs keep their bits; the prefix's forward and backward run once, not once per
sample). A group too long for a row is split into units of the prefix + some samples.
Columns repeat tokens (a sample's prompt tokens after the shared prefix, which its unit's
other samples also hold) and pad (to TILE edges, to the planned lengths): `columns` lists
each row's distinct tokens, `sources` maps every column to one, and the model runs its
projections and MLPs on those alone (`models.llama.hidden_states`).
R is a multiple (1-4x, at most MAX_ROW unless one sequence needs more) of the longest
sequence rounded up to TILE, or a group's prefix + its longest samples, whichever
computes fewest distinct token rows (`_cost`) (attention runs on the keys a tile sees, `kv_blocks`, not on
the row); B is as small as the rows need (`rows_bucket`); mini-batches are balanced by tokens
(`balanced_parts`). So computed / real tokens stays near 1
(`PackedBatch.computed_tokens`). A shape compiled before (`known`) is taken instead when it
holds the batch at most SHAPE_REUSE x the tightest cost: one compile of the train step costs
as much as many steps of padding. With `reserve` (the train step passes prompt +
max_new_tokens) the shape is planned for the lengths samples could have taken, so it
follows the prompts and sampling settings, not the lengths the policy sampled; the samples
are then laid out densely in it at the lengths they took (`_dense_rows`), so a batch of
short samples fills the first micro-batches and leaves the rest padding, which the train
step skips.
"""
from __future__ import annotations


import flax.struct
import jax
import numpy as np

from kernels_pallas.blocked import KEY_BLOCK, TILE

ROW_ALIGN = 32  # the scored width K is a multiple of it (few LM-head shapes)
DISTINCT_ALIGN = TILE  # the distinct-token width N is a multiple of it: the projections
# and MLPs run on N rows, so 32 cost up to 31 rows of padding (2 x 8 x 24 chat prompts: 235
# distinct tokens a row ran as 256, now 240, update ~4% faster); a larger need later still
# reuses a compiled N that holds it (`_compiled_widths`)
MAX_ROW = 2048  # longest row tried when packing short sequences (attention is [B, R, R])
SHAPE_REUSE = 1.5  # a known shape wins while it computes at most this x the tightest shape
PAIR_ALIGN = 16  # a row's (tile, key block) pairs are padded to a multiple of it


@flax.struct.dataclass
class PackedBatch:
    """Per-position arrays, all [U, M, B, R] (U mini-batches x M micro-batches x B rows x R).

    targets[..., t] is the token position t predicts (same segment); weights[..., t] > 0
    exactly where it is a trained output token (sampled; not of a masked truncated sample),
    and is that token's share of its mini-batch's loss (the loss aggregation, summing to its
    normaliser); behavior, versions and advantages are the recorded log-prob, version and
    advantage of that target; audited is 1 where the recorded log-prob is checkable (a
    sampled token that attended no KV of another version). scored lists the positions whose
    log-prob the step needs (weight > 0 or audited), so the LM head runs on those only
    (`scored_columns`); kv_blocks lists the TILEs of keys each tile of TILE positions sees,
    in its sequence's order, and items the key blocks those fill, so attention skips the
    rest of the row and every block no query sees.
    """
    tokens: jax.Array  # int32
    positions: jax.Array  # int32, restarting per sequence (continuing after a shared prefix)
    segments: jax.Array  # int32, 0 = padding, k = k-th sequence (or shared prefix) of the row
    parents: jax.Array  # int32, the segment of the shared prefix a token also sees, 0 = none
    targets: jax.Array  # int32
    weights: jax.Array  # f32
    behavior: jax.Array  # f32
    versions: jax.Array  # int32
    advantages: jax.Array  # f32
    audited: jax.Array  # int32, 1 = sampled and not mixed
    scored: jax.Array  # int32 [U, M, B, K]: each row's columns with weight > 0, then R (pad)
    kv_blocks: jax.Array  # int32 [U, M, B, R / TILE, KM]: the TILEs of keys each tile of
    # TILE columns attends to (its prefix's, then its own up to itself), -1 = none; KM is a
    # multiple of KEY_BLOCK / TILE (entry j = the sequence's j-th TILE: runs are key blocks)
    items: jax.Array  # int32 [U, M, B, W]: the row's (tile, key block) pairs with a listed
    # TILE, as tile * KM / (KEY_BLOCK / TILE) + block, increasing, then -1: attention
    # computes these only (a tile of a short sequence, or of padding, costs what it sees)
    columns: jax.Array  # int32 [U, M, B, N]: the row's distinct tokens (N <= R), each by
    # the column it is computed at (padding: column 0)
    sources: jax.Array  # int32 [U, M, B, R]: each column's index into `columns` (a prompt
    # token its group repeats in each sample's first TILE is computed once; padding: 0)

    @property
    def computed_tokens(self) -> int:
        """Token rows the projections and MLPs run on: B x N for each micro-batch with a
        scored token (the train step skips the others)."""
        used = np.asarray((self.weights > 0) | (self.audited > 0)).any(axis=(-1, -2))  # [U, M]
        return int(used.sum()) * int(np.prod(self.columns.shape[2:]))


def _first_fit(lengths, capacity: int) -> list[list[int]]:
    """Indices of `lengths` packed first-fit decreasing into rows of `capacity`."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def shared_prefix(prompt_length: int) -> int:
    """Tokens of a prompt its samples can share in a row: its whole TILEs before the
    prompt's last token (that one predicts the first output token, so each sample keeps
    it)."""
    return (prompt_length - 1) // TILE * TILE


def _units(lengths: np.ndarray, groups, width: int) -> list[tuple[int, tuple[int, ...]]]:
    """The units a row holds for rows of `width`: (prefix, members). lengths int [N]
    (aligned); groups: (prefix, member indices) of samples sharing their first `prefix`
    tokens. A group becomes units of the prefix + as many members as fit (longest first);
    a unit of one member, and every sample in no group, is (0, (i,)): the whole sequence."""
    units, grouped = [], set()
    for prefix, members in groups:
        chunk, used = [], prefix
        for i in sorted(map(int, members), key=lambda i: -lengths[i]):
            if chunk and used + lengths[i] - prefix > width:
                units.append((prefix if len(chunk) > 1 else 0, tuple(chunk)))
                chunk, used = [], prefix
            chunk.append(i)
            used += lengths[i] - prefix
        units.append((prefix if len(chunk) > 1 else 0, tuple(chunk)))
        grouped.update(map(int, members))
    return units + [(0, (i,)) for i in range(len(lengths)) if i not in grouped]


def unit_length(unit, lengths) -> int:
    """Columns a unit (prefix, members) takes: the prefix once, then each member's rest."""
    prefix, members = unit
    return prefix + sum(int(lengths[i]) - prefix for i in members)


def _widths(lengths_per_part, groups_per_part, base: int, cap: int) -> set[int]:
    """Row widths worth trying: 1-4x the longest sequence, and each group's prefix + its
    longest j samples (j >= 2), within cap."""
    widths = set(range(base, cap + 1, base)[:4]) or {base}
    for lengths, groups in zip(lengths_per_part, groups_per_part):
        for prefix, members in groups:
            rest = np.cumsum(np.sort(lengths[np.asarray(members)] - prefix)[::-1])
            widths.update(int(prefix + c) for c in rest[1:] if prefix + c <= cap)
    return widths


def _cost(rows, micro: int, per_micro: int, width: int, lengths_per_part,
          repeats_per_part) -> int:
    """Token rows the projections and MLPs run on: parts x M x B x the planned distinct
    tokens of the fullest row (a row's columns less the prompt tokens its samples repeat,
    `repeats_per_part`; rounded like `PackedBatch.columns`). Attention runs on each tile's
    visible blocks (`kv_blocks`), so a token's cost does not grow with its row."""
    most = 0
    for part_rows, lengths, repeats in zip(rows, lengths_per_part, repeats_per_part):
        for units in part_rows:
            most = max(most, sum(unit_length(u, lengths)
                                 - (sum(int(repeats[i]) for i in u[1][1:]) if u[0] else 0)
                                 for u in units))
    return len(rows) * micro * per_micro * min(width, _round_up(max(most, 1), DISTINCT_ALIGN))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def rows_bucket(n: int) -> int:
    """Rows per micro-batch: exact up to 16, then four significant bits (18, 20, ..., 32,
    36, ...): few distinct shapes, under 12.5% padding rows."""
    return n if n <= 16 else _round_up(n, 1 << (n.bit_length() - 4))


def balanced_parts(lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """Sample indices of `parts` mini-batches of sizes differing by at most one and
    near-equal token counts (longest first, each to the lightest part with room); each
    part sorted."""
    size = -(-len(lengths) // parts)
    small = size * parts - len(lengths)  # parts that get size - 1 samples
    caps = [size - (k < small) for k in range(parts)]
    members, tokens = [[] for _ in range(parts)], np.zeros(parts)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = min((k for k in range(parts) if len(members[k]) < caps[k]), key=lambda k: tokens[k])
        members[k].append(i)
        tokens[k] += lengths[i]
    return [np.array(sorted(m)) for m in members]


def plan(lengths_per_part: list[np.ndarray], token_budget: int, row_multiple: int = 1,
         known=(), groups_per_part=None, repeats_per_part=None):
    """(R, M, B, rows per part) for parts of sequence lengths under `token_budget`; a row is
    a list of units (prefix, member indices) (`_units`).

    Raises ValueError if one sequence cannot fit the budget. row_multiple: B is a multiple
    of it (a mesh splitting rows). known: (R, M, B) shapes compiled before (a set, or a dict
    keyed by them), preferred (the cheapest that holds the parts) while within SHAPE_REUSE
    x the tightest cost. groups_per_part: per part, (prefix, member indices) of samples
    sharing their first `prefix` tokens (a multiple of TILE), or None. repeats_per_part: per
    part, int [N]: how many of a grouped sample's prompt tokens after the prefix are its
    group's first sample's (computed once in a unit, `_shared_prompt`), or None (0)."""
    groups_per_part = groups_per_part or [()] * len(lengths_per_part)
    repeats_per_part = repeats_per_part or [np.zeros(len(l), int) for l in lengths_per_part]
    cost_of = lambda rows, micro, per_micro, width: _cost(  # noqa: E731
        rows, micro, per_micro, width, lengths_per_part, repeats_per_part)
    longest = max(int(l.max()) for l in lengths_per_part)
    if longest > token_budget:
        raise ValueError(f"a sample of {longest} tokens exceeds the token budget "
                         f"({token_budget} per micro-batch); raise token_budget to at least "
                         f"{_round_up(longest, TILE)}")

    def rows_at(width):
        rows = []
        for lengths, groups in zip(lengths_per_part, groups_per_part):
            units = _units(lengths, groups, width)
            fit = _first_fit([unit_length(u, lengths) for u in units], width)
            rows.append([[units[k] for k in row] for row in fit])
        return rows

    best = None
    base = _round_up(longest, TILE)  # sequences take multiples of it (aligned_length)
    for width in sorted(_widths(lengths_per_part, groups_per_part, base,
                                max(base, min(token_budget, MAX_ROW)))):
        rows = rows_at(width)
        most = max(len(r) for r in rows)
        per_micro = max(row_multiple, token_budget // width // row_multiple * row_multiple)
        micro = -(-most // per_micro)
        per_micro = _round_up(rows_bucket(-(-most // micro)), row_multiple)
        cost = cost_of(rows, micro, per_micro, width)
        if best is None or cost < best[0]:
            best = (cost, width, micro, per_micro, rows)
    reuse = None
    for width, micro, per_micro in known:
        if width < longest:
            continue
        rows = rows_at(width)
        cost = cost_of(rows, micro, per_micro, width)
        if cost > SHAPE_REUSE * best[0] or (reuse and cost >= reuse[0]):
            continue
        if max(len(r) for r in rows) <= micro * per_micro:
            reuse = (cost, width, micro, per_micro, rows)
    return (reuse or best)[1:]


def aligned_length(n: int) -> int:
    """Columns a sequence of n tokens takes in a packed row: every sequence starts on a
    multiple of TILE, so a tile's gathered keys (`kv_blocks`) fall into the key blocks the
    sampler reduced them in (`kernels_pallas.blocked`) and the trainer reproduces its bits."""
    return _round_up(n, TILE)


def _groups(sequences, prompt_lengths, part: np.ndarray):
    """(prefix, local indices) of the part's samples sharing a `shared_prefix` (>= 2 each)."""
    by_prefix: dict = {}
    for local, i in enumerate(map(int, part)):
        prefix = shared_prefix(int(prompt_lengths[i]))
        if prefix:
            key = (prefix, np.asarray(sequences[i][:prefix], np.int64).tobytes())
            by_prefix.setdefault(key, []).append(local)
    return [(prefix, members) for (prefix, _), members in by_prefix.items() if len(members) > 1]


def _repeats(sequences, prompt_lengths, part: np.ndarray, groups) -> np.ndarray:
    """int [len(part)]: per grouped sample, how many of its prompt tokens after the prefix
    its group's first sample also has there (`plan`'s estimate of `_shared_prompt`)."""
    out = np.zeros(len(part), int)
    rest = lambda local, prefix: np.asarray(  # noqa: E731
        sequences[int(part[local])])[prefix:int(prompt_lengths[int(part[local])])]
    for prefix, members in groups:
        first = rest(members[0], prefix)
        for local in members[1:]:
            out[local] = _shared_prompt(rest(local, prefix), [(first, None)])[0]
    return out


def pack(sequences, prompt_lengths, behavior, versions, advantages, weights, audited, *,
         parts: list[np.ndarray], token_budget: int, row_multiple: int = 1,
         known=(), reserve=None, share_prefixes: bool = True) -> PackedBatch:
    """Packs samples into a PackedBatch.

    sequences: per sample int [L_i] (prompt + output); prompt_lengths int [N]; behavior,
    versions, weights, audited: per sample [L_i - prompt_i] (recorded log-prob, version, loss
    weight and checkability of each output token); advantages f32 [N]; parts: sample indices of each
    mini-batch (in order); known: as in `plan`; as a dict, each shape's value holds the
    (K, KM, N, W) tuples (`scored_columns`, kv_blocks' last axis, columns' last axis,
    items' last axis) compiled with it, one of which is taken whole when it holds the batch
    (`_compiled_widths`). reserve: per sample int [N], the tokens it could
    have taken (e.g. prompt + max_new_tokens; within the budget): the shape (rows, K, N, W)
    is planned for those, so it follows the prompts and the sampling settings, not the
    lengths the policy happened to sample (a new length is no recompile); the samples as
    sampled are then laid out densely in it (`_dense_rows`), so the micro-batches they do
    not reach hold padding alone, and the train step skips those (`rl.train`).
    share_prefixes: samples of a part with the same `shared_prefix` lay it out once.
    """
    cap = token_budget // TILE * TILE  # a reserve never makes a sample not fit
    sampled = [len(s) for s in sequences]
    planned = sampled if reserve is None else \
        [max(min(int(r), cap), n) for r, n in zip(reserve, sampled)]
    lengths = np.array([aligned_length(n) for n in planned])
    groups = [_groups(sequences, prompt_lengths, p) if share_prefixes else () for p in parts]
    repeats = [_repeats(sequences, prompt_lengths, p, g) for p, g in zip(parts, groups)]
    width, micro, per_micro, rows = plan([lengths[p] for p in parts], token_budget,
                                         row_multiple, known, groups, repeats)
    shape = (len(parts), micro, per_micro, width)
    seen = known.get((width, micro, per_micro), ()) if isinstance(known, dict) else ()
    # the planned rows' most distinct tokens, output tokens and pairs: every sampled layout's
    # bound, so K, N and W follow the plan too
    stats = [_row_stats(units, part, sequences, prompt_lengths, planned)
             for part, part_rows in zip(parts, rows) for units in part_rows]
    planned_distinct, most, planned_pairs = (max(s[k] for s in stats) for k in (1, 2, 3))
    per = KEY_BLOCK // TILE
    km_need = _round_up(int(lengths.max()) // TILE, per)  # a tile sees its sequence's TILEs
    widths = lambda scored, distinct, pairs: _compiled_widths(  # noqa: E731 (K, KM, N, W)
        seen, (scored, km_need, distinct, pairs), width, reserve is not None)
    if reserve is not None:
        k, _, n, w = widths(most, planned_distinct, planned_pairs)
        rows = _dense_rows(sequences, prompt_lengths, parts, groups, (width, n, k, w),
                           micro * per_micro) or rows
    out = _empty_fields(shape)
    per_token = {"weights": weights, "behavior": behavior, "versions": versions,
                 "audited": audited}
    tiles: dict = {}  # (u, m, b, tile) -> key blocks it sees
    distinct: dict = {}  # (u, m, b) -> the row's distinct tokens' columns
    for u, (part, part_rows) in enumerate(zip(parts, rows)):
        for r, units in enumerate(part_rows):
            row = (u, *divmod(r, per_micro))
            distinct[row] = _lay_row(out, tiles, row, units, part, sequences, prompt_lengths,
                                     advantages, per_token)
    row_pairs: dict = {}  # (u, m, b) -> (tile, key block) pairs with a listed TILE
    for (*row, _), blocks in tiles.items():
        row_pairs[tuple(row)] = row_pairs.get(tuple(row), 0) + -(-len(blocks) // per)
    needed = (out["weights"] > 0) | (out["audited"] > 0)
    scored = int(needed.sum(-1).max(initial=0))
    reserved = reserve is not None  # the planned bounds hold any sampled layout's
    k, km, n, w = widths(max(scored, most if reserved else 0),
                         max(max(map(len, distinct.values())),
                             planned_distinct if reserved else 0),
                         max(max(row_pairs.values(), default=0), planned_pairs))
    out["scored"] = scored_columns(needed, k)
    _index_tables(out, tiles, distinct, shape, (km, n, w))
    return PackedBatch(**{k: jax.numpy.asarray(v) for k, v in out.items()})


def _empty_fields(shape) -> dict:
    """The per-column fields of a PackedBatch of `shape` [U, M, B, R], zero-filled."""
    out = {k: np.zeros(shape, np.float32 if k in ("weights", "behavior", "advantages")
                       else np.int32)
           for k in ("tokens", "positions", "segments", "parents", "targets", "weights",
                     "behavior", "versions", "advantages", "audited")}
    out["sources"] = np.zeros(shape, np.int32)
    return out


def _lay_row(out, tiles, row, units, part, sequences, prompt_lengths, advantages,
             per_token) -> list:
    """Lays out one packed row's units (a shared prefix once, then its samples) into `out`
    at `row` (u, m, b) and records its tiles' key blocks in `tiles`; returns the columns of
    the row's distinct tokens."""
    at, segment, columns = 0, 0, []
    for prefix, members in units:
        parent, prefix_blocks, prompts = 0, [], []
        if prefix:  # laid out once; its targets are never scored
            segment += 1
            seq = np.asarray(sequences[int(part[members[0]])])
            _lay_prefix(out, row, at, seq, prefix, segment, columns)
            prefix_blocks = _tile_blocks(tiles, row, at, prefix, [])
            parent, at = segment, at + prefix
        for local in members:
            segment += 1
            i = int(part[local])
            seq, p = np.asarray(sequences[i])[prefix:], int(prompt_lengths[i]) - prefix
            _lay_sample(out, row, at, seq, p, prefix, (segment, parent), advantages[i],
                        {key: value[i] for key, value in per_token.items()}, prompts, columns)
            _tile_blocks(tiles, row, at, len(seq), prefix_blocks)
            at += aligned_length(len(seq))
    return columns


def _lay_prefix(out, row, at: int, seq, prefix: int, segment: int, columns: list) -> None:
    """A shared prefix (the first `prefix` tokens of seq) at column `at`, its targets included."""
    sources = out["sources"][row]
    out["tokens"][row][at:at + prefix] = seq[:prefix]
    out["positions"][row][at:at + prefix] = np.arange(prefix)
    out["segments"][row][at:at + prefix] = segment
    out["targets"][row][at:at + prefix] = seq[1:prefix + 1]
    sources[at:at + prefix] = len(columns) + np.arange(prefix)
    columns.extend(range(at, at + prefix))


def _lay_sample(out, row, at: int, seq, p: int, prefix: int, segments: tuple, advantage,
                per_token: dict, prompts: list, columns: list) -> None:
    """One sample's tokens after its prefix (seq; p of them prompt tokens) at column `at`:
    its per-token fields on its output tokens' predicting columns, its prompt tokens equal
    to an earlier sample's of the unit sourced from that one (`_shared_prompt`)."""
    segment, parent = segments
    sources = out["sources"][row]
    n, o = len(seq), len(seq) - p
    out["tokens"][row][at:at + n] = seq
    out["positions"][row][at:at + n] = prefix + np.arange(n)
    out["segments"][row][at:at + n] = segment
    out["parents"][row][at:at + n] = parent
    out["targets"][row][at:at + n - 1] = seq[1:]
    out["advantages"][row][at + p - 1:at + n - 1] = advantage
    for key, value in per_token.items():
        out[key][row][at + p - 1:at + p - 1 + o] = value
    shared, index = _shared_prompt(seq[:p], prompts)
    if shared:
        sources[at:at + shared] = index[:shared]
    sources[at + shared:at + n] = len(columns) + np.arange(n - shared)
    columns.extend(range(at + shared, at + n))
    prompts.append((seq[:p], sources[at:at + p].copy()))


def _index_tables(out, tiles, distinct, shape, widths: tuple) -> None:
    """kv_blocks, items and columns of `out` from the tiles' key blocks and the rows'
    distinct columns, at widths (KM, N, W)."""
    km, n, w = widths
    per = KEY_BLOCK // TILE
    width = shape[3]
    out["kv_blocks"] = np.full((*shape[:3], width // TILE, km), -1, np.int32)
    for (*row, tile), blocks in tiles.items():
        out["kv_blocks"][tuple(row)][tile, :len(blocks)] = blocks
    filled = out["kv_blocks"][..., ::per] >= 0  # [U, M, B, R / TILE, KM / 4]
    filled = filled.reshape(*shape[:3], -1)
    out["items"] = np.full((*shape[:3], w), -1, np.int32)
    for row in np.ndindex(*shape[:3]):
        pairs = np.flatnonzero(filled[row])
        out["items"][row][:len(pairs)] = pairs
    out["columns"] = np.zeros((*shape[:3], n), np.int32)
    for row, columns in distinct.items():
        out["columns"][row][:len(columns)] = columns


def _compiled_widths(seen, needs: tuple, width: int, planned: bool) -> tuple[int, ...]:
    """(K, KM, N, W) for a shape: the compiled tuple (`seen`) holding every need that
    computes least, else fresh widths (K rounded up to ROW_ALIGN, or to R / 4 steps when
    not planned; N to DISTINCT_ALIGN; W to PAIR_ALIGN). One tuple, never a mix: a K of one
    compiled step and an N of another would be a new program."""
    holding = [t for t in seen if all(c >= need for c, need in zip(t, needs))]
    if holding:
        return min(holding, key=lambda t: (t[2], t[0], t[3], t[1]))
    scored, km, distinct, pairs = needs
    step = ROW_ALIGN if planned else max(ROW_ALIGN, width // 4)
    return (min(width, _round_up(max(scored, 1), step)), km,
            min(width, _round_up(max(distinct, 1), DISTINCT_ALIGN)),
            _round_up(max(pairs, 1), PAIR_ALIGN))


def _member_stats(prefix: int, prompt, n: int, p: int, earlier: list) -> tuple[int, ...]:
    """(columns, distinct tokens, output tokens, (tile, key block) pairs) one sample adds to
    a unit with a shared `prefix` (0: none): n tokens and a prompt of p after the prefix
    (`prompt`: those p ids), `earlier` the unit's earlier members' prompts (as
    `_shared_prompt` takes them)."""
    shared, _ = _shared_prompt(prompt, earlier)
    return aligned_length(n), n - shared, n - p, _pair_count(prefix // TILE, n)


def _unit_stats(unit, part, sequences, prompt_lengths, counts) -> tuple[int, ...]:
    """(columns, distinct tokens, output tokens, pairs) a unit (prefix, members) takes with
    its samples at `counts` tokens (per sample: planned or sampled), as `pack` lays it out."""
    prefix, members = unit
    total = (prefix, prefix, 0, _pair_count(0, prefix) if prefix else 0)
    earlier = []
    for local in members:
        i = int(part[local])
        p = int(prompt_lengths[i]) - prefix
        prompt = np.asarray(sequences[i])[prefix:prefix + p]
        add = _member_stats(prefix, prompt, int(counts[i]) - prefix, p, earlier)
        earlier.append((prompt, None))
        total = tuple(map(sum, zip(total, add)))
    return total


def _row_stats(units, part, sequences, prompt_lengths, counts) -> tuple[int, ...]:
    """`_unit_stats` summed over a row's units."""
    stats = [_unit_stats(u, part, sequences, prompt_lengths, counts) for u in units]
    return tuple(map(sum, zip(*stats))) if stats else (0, 0, 0, 0)


def _dense_units(sequences, prompt_lengths, part, groups, bounds: tuple) -> list:
    """The part's units at the sampled lengths, each within `bounds` (a group's prefix + as
    many members as fit, longest first, as `_units`): [(unit, its stats)]."""
    sampled = [len(s) for s in sequences]
    units, grouped = [], set()

    def close(prefix, chunk, total):  # a unit of one member is the whole sequence
        unit = (prefix, tuple(chunk)) if len(chunk) > 1 else (0, tuple(chunk))
        units.append((unit, total if len(chunk) > 1 else
                      _unit_stats(unit, part, sequences, prompt_lengths, sampled)))

    for prefix, members in groups:
        grouped.update(map(int, members))
        start = (prefix, prefix, 0, _pair_count(0, prefix))
        chunk, total, earlier = [], start, []
        for local in sorted(map(int, members), key=lambda i: -sampled[int(part[i])]):
            i = int(part[local])
            p = int(prompt_lengths[i]) - prefix
            prompt = np.asarray(sequences[i])[prefix:prefix + p]
            grown = tuple(map(sum, zip(total, _member_stats(prefix, prompt, sampled[i] - prefix,
                                                            p, earlier))))
            if chunk and not all(t <= b for t, b in zip(grown, bounds)):
                close(prefix, chunk, total)
                chunk, earlier = [], []
                grown = tuple(map(sum, zip(start, _member_stats(prefix, prompt,
                                                                sampled[i] - prefix, p, []))))
            chunk.append(local)
            earlier.append((prompt, None))
            total = grown
        close(prefix, chunk, total)
    for local in range(len(part)):
        if local not in grouped:
            close(0, [local], None)
    return units


def _dense_rows(sequences, prompt_lengths, parts, groups, bounds: tuple, room: int):
    """Each part's samples at their sampled lengths packed first-fit decreasing into rows
    within `bounds` (columns R, distinct tokens N, output tokens K, pairs W: the planned
    shape's), or None if a part needs more than `room` rows (first-fit can need more bins
    for smaller items; the planned layout then holds them)."""
    out = []
    for part, part_groups in zip(parts, groups):
        rows, used = [], []
        units = _dense_units(sequences, prompt_lengths, part, part_groups, bounds)
        for unit, stats in sorted(units, key=lambda u: -max(s / b for s, b in zip(u[1], bounds))):
            if not all(s <= b for s, b in zip(stats, bounds)):
                return None
            for r, total in enumerate(used):
                grown = tuple(map(sum, zip(total, stats)))
                if all(t <= b for t, b in zip(grown, bounds)):
                    rows[r].append(unit)
                    used[r] = grown
                    break
            else:
                rows.append([unit])
                used.append(stats)
        if len(rows) > room:
            return None
        out.append(rows)
    return out


def _tile_blocks(tiles: dict, row: tuple, at: int, n: int, before: list[int]) -> list[int]:
    """Records the TILEs of keys each tile of a sequence of n tokens at column `at` (a
    tile edge) sees: `before` (its prefix's), then its own up to itself, in the sequence's
    order. Returns all of its TILEs."""
    first = at // TILE
    own = list(range(first, first + -(-n // TILE)))
    for j, block in enumerate(own):
        tiles[(*row, block)] = before + own[:j + 1]
    return before + own


def _pair_count(before: int, n: int) -> int:
    """(tile, key block) pairs of a sequence of n tokens whose tiles each first see
    `before` TILEs (its prefix's): tile j sees before + j + 1 TILEs."""
    per = KEY_BLOCK // TILE
    return sum(-(-(before + j + 1) // per) for j in range(-(-n // TILE)))


def _shared_prompt(prompt: np.ndarray, earlier: list) -> tuple[int, np.ndarray | None]:
    """(shared, indices): how many leading tokens of a sample's prompt rest (`prompt`, int
    [p]) an earlier sample of its unit laid out identically (the longest such run; same
    tokens from the shared prefix on, so the same positions and computation), and that
    sample's `sources` for them. earlier: (prompt rest, its sources) per earlier member."""
    best, index = 0, None
    for other, sources in earlier:
        m = min(len(prompt), len(other))
        differ = np.flatnonzero(prompt[:m] != other[:m])
        common = int(differ[0]) if len(differ) else m
        if common > best:
            best, index = common, sources
    return best, index


def scored_columns(weights: np.ndarray, k: int) -> np.ndarray:
    """weights f32 or bool [..., R] -> int32 [..., k]: each row's columns > 0 in order,
    padded with R (only the LM head computes the padding). k (`_compiled_widths`' K) must
    hold the most any row has."""
    width = weights.shape[-1]
    keep = weights > 0
    most = int(keep.sum(-1).max(initial=0))
    if not most <= k <= width:
        raise ValueError(f"k={k} must hold a row's {most} scored columns, at most R={width}")
    # stable sort puts each row's kept columns first, in order; the rest become R
    order = np.argsort(~keep, axis=-1, kind="stable")[..., :k]
    return np.where(np.take_along_axis(keep, order, -1), order, width).astype(np.int32)
