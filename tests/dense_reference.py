"""Independent numpy references: dense attention over K/V gathered token by token."""
import numpy as np


def gather_tokens(pages, page_table_row, length):
    """pages [P, Hkv, ps, D] -> [length, Hkv, D], one token at a time (no vectorised gather)."""
    page_size = pages.shape[2]
    if length == 0:
        return np.zeros((0, pages.shape[1], pages.shape[3]))
    return np.stack([pages[page_table_row[t // page_size], :, t % page_size]
                     for t in range(length)])


def dense_attention(q, k, v, q_pos, scale):
    """q [Tq, Hq, D], k/v [L, Hkv, D], q_pos [Tq] -> [Tq, Hq, D] in float64, causal by position."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    out = np.zeros(q.shape)
    for i, p in enumerate(q_pos):
        n = p + 1
        if n <= 0 or k.shape[0] == 0:
            continue
        s = np.einsum("hd,lhd->hl", q[i], k[:n]) * scale
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        out[i] = np.einsum("hl,lhd->hd", s, v[:n])
    return out
