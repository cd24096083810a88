"""Slow, obviously-right float64 numpy loops over (t, KV head), written from the paper's rules.

They share no code with `pisa_jax`: they are the independent side of the reference tests.
"""

from __future__ import annotations

import numpy as np


def _reduce(z: np.ndarray, selector: str) -> float:
  if selector == "pisa":  # Eq. 21
    m = z.max()
    return float(m + np.log(np.exp(z - m).sum()))
  mean = float(z.mean())
  if selector == "pisa1":  # Eq. 33
    return mean
  return mean + 0.5 * float(((z - mean) ** 2).mean())  # Eq. 34, population variance


def pyramid(k: np.ndarray, block_size: int, branching: int) -> list[np.ndarray]:
  """k `[T, H, D]` -> summaries per level `[M_l, H, D]`, leaves first (Eq. 2, 10-15)."""
  seq_len = k.shape[0]
  num_blocks = -(-seq_len // block_size)
  levels = [np.stack([k[i * block_size:min((i + 1) * block_size, seq_len)].mean(0)
                      for i in range(num_blocks)])]
  while len(levels[-1]) > 1:
    below = levels[-1]
    n = -(-len(below) // branching)
    levels.append(np.stack([below[j * branching:min((j + 1) * branching, len(below))].mean(0)
                            for j in range(n)]))
  return levels


def select_hierarchical(q, k, *, block_size, top_k, branching, selector, scale, beam=None):
  """q `[T, HQ, D]`, k `[T, HKV, D]` -> int `[T, HKV, top_k]`, the paper's selection rules, literally."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  seq_len, hq, _ = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  beam = top_k if beam is None else beam
  levels = pyramid(k, block_size, branching)
  out = np.full((seq_len, hkv, top_k), -1, np.int64)
  for t in range(seq_len):
    cur = t // block_size
    forced_leaves = {b for b in (0, cur - 1, cur) if b >= 0}
    for h in range(hkv):
      heads = range(h * group, (h + 1) * group)
      cand = [0]
      for level in range(len(levels), 0, -1):
        keep = top_k if level == 1 else beam
        span = block_size * branching ** (level - 1)
        cand = [i for i in cand if i < len(levels[level - 1]) and i * span <= t]
        if len(cand) <= keep:
          kept = list(cand)
        else:
          ancestors = {b // branching ** (level - 1) for b in forced_leaves}
          forced = [i for i in cand if i in ancestors]
          scored = []
          for i in cand:
            if i in forced:
              continue
            if level == 1:
              children = k[i * block_size:min((i + 1) * block_size, seq_len), h]
            else:
              below = levels[level - 2]
              children = below[i * branching:min((i + 1) * branching, len(below)), h]
            u = sum(_reduce(scale * children @ q[t, hh], selector) for hh in heads)
            scored.append((-u, i))
          scored.sort()
          kept = forced + [i for _, i in scored[:keep - len(forced)]]
        if level > 1:
          cand = sorted(c for i in kept for c in range(i * branching, (i + 1) * branching))
        else:
          cand = sorted(kept)
      out[t, h, :len(cand)] = cand
  return out


def select_flat(q, k, *, block_size, top_k, scale, selector):
  """"bsa" (per-head softmax over the mean-key summaries of every block complete at t, the current
  one too at its last position, summed over the group for each past block) or "exact" (summed
  raw-key LSE of complete past blocks); forced first/previous/current; then top-k."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  seq_len, hq, _ = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  leaves = pyramid(k, block_size, 2)[0]
  out = np.full((seq_len, hkv, top_k), -1, np.int64)
  for t in range(seq_len):
    cur = t // block_size
    for h in range(hkv):
      if cur + 1 <= top_k:
        out[t, h, :cur + 1] = np.arange(cur + 1)
        continue
      u = np.zeros(cur)
      for hh in range(h * group, (h + 1) * group):
        if selector == "bsa":
          z = scale * leaves[:(t + 1) // block_size, h] @ q[t, hh]
          p = np.exp(z - z.max())
          u += (p / p.sum())[:cur]
        else:
          for i in range(cur):
            u[i] += _reduce(scale * k[i * block_size:(i + 1) * block_size, h] @ q[t, hh], "pisa")
      rest = sorted((-u[i], i) for i in range(1, cur - 1))
      kept = [0, cur - 1, cur] + [i for _, i in rest[:top_k - 3]]
      out[t, h] = sorted(kept)
  return out


def full_attention_reference_set(q, k, *, block_size, top_k, scale):
  """Grouped full-attention block mass P `[T, HKV, M]` and the reference set `[T, HKV, top_k]`."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  seq_len, hq, _ = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  num_blocks = -(-seq_len // block_size)
  mass = np.zeros((seq_len, hkv, num_blocks))
  ref = np.full((seq_len, hkv, top_k), -1, np.int64)
  for t in range(seq_len):
    cur = t // block_size
    for h in range(hkv):
      for hh in range(h * group, (h + 1) * group):
        z = scale * k[:t + 1, h] @ q[t, hh]
        w = np.exp(z - z.max())
        w /= w.sum()
        for s in range(t + 1):
          mass[t, h, s // block_size] += w[s] / group
      if cur + 1 <= top_k:
        ref[t, h, :cur + 1] = np.arange(cur + 1)
        continue
      rest = sorted((-mass[t, h, i], i) for i in range(1, cur - 1))
      ref[t, h] = sorted([0, cur - 1, cur] + [i for _, i in rest[:top_k - 3]])
  return mass, ref


# ----------------------------------------------------------------------------- NSA (Yuan et al.)
# One document of T tokens, float64, loops over (t, head): compressed blocks [i d, i d + l),
# selection blocks [j l', (j + 1) l'), the window t - w < j <= t.


def nsa_compress(x, mlp, *, block_length, stride):
  """x `[T, H, D]` -> `[NC, H, D]` for every complete block (NC may be 0): phi(block + position)
  with phi = silu(. w1 + b1) w2 + b2 over the flattened block, or the mean when mlp is None."""
  x = np.asarray(x, np.float64)
  seq_len, heads, _ = x.shape
  count = (seq_len - block_length) // stride + 1 if seq_len >= block_length else 0
  out = []
  for i in range(count):
    block = x[i * stride:i * stride + block_length]  # [l, H, D]
    if mlp is None:
      out.append(block.mean(0))
      continue
    position, w1, b1, w2, b2 = (np.asarray(p, np.float64) for p in mlp)
    rows = []
    for h in range(heads):
      z = (block[:, h] + position).reshape(-1) @ w1 + b1
      rows.append((z / (1.0 + np.exp(-z))) @ w2 + b2)
    out.append(np.stack(rows))
  return np.stack(out) if out else np.zeros((0, heads, x.shape[2]))


def nsa_compressed_attention(q, k_cmp, v_cmp, *, block_length, stride, scale):
  """q `[T, HQ, D]` over compressed blocks wholly at or before t: out `[T, HQ, D]`, lse `[T, HQ]`
  (-inf and zeros where no block is complete)."""
  q = np.asarray(q, np.float64)
  seq_len, hq, d = q.shape
  hkv = k_cmp.shape[1]
  group = hq // hkv
  out = np.zeros((seq_len, hq, d))
  lse = np.full((seq_len, hq), -np.inf)
  for t in range(seq_len):
    seen = [i for i in range(k_cmp.shape[0]) if i * stride + block_length - 1 <= t]
    if not seen:
      continue
    for hh in range(hq):
      z = np.array([scale * q[t, hh] @ k_cmp[i, hh // group] for i in seen])
      m = z.max()
      w = np.exp(z - m)
      lse[t, hh] = m + np.log(w.sum())
      out[t, hh] = sum(wi / w.sum() * v_cmp[i, hh // group] for wi, i in zip(w, seen))
  return out, lse


def nsa_select(q, k_cmp, *, block_length, stride, select_block_size, top_n, scale):
  """NSA's selection `[T, HKV, top_n]` (ascending, -1 padded): each head's softmax over the
  complete compressed blocks, block i's probability credited to selection block j once per
  d-token piece they share (|[i d, i d + l) & [j l', (j + 1) l')| / d), summed over the group;
  the first, previous and current blocks forced, the rest by score, ties to the lower index."""
  q = np.asarray(q, np.float64)
  k_cmp = np.asarray(k_cmp, np.float64)
  seq_len, hq, _ = q.shape
  hkv = k_cmp.shape[1]
  group = hq // hkv
  lb, out = select_block_size, np.full((seq_len, hkv, top_n), -1, np.int64)
  for t in range(seq_len):
    cur = t // lb
    if cur + 1 <= top_n:
      out[t, :, :cur + 1] = np.arange(cur + 1)
      continue
    seen = [i for i in range(k_cmp.shape[0]) if i * stride + block_length - 1 <= t]
    for h in range(hkv):
      score = np.zeros(cur + 1)
      for hh in range(h * group, (h + 1) * group):
        z = np.array([scale * q[t, hh] @ k_cmp[i, h] for i in seen])
        p = np.exp(z - z.max())
        p /= p.sum()
        for pi, i in zip(p, seen):
          for j in range(cur + 1):
            shared = min(i * stride + block_length, (j + 1) * lb) - max(i * stride, j * lb)
            score[j] += pi * max(shared, 0) / stride
      rest = sorted((-score[j], j) for j in range(1, cur - 1))
      out[t, h] = sorted([0, cur - 1, cur] + [j for _, j in rest[:top_n - 3]])
  return out


def sliding_window_attention(q, k, v, *, window, scale):
  """Causal attention of query t over keys t - w < j <= t, `[T, HQ, D]`."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seq_len, hq, d = q.shape
  group = hq // k.shape[1]
  out = np.zeros((seq_len, hq, d))
  for t in range(seq_len):
    keys = range(max(0, t - window + 1), t + 1)
    for hh in range(hq):
      z = np.array([scale * q[t, hh] @ k[j, hh // group] for j in keys])
      w = np.exp(z - z.max())
      out[t, hh] = (w / w.sum()) @ v[list(keys), hh // group]
  return out


def selected_attention(q, k, v, block_indices, *, block_size, scale):
  """Attention of query t over the keys j <= t of its KV head's selected blocks, `[T, HQ, D]`."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seq_len, hq, d = q.shape
  group = hq // k.shape[1]
  out = np.zeros((seq_len, hq, d))
  for t in range(seq_len):
    for hh in range(hq):
      keys = [j for b in block_indices[t, hh // group] if b >= 0
              for j in range(b * block_size, min((b + 1) * block_size, t + 1))]
      z = np.array([scale * q[t, hh] @ k[j, hh // group] for j in keys])
      w = np.exp(z - z.max())
      out[t, hh] = (w / w.sum()) @ v[keys, hh // group]
  return out


def nsa_attention(q, k, v, gates, key_mlp, value_mlp, *, block_length, stride,
                  select_block_size, top_n, window, scale):
  """Eq. 5 of NSA for one document: gates `[T, HQ, 3]` (compressed, selected, window); the
  MLPs None for mean compression. Returns (out `[T, HQ, D]`, selected blocks)."""
  k_cmp = nsa_compress(k, key_mlp, block_length=block_length, stride=stride)
  v_cmp = nsa_compress(v, value_mlp, block_length=block_length, stride=stride)
  o_cmp, _ = nsa_compressed_attention(q, k_cmp, v_cmp, block_length=block_length,
                                      stride=stride, scale=scale)
  idx = nsa_select(q, k_cmp, block_length=block_length, stride=stride,
                   select_block_size=select_block_size, top_n=top_n, scale=scale)
  o_slc = selected_attention(q, k, v, idx, block_size=select_block_size, scale=scale)
  o_win = sliding_window_attention(q, k, v, window=window, scale=scale)
  g = np.asarray(gates, np.float64)[..., None]
  return g[:, :, 0] * o_cmp + g[:, :, 1] * o_slc + g[:, :, 2] * o_win, idx


def fla_parallel_nsa_topk(q, k, *, block_size, block_counts, scale):
  """fla's `parallel_nsa_topk` rule, as its kernel reads: keys mean-pooled in blocks of C
  (`mean_pooling`); lse over the blocks c < (t + 1) // C; candidates c <= t // C, the first and
  the last two scoring 1 per head, the others exp(q k_c scale - lse) per head, summed over the
  group; the block_counts best kept. Returned as sets: sorted ascending, -1 padded."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  seq_len, hq, _ = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  num = -(-seq_len // block_size)
  k_cmp = np.stack([k[c * block_size:(c + 1) * block_size].mean(0) for c in range(num)])
  out = np.full((seq_len, hkv, block_counts), -1, np.int64)
  for t in range(seq_len):
    complete, cur = (t + 1) // block_size, t // block_size
    for h in range(hkv):
      score = np.zeros(cur + 1)
      for hh in range(h * group, (h + 1) * group):
        z = scale * k_cmp[:cur + 1, h] @ q[t, hh]
        lse = np.log(np.exp(z[:complete] - z[:complete].max()).sum()) + z[:complete].max() \
            if complete else 0.0
        for c in range(cur + 1):
          score[c] += 1.0 if c in (0, cur - 1, cur) else np.exp(z[c] - lse)
      best = sorted(range(cur + 1), key=lambda c: -score[c])[:block_counts]
      out[t, h, :len(best)] = sorted(best)
  return out
def _log_sum_exp(z) -> float:
  z = np.asarray(z, np.float64)
  m = z.max()
  return float(m + np.log(np.exp(z - m).sum()))


def hils_landmark(k_chunk, prior, scale):
  """HiLS's landmark of one chunk: key weights p = softmax(scale * k_chunk @ prior) over its C
  keys `[C, D]`, landmark key p @ k_chunk and entropy bias -sum p log p."""
  z = scale * k_chunk @ prior
  p = np.exp(z - z.max())
  p /= p.sum()
  return p @ k_chunk, float(-(p * np.log(p)).sum())


def hils(q, k, v, landmark_q, *, chunk_size, top_k, window, scale, segment_ids=None):
  """HiLS for one row, literally: q, landmark_q `[T, HQ, D]`, k, v `[T, HKV, D]` (segment_ids
  `[T]` or None) -> out `[T, HQ, D]`, selected chunks `[T, HKV, top_k]` ascending, -1 padded,
  and the chunk scores {(t, hq): [s^ of chunk 0 .. n-1 of t's document]}.

  Per query t at document position r: chunks c < n = max(floor((r - W + 1) / C), 0) are eligible,
  the window holds the document's keys n C .. r; each chunk's landmark is pooled by the landmark
  query of its last token; the selection ranks by the group's largest normalised chunk
  log-probability against the window's log-sum-exp; the output weighs window key j by
  e^{s_tj} / den and key j of selected chunk c by [e^{s_tj} / Z_tc] [e^{s^_tc} / den], with
  den = sum_window e^{s_tj} + sum_selected e^{s^_tc} + 1.
  """
  q, k, v, lq = (np.asarray(x, np.float64) for x in (q, k, v, landmark_q))
  seq_len, hq, d = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  c_size = chunk_size
  seg = np.zeros(seq_len, np.int64) if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((seq_len, hq, d))
  selected = np.full((seq_len, hkv, top_k), -1, np.int64)
  scores = {}
  for t in range(seq_len):
    s = int(np.flatnonzero(seg == seg[t])[0])
    r = t - s
    n = max((r - window + 1) // c_size, 0)
    win = np.arange(s + n * c_size, t + 1)
    s_hat = np.zeros((hq, n))
    lse_win = np.zeros(hq)
    for hh in range(hq):
      h = hh // group
      for c in range(n):
        lo = s + c * c_size
        lk, lb = hils_landmark(k[lo:lo + c_size, h], lq[lo + c_size - 1, hh], scale)
        s_hat[hh, c] = scale * lq[t, hh] @ lk + lb
      scores[(t, hh)] = s_hat[hh].copy()
      lse_win[hh] = _log_sum_exp(scale * k[win, h] @ q[t, hh])
    for h in range(hkv):
      heads = range(h * group, (h + 1) * group)
      rank = [max(s_hat[hh, c] - np.logaddexp(lse_win[hh], _log_sum_exp(s_hat[hh]))
                  for hh in heads) for c in range(n)]
      chosen = sorted(sorted(range(n), key=lambda c: (-rank[c], c))[:top_k])
      selected[t, h, :len(chosen)] = chosen
      for hh in heads:
        z_win = scale * k[win, h] @ q[t, hh]
        top = max([z_win.max(), 0.0] + [s_hat[hh, c] for c in chosen])
        den = np.exp(z_win - top).sum() + np.exp(-top)
        num = np.exp(z_win - top) @ v[win, h]
        for c in chosen:
          lo = s + c * c_size
          z = scale * k[lo:lo + c_size, h] @ q[t, hh]
          p = np.exp(z - z.max())
          p /= p.sum()
          weight = np.exp(s_hat[hh, c] - top)
          den += weight
          num += weight * (p @ v[lo:lo + c_size, h])
        out[t, hh] = num / den
  return out, selected, scores
