"""Autoregressive generation with a decode cache: a batch of prompts of different lengths is
prefilled by one jitted call, then every row advances one token a step, `steps_per_call` steps
in each jitted call (a loop on the device; Section 3.3 "Decoding": a sparse layer's step
appends, selects and attends in O(log N)).

`pisa_jax` never imports a model: `generate` drives anything that implements `DecodeModel` (a
`pisa_jax.models.Decoder` does, its sparse layers through `decode_step`, its dense ones through a
plain KV cache).

    out = pisa_jax.generate(model, [[15496, 995], [464]], max_new_tokens=32, stop_tokens=(50256,))
    out.sequences()   # the new tokens of each row, up to and including its stop token
    out = pisa_jax.generate(model, prompts, max_new_tokens=32, temperature=0.8, top_p=0.95,
                            key=jax.random.key(1))      # sampled, reproducible from the key

Rows are independent: a row's tokens are those it would get generated alone (greedy: always; sampled:
with the same row key, see `generate`'s `key`), whatever the lengths of the other prompts.
A prompt too long for one pass is read in chunks (`prefill_chunk=`): each chunk is appended to
the cache and its queries select over everything before it, with the same first token and cache
as one pass.

Shapes are bucketed so that compiled code is reused across calls: prompts are right-padded to a
power of two, and the cache holds the power-of-two bucket (`bucket_capacity`) of the longest
prompt plus max_new_tokens. A smaller `initial_capacity` starts the cache small and grows it
between buckets as the rows advance: the step then compiles once per bucket, O(log N) times in a
generation, never per token.

`pisa_jax.generate` is the function; this module (`pisa_jax.generation`) holds it with the
`DecodeModel` protocol and the sampling helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# Every op registered (and the kernels' modules imported) before the first trace: the import
# inside the first trace defines jax config options, which changes the tracing context, so the
# second generation in a process traced and compiled its prefill again (1.4 s on `tiny`, CPU).
from pisa_jax import _ops  # noqa: F401
from pisa_jax._validation import _is_int
from pisa_jax.decode import bucket_capacity

# The shortest padded prompt and the smallest cache, in tokens: tiny prompts share one compile.
MIN_BUCKET = 16
# What a row's output holds after its stop token.
PAD = -1


@runtime_checkable
class DecodeModel(Protocol):
  """What `generate` needs from a model.

  The model is a pytree of arrays (an NNX module is one) whose methods are pure functions of
  their arguments: `generate` passes it as an argument to `jax.jit`-ed functions. The decode
  state is a pytree too, opaque to `generate`, that the methods create, fill and extend; a row's
  next position is its own length (prompt length plus the tokens fed since).
  """

  # Token ids lie in [0, vocab_size).
  vocab_size: int

  def init_decode_state(self, batch: int, capacity: int) -> Any:
    """An empty state for `batch` rows of at least `capacity` tokens each (under `jit`)."""

  def grow_decode_state(self, state: Any, capacity: int) -> Any:
    """The same rows with room for at least `capacity` tokens each (called outside `jit`)."""

  def prefill(self, tokens: Int[Array, "B T"], lengths: Int[Array, "B"],
              state: Any) -> tuple[Float[Array, "B V"], Any]:
    """Reads right-padded prompts (row b's tokens are tokens[b, :lengths[b]], lengths >= 1) into
    an empty state; returns float32 logits of each row's last prompt token and the state.
    Packed prompts (`generate(..., prompt_segment_ids=...)`) also pass `segment_ids=` `[B, T]`:
    the state then continues each row's last document."""

  def decode(self, tokens: Int[Array, "B"], state: Any) -> tuple[Float[Array, "B V"], Any]:
    """Appends one token per row at the row's length; returns float32 logits of that position
    (the distribution of the next token) and the state with every length one longer."""

  # Optional, for `generate(..., prefill_chunk=S)`:
  #
  # def prefill_chunk(self, tokens: Int[Array, "B S"], lengths: Int[Array, "B"], state: Any,
  #                   offset: Int[Array, ""]) -> tuple[Float[Array, "B V"], Any]:
  #   """Appends row b's tokens[b, :lengths[b]] at positions offset .. offset + lengths[b] - 1
  #   (offset traced; every row with lengths[b] > 0 holds exactly offset tokens, rows with 0
  #   are left as they are; the state has room for offset + S tokens). The chunk's queries see
  #   every token before them. Returns float32 logits of each row's last appended token
  #   (unspecified where lengths[b] == 0) and the state."""


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` produced.

  Attributes:
    tokens: int32 `[B, S]`, the new tokens of each row in order; S <= max_new_tokens (fewer when
      every row stopped early). A row's stop token is kept; after it the row holds PAD (-1).
    lengths: int32 `[B]`, new tokens per row, its stop token included.
    stopped: bool `[B]`, whether the row ended on one of the stop tokens.
    logits: float32 `[B, S, V]`, the logits each token was drawn from (before temperature and
      top_p), with `return_logits`; else None. A row's logits after its stop token are stale.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  stopped: np.ndarray
  logits: np.ndarray | None = None

  def sequences(self) -> list[list[int]]:
    """The new tokens of each row, as lists of ints without padding."""
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def generate(model: DecodeModel, prompt_tokens, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, stop_tokens: Sequence[int] = (), key=None,
             seed: int | None = None, prompt_lengths=None, prompt_segment_ids=None,
             prefill_chunk: int | None = None, initial_capacity: int | None = None,
             return_logits: bool = False, steps_per_call: int = 16) -> Generation:
  """Generates up to `max_new_tokens` tokens after each prompt.

  Args:
    model: a `DecodeModel` (e.g. `pisa_jax.models.Decoder`).
    prompt_tokens: a list of token sequences (lengths may differ), or an int array `[B, T]` of
      right-padded prompts with `prompt_lengths` (default: T for every row). Each has >= 1 token.
      Rows are independent: each row's tokens are the ones it gets generated alone (its logits
      equal to float32 rounding, the padding never seen).
    max_new_tokens: tokens to generate per row, >= 1.
    temperature: 0 is greedy (argmax, the lowest id on a tie); > 0 samples from
      softmax(logits / temperature).
    top_p: nucleus sampling (temperature > 0): sample among the most likely tokens whose
      probabilities sum to at least top_p, in (0, 1]; 1 keeps every token.
    stop_tokens: ids that end a row at the first of them it generates (it is kept, then the row
      holds PAD); the other rows go on. Generation ends when every row has stopped.
    key: the randomness of sampling, a `jax.random.key` (or a raw uint32 `[2]` key): row b
      draws from the stream `fold_in(key, b)`; or one key per row, `[B]` (raw: `[B, 2]`), row b
      drawing from `key[b]`. A row's draw at step s uses `fold_in(row_key, s)` alone, so its
      tokens depend on its own prompt and row key, never on the other rows: row b of a batch
      generated with keys `ks` is the row generated alone with `ks[b:b + 1]`.
    seed: shorthand for `key=jax.random.key(seed)` (default 0); give key or seed, not both.
    prompt_lengths: valid tokens per row of an array `prompt_tokens`.
    prompt_segment_ids: packed prompts: int `[B, T]` document ids of an array `prompt_tokens`,
      non-decreasing over each row's valid tokens. The prompt is read with no attention across
      documents (positions restart at each) and generation continues each row's last document,
      exactly as if that document alone were the prompt. Needs a model whose `prefill` takes
      `segment_ids` (`pisa_jax.models.Decoder` does).
    prefill_chunk: read the prompts in chunks of this many tokens (>= 1) instead of one pass:
      chunk c (positions c S .. c S + S - 1 of every row) is appended to the cache, its queries
      selecting over everything before it, so the first token and the cache equal one pass's
      (float32 rounding apart) while the activations of one pass are those of S tokens. Needs a
      model with `prefill_chunk` (`pisa_jax.models.Decoder` has it for every attention kind);
      not with prompt_segment_ids. A multiple of the model's block size keeps the
      kernels' tiles whole.
    initial_capacity: tokens per row the cache is first allocated for (default: the longest
      prompt plus max_new_tokens, so it never grows). A smaller one saves memory when every row
      stops early: the cache grows with the longest row, stopped or not, between power-of-two
      buckets, one recompile of the step each.
    return_logits: also return the logits of every step (`Generation.logits`).
    steps_per_call: tokens each jitted call generates, in a loop on the device that ends early
      when every row has stopped (>= 1). A call per token leaves the device idle while the host
      dispatches the next one: generation was host-bound, 2-3 ms a token against ~1 ms of
      kernels (`small`, H200). `generate_stream` yields a call's tokens when the call is done.

  Returns:
    A `Generation`: tokens `[B, S]`, per-row lengths, whether each row stopped (and the logits).
  """
  _check_model(model)
  # Checked once: an iterator is read here, and `stopped` below uses the checked ids.
  stop_tokens = _check_stop_tokens(stop_tokens, model.vocab_size)
  steps = list(generate_stream(
      model, prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
      stop_tokens=stop_tokens, key=key, seed=seed, prompt_lengths=prompt_lengths,
      prompt_segment_ids=prompt_segment_ids, prefill_chunk=prefill_chunk,
      initial_capacity=initial_capacity, return_logits=return_logits,
      steps_per_call=steps_per_call))
  logits = None
  if return_logits:
    steps, logits = zip(*steps)
    logits = np.stack(logits, axis=1)
  tokens = np.stack(steps, axis=1)
  lengths = (tokens != PAD).sum(axis=1).astype(np.int32)
  last = tokens[np.arange(tokens.shape[0]), np.maximum(lengths - 1, 0)]
  stopped = np.isin(last, stop_tokens) & (lengths > 0)
  return Generation(tokens=tokens, lengths=lengths, stopped=stopped, logits=logits)


def generate_stream(model: DecodeModel, prompt_tokens, *, max_new_tokens: int,
                    temperature: float = 0.0, top_p: float = 1.0,
                    stop_tokens: Sequence[int] = (), key=None, seed: int | None = None,
                    prompt_lengths=None, prompt_segment_ids=None,
                    prefill_chunk: int | None = None, initial_capacity: int | None = None,
                    return_logits: bool = False,
                    steps_per_call: int = 16) -> Iterator[np.ndarray]:
  """`generate`, one step at a time: yields each step's new token of every row, int32 `[B]`
  (PAD for a row that stopped before the step), as soon as the jitted call that ran the step
  is done (the prefill's token first, then `steps_per_call` tokens a call); with
  `return_logits`, (tokens, float32 logits `[B, V]`) pairs.

  The arguments are `generate`'s and are checked before the generator is returned (a model
  that refuses chunked prefill for its attention kind raises at the first step). The next
  call is dispatched before this one's tokens are read back, so the device does not wait for
  the host between calls.
  """
  _check_model(model)
  tokens, lengths = _check_prompts(prompt_tokens, prompt_lengths, model.vocab_size)
  segments = _check_segment_ids(prompt_segment_ids, tokens, lengths)
  if segments is not None and "segment_ids" not in inspect.signature(model.prefill).parameters:
    raise TypeError(f"prompt_segment_ids needs a model whose prefill takes segment_ids: "
                    f"{type(model).__name__}.prefill does not")
  _check_options(max_new_tokens, temperature, top_p, initial_capacity, steps_per_call)
  _check_prefill_chunk(prefill_chunk, model, segments)
  row_keys = _row_keys(key, seed, tokens.shape[0])
  stop = _check_stop_tokens(stop_tokens, model.vocab_size)
  return _stream(model, tokens, lengths, segments, max_new_tokens=int(max_new_tokens),
                 temperature=float(temperature), top_p=float(top_p), stop=stop,
                 row_keys=row_keys, prefill_chunk=prefill_chunk,
                 initial_capacity=initial_capacity, return_logits=bool(return_logits),
                 steps_per_call=int(steps_per_call))


def _bucket(num_tokens: int) -> int:
  return bucket_capacity(max(int(num_tokens), MIN_BUCKET), 1)


def _stream(model, tokens: np.ndarray, lengths: np.ndarray, segments: np.ndarray | None, *,
            max_new_tokens: int, temperature: float, top_p: float, stop: np.ndarray, row_keys,
            prefill_chunk: int | None, initial_capacity: int | None, return_logits: bool,
            steps_per_call: int) -> Iterator[np.ndarray]:
  batch, longest = tokens.shape[0], int(lengths.max())
  if prefill_chunk is None:
    width = _bucket(longest)
  else:  # whole chunks: the last one padded like the others; none wider than one pass's width
    prefill_chunk = min(prefill_chunk, _bucket(longest))
    width = -(-longest // prefill_chunk) * prefill_chunk
  padded = np.zeros((batch, width), np.int32)
  cols = min(tokens.shape[1], width)
  padded[:, :cols] = tokens[:, :cols]
  if segments is not None:
    # Padding continues each row's last id: the ids stay non-decreasing.
    segments = np.pad(segments, ((0, 0), (0, max(width - segments.shape[1], 0))), mode="edge")
    segments = jnp.asarray(segments[:, :width])
  # The cache holds every prompt token and each generated token but the last (never fed back).
  needed = longest + max_new_tokens - 1
  capacity = max(_bucket(needed if initial_capacity is None else initial_capacity), width)
  # Stop ids padded with PAD to a multiple of 8: a different number of them compiles nothing new.
  stop = np.pad(stop, (0, max(8, -(-len(stop) // 8) * 8) - len(stop)), constant_values=PAD)
  scalars = (row_keys, jnp.float32(max(temperature, 1e-30)), jnp.float32(top_p),
             jnp.asarray(stop, jnp.int32))
  greedy = temperature == 0.0
  # The model is flattened once: an NNX module's flatten runs in Python (~0.4 ms for 16 layers),
  # a list of arrays in jit's C++ dispatch, and a step's device time at B = 1 is about that.
  model_leaves, model_def = jax.tree.flatten(model)
  if prefill_chunk is None:
    token, done, state, logits = _prefill(model_def, model_leaves, jnp.asarray(padded),
                                          jnp.asarray(lengths), segments, *scalars,
                                          capacity=capacity, greedy=greedy)
  else:
    token, done, state, logits = _chunked_prefill(model, model_def, model_leaves, padded,
                                                  lengths, scalars, chunk=prefill_chunk,
                                                  capacity=capacity, greedy=greedy)
  done_steps = 1  # the prefill's token is step 0

  def dispatch(token, done, state):
    """The next call: steps done_steps .. done_steps + count - 1, the cache grown first."""
    nonlocal capacity
    count = min(steps_per_call, max_new_tokens - done_steps)
    # Step s feeds one more token to every row: the longest then holds longest + s of them.
    needed = longest + done_steps + count - 1
    if needed > capacity:
      capacity = _bucket(needed)
      state = model.grow_decode_state(state, capacity)
    return count, _steps(model_def, model_leaves, token, done, state, np.int32(done_steps),
                         np.int32(count), *scalars, greedy=greedy, chunk=steps_per_call,
                         with_logits=return_logits)

  pending = dispatch(token, done, state) if max_new_tokens > 1 else None
  first = np.asarray(token).astype(np.int32)
  yield (first, np.asarray(logits)) if return_logits else first
  while pending is not None:
    count, (token, done, state, tokens_out, logits_out, ran) = pending
    done_steps += count
    pending = None
    if done_steps < max_new_tokens:
      pending = dispatch(token, done, state)
    # One read-back per call (not a device slice per token).
    tokens_out, ran = np.asarray(tokens_out), int(ran)
    logits_out = np.asarray(logits_out) if return_logits else None
    for i in range(ran):
      yield (tokens_out[i], logits_out[i]) if return_logits else tokens_out[i]
    if ran < count:  # every row has stopped
      return


def _chunked_prefill(model, model_def, model_leaves, padded: np.ndarray, lengths: np.ndarray,
                     scalars, *, chunk: int, capacity: int, greedy: bool):
  """The prefill in chunks of `chunk` tokens: `_prefill`'s (token, done, state, logits).

  Every row's chunk c is its positions c chunk .. c chunk + chunk - 1 (rows whose prompt ended
  before take none), so the rows still reading all hold exactly c chunk tokens, the offset of
  `prefill_chunk`; the offset is traced, so one compiled chunk serves every chunk. The state is
  allocated at `capacity` (>= the padded width) from the start: no copy of a grown cache."""
  batch, width = padded.shape
  del model  # the chunks run on the flattened model
  state = _empty_state(model_def, model_leaves, batch=batch, capacity=capacity)
  logits = None
  for offset in range(0, width, chunk):
    taken = np.clip(lengths - offset, 0, chunk).astype(np.int32)
    chunk_logits, state = _prefill_chunk(model_def, model_leaves,
                                         jnp.asarray(padded[:, offset:offset + chunk]),
                                         jnp.asarray(taken), np.int32(offset), state)
    # A row's last prompt token lies in the last chunk that gave it tokens.
    logits = chunk_logits if logits is None else _where_taken(taken, chunk_logits, logits)
  token, done = _first_token(logits, *scalars, greedy=greedy)
  return token, done, state, logits


@functools.partial(jax.jit, static_argnames=("model_def", "batch", "capacity"))
def _empty_state(model_def, model_leaves, *, batch: int, capacity: int):
  return jax.tree.unflatten(model_def, model_leaves).init_decode_state(batch, capacity)


@functools.partial(jax.jit, static_argnames=("model_def",), donate_argnames=("state",))
def _prefill_chunk(model_def, model_leaves, tokens, lengths, offset, state):
  model = jax.tree.unflatten(model_def, model_leaves)
  logits, state = model.prefill_chunk(tokens, lengths, state, offset)
  return _real_ids(logits, model), state


@jax.jit
def _where_taken(taken, chunk_logits, logits):
  return jnp.where((taken > 0)[:, None], chunk_logits, logits)


@functools.partial(jax.jit, static_argnames=("greedy",))
def _first_token(logits, row_keys, temperature, top_p, stop, *, greedy: bool):
  token = _sample(logits, row_keys, 0, temperature, top_p, greedy=greedy)
  return token, jnp.isin(token, stop)


@functools.partial(jax.jit, static_argnames=("model_def", "capacity", "greedy"))
def _prefill(model_def, model_leaves, tokens, lengths, segments, row_keys, temperature, top_p,
             stop, *, capacity: int, greedy: bool):
  model = jax.tree.unflatten(model_def, model_leaves)
  state = model.init_decode_state(tokens.shape[0], capacity)
  if segments is None:
    logits, state = model.prefill(tokens, lengths, state)
  else:
    logits, state = model.prefill(tokens, lengths, state, segment_ids=segments)
  logits = _real_ids(logits, model)
  token = _sample(logits, row_keys, 0, temperature, top_p, greedy=greedy)
  return token, jnp.isin(token, stop), state, logits


@functools.partial(jax.jit, static_argnames=("model_def", "greedy", "chunk", "with_logits"),
                   donate_argnames=("state",))
def _steps(model_def, model_leaves, token, done, state, first, count, row_keys, temperature,
           top_p, stop, *, greedy: bool, chunk: int, with_logits: bool):
  """Steps first .. first + count - 1 (count <= chunk) in one loop on the device, which ends
  early once every row has stopped. Returns the last token, done flags and state, the steps'
  tokens int32 `[chunk, B]` (PAD for a row stopped before the step, and past the last step run),
  their logits `[chunk, B, V]` (with_logits; else None) and the number of steps run."""
  model = jax.tree.unflatten(model_def, model_leaves)
  batch = token.shape[0]

  def one(i, token, done, state):
    logits, state = model.decode(token, state)
    logits = _real_ids(logits, model)
    new = _sample(logits, row_keys, first + i, temperature, top_p, greedy=greedy)
    # A stopped row keeps feeding its stop token: its cache advances with the batch, unread.
    new = jnp.where(done, token, new)
    return new, done | jnp.isin(new, stop), state, logits

  def body(carry):
    i, token, done, state, tokens_out, logits_out = carry
    new, new_done, state, logits = one(i, token, done, state)
    tokens_out = tokens_out.at[i].set(jnp.where(done, PAD, new))
    if with_logits:
      logits_out = logits_out.at[i].set(logits)
    return i + 1, new, new_done, state, tokens_out, logits_out

  def more(carry):
    return (carry[0] < count) & ~jnp.all(carry[2])

  logits_out = None
  if with_logits:  # the logits' width, from an abstract trace of one step
    vocab = jax.eval_shape(lambda: one(0, token, done, state)[3]).shape[-1]
    logits_out = jnp.zeros((chunk, batch, vocab), jnp.float32)
  carry = (jnp.int32(0), token, done, state, jnp.full((chunk, batch), PAD, jnp.int32),
           logits_out)
  ran, token, done, state, tokens_out, logits_out = jax.lax.while_loop(more, body, carry)
  return token, done, state, tokens_out, logits_out, ran


def _real_ids(logits, model):
  """The logits of the model's `vocab_size` ids: a table padded past them (the decoder's rows
  of 64) is never sampled, whatever the temperature, nor returned."""
  return logits[..., :model.vocab_size]


def _sample(logits: Float[Array, "B V"], row_keys, step, temperature, top_p, *,
            greedy: bool) -> Int[Array, "B"]:
  """The next token of each row: argmax, or a draw from the tempered nucleus distribution with
  key fold_in(row_keys[b], step) (one typed key per row, `[B]`), so that a row's draw depends on
  its own key and logits alone. temperature and top_p are traced: changing them compiles nothing
  new."""
  logits = logits.astype(jnp.float32)
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  # Keep the most likely tokens up to the first whose cumulative probability reaches top_p (that
  # one included, so at least one token survives); ties with the last one kept stay too. With
  # top_p = 1 every token stays, even where the float32 sum reaches 1 before the last of them.
  ordered = jnp.sort(logits, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(ordered, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  keep = (before < top_p) | (top_p >= 1.0)
  threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
  logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def _row_keys(key, seed, batch: int):
  """One typed PRNG key per row, `[B]`, from `generate`'s key or seed."""
  if key is not None and seed is not None:
    raise ValueError(f"give key= or seed=, not both (got key and seed={seed!r})")
  if key is None:
    if seed is not None and not _is_int(seed):
      raise ValueError(f"seed={seed!r} must be an int")
    key = jax.random.key(0 if seed is None else int(seed))
  typed = key
  if (isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.ndim in (1, 2)
      and key.shape[-1] == 2):
    typed = jax.random.wrap_key_data(jnp.asarray(key))  # a raw key, `[2]` or `[B, 2]`
  if (not isinstance(typed, jax.Array) or not jax.dtypes.issubdtype(typed.dtype,
                                                                     jax.dtypes.prng_key)
      or typed.shape not in ((), (batch,))):
    raise ValueError(f"key must be one jax.random.key (or a raw uint32 [2] key) or one per row "
                     f"[B] = [{batch}] (raw: [{batch}, 2]), got "
                     f"{getattr(key, 'dtype', type(key).__name__)} "
                     f"{tuple(getattr(key, 'shape', ()))}")
  if typed.shape == ():
    typed = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(typed, jnp.arange(batch))
  return typed


# ----------------------------------------------------------------------------- argument checks


def _check_model(model) -> None:
  missing = [name for name in ("vocab_size", "init_decode_state", "grow_decode_state",
                               "prefill", "decode") if not hasattr(model, name)]
  if missing:
    raise TypeError(f"model must implement pisa_jax.generation.DecodeModel: "
                    f"{type(model).__name__} has no {', '.join(missing)}")
  leaves = jax.tree.leaves(model)
  if len(leaves) == 1 and leaves[0] is model:
    raise TypeError(f"model must be a pytree (an NNX module is one): {type(model).__name__} is "
                    "passed to jax.jit as an argument")


def _check_prompts(prompt_tokens, prompt_lengths, vocab_size: int):
  """int32 `[B, T]` right-padded prompts and int32 `[B]` lengths, each row checked."""
  if isinstance(prompt_tokens, (list, tuple)):
    if prompt_lengths is not None:
      raise ValueError("prompt_lengths goes with an array prompt_tokens [B, T]; a list of "
                       "sequences carries its own lengths")
    if not prompt_tokens:
      raise ValueError("prompt_tokens is empty: give at least one prompt")
    rows = []
    for i, row in enumerate(prompt_tokens):
      if _is_int(row):
        raise ValueError("prompt_tokens must be a list of token sequences, got a list of ints: "
                         "wrap a single prompt in a list, [[t0, t1, ...]]")
      arr = np.asarray(row)
      if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"prompt_tokens[{i}] must be a sequence of ints, got "
                         f"{arr.dtype} of shape {arr.shape}")
      rows.append(arr.astype(np.int64))
    lengths = np.array([len(r) for r in rows], np.int64)
    tokens = np.zeros((len(rows), int(lengths.max())), np.int64)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
  else:
    tokens = np.asarray(prompt_tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"prompt_tokens must be a list of token sequences or an int array [B, T], "
                       f"got {tokens.dtype} of shape {tokens.shape}")
    if tokens.shape[0] == 0:
      raise ValueError("prompt_tokens is empty: give at least one prompt")
    if prompt_lengths is None:
      lengths = np.full(tokens.shape[0], tokens.shape[1], np.int64)
    else:
      lengths = np.asarray(prompt_lengths)
      if lengths.shape != (tokens.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be ints [B] = [{tokens.shape[0]}], got "
                         f"{lengths.dtype} of shape {lengths.shape}")
      if (lengths > tokens.shape[1]).any():
        raise ValueError(f"prompt_lengths={lengths.tolist()} must be <= prompt_tokens.shape[1]="
                         f"{tokens.shape[1]}")
  empty = np.flatnonzero(lengths < 1)
  if empty.size:
    raise ValueError(f"prompt_tokens[{int(empty[0])}] is empty: every prompt needs at least one "
                     "token")
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= vocab_size))
  if bad.any():
    b, t = map(int, np.argwhere(bad)[0])
    raise ValueError(f"prompt_tokens[{b}][{t}]={int(tokens[b, t])} is not a token id of the "
                     f"model: ids lie in [0, {vocab_size})")
  return np.where(valid, tokens, 0).astype(np.int32), lengths.astype(np.int32)


def _check_segment_ids(prompt_segment_ids, tokens: np.ndarray,
                      lengths: np.ndarray) -> np.ndarray | None:
  """int32 `[B, T]` ids, non-decreasing over each row's valid tokens and continuing its last
  valid id past them; None without packing."""
  if prompt_segment_ids is None:
    return None
  ids = np.asarray(prompt_segment_ids)
  if ids.shape != tokens.shape or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt_segment_ids must be ints [B, T] = {list(tokens.shape)} (the "
                     f"prompt array's shape), got {ids.dtype} of shape {ids.shape}")
  last = ids[np.arange(ids.shape[0]), lengths - 1]
  ids = np.where(np.arange(ids.shape[1])[None, :] < lengths[:, None], ids, last[:, None])
  bad = np.argwhere(ids[:, 1:] < ids[:, :-1])
  if bad.size:
    b, t = map(int, bad[0])
    raise ValueError(f"prompt_segment_ids must be non-decreasing within each prompt: row {b} "
                     f"goes from {ids[b, t]} to {ids[b, t + 1]} at t={t + 1}")
  return ids.astype(np.int32)


def _check_options(max_new_tokens, temperature, top_p, initial_capacity,
                   steps_per_call) -> None:
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
  if (isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number))
      or not math.isfinite(temperature) or temperature < 0):
    raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
  if (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.number))
      or not 0 < top_p <= 1):
    raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (1: no nucleus truncation)")
  if initial_capacity is not None and (not _is_int(initial_capacity) or initial_capacity < 1):
    raise ValueError(f"initial_capacity={initial_capacity!r} must be an int >= 1 or None")
  if not _is_int(steps_per_call) or steps_per_call < 1:
    raise ValueError(f"steps_per_call={steps_per_call!r} must be an int >= 1")


def _check_prefill_chunk(prefill_chunk, model, segments) -> None:
  if prefill_chunk is None:
    return
  if not _is_int(prefill_chunk) or prefill_chunk < 1:
    raise ValueError(f"prefill_chunk={prefill_chunk!r} must be an int >= 1 (tokens a chunk) or "
                     "None (one pass)")
  if segments is not None:
    raise ValueError("prefill_chunk reads one document per row: it does not take "
                     "prompt_segment_ids")
  if not callable(getattr(model, "prefill_chunk", None)):
    raise TypeError(f"prefill_chunk needs a model with a prefill_chunk method (DecodeModel): "
                    f"{type(model).__name__} has none")


def _check_stop_tokens(stop_tokens, vocab_size: int) -> np.ndarray:
  if _is_int(stop_tokens) or isinstance(stop_tokens, (str, bytes)):
    raise ValueError(f"stop_tokens={stop_tokens!r} must be a sequence of token ids, e.g. (50256,)")
  stop = list(stop_tokens)
  for t in stop:
    if not _is_int(t) or not 0 <= t < vocab_size:
      raise ValueError(f"stop_tokens={stop!r}: {t!r} is not a token id of the model, ids lie in "
                       f"[0, {vocab_size})")
  return np.asarray(stop, np.int32).reshape(-1)
