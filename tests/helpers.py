"""Shared fixtures: a tiny model with varied (non-degenerate) random weights."""
import jax
import jax.numpy as jnp

from jaxrl_cache.models.llama import ModelConfig, forward, init_params
from jaxrl_cache.distribution import behavior_log_probs

CONFIG = ModelConfig.tiny(vocab_size=48, max_seq_len=96)


def scale_matrices(params, factor: float):
    """params with every weight matrix (not norms or biases) multiplied by factor. Layer
    leaves are stacked [n_layers, ...], so their matrices are 3-D."""
    layers = {name: x * factor if x.ndim == 3 else x for name, x in params["layers"].items()}
    top = {name: x * factor if x.ndim == 2 else x for name, x in params.items() if name != "layers"}
    return {**top, "layers": layers}


def varied_params(seed: int, config: ModelConfig = CONFIG):
    """Random params scaled up so greedy decoding does not collapse to one token."""
    return scale_matrices(init_params(config, jax.random.key(seed)), 12.0)


def prefix_presence(tokens, vocab: int):
    """tokens int32 [N, L] -> bool [N, L, V]: the tokens at positions <= t of each row (the
    repetition penalty's context at t), by a cumulative max of one-hots."""
    return jax.lax.cummax(jax.nn.one_hot(tokens, vocab, dtype=jnp.int32), axis=1) > 0


def teacher_forced_log_probs(params, config, tokens, temperature, top_p, top_k, min_p=0.0,
                             repetition_penalty=1.0):
    """The dense reference: tokens int32 [N, L] -> f32 [N, L-1], the log-prob of token t+1
    from the full [N, L, V] logits and the sampler's own distribution (what rl.logprobs
    computes chunked), its repetition penalty on each prefix's tokens."""
    presence = prefix_presence(tokens[:, :-1], config.vocab_size)
    logp = behavior_log_probs(forward(params, config, tokens)[:, :-1], temperature, top_p,
                              top_k, min_p, repetition_penalty, presence)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


_dense_forward = jax.jit(forward, static_argnums=1)
_teacher_forced = jax.jit(teacher_forced_log_probs, static_argnums=1)


def dense_logits(params, config, seq):
    """Dense forward of one sequence, padded to max_seq_len (causal: padding is invisible)."""
    padded = jnp.zeros((1, config.max_seq_len), jnp.int32).at[0, :len(seq)].set(
        jnp.asarray(seq, jnp.int32))
    return _dense_forward(params, config, padded)[0, :len(seq)]


def dense_greedy(params, config, prompt, steps):
    """Reference: greedy decoding with the dense forward. Returns (tokens, log-softmax at them)."""
    seq, logps = list(prompt), []
    for _ in range(steps):
        logits = dense_logits(params, config, seq)[-1]
        tok = int(jnp.argmax(logits))
        logps.append(float(jax.nn.log_softmax(logits)[tok]))
        seq.append(tok)
    return seq[len(prompt):], logps


def own_version_logprobs(sample, params_by_version, sampling, config: ModelConfig = CONFIG):
    """f32 [T]: each output token's logprob under params_by_version[its token version], with
    the whole context teacher-forced (the sampling distribution of `sampling`)."""
    import numpy as np
    seq = list(sample.prompt_ids + sample.output_ids)
    padded = jnp.zeros((1, config.max_seq_len), jnp.int32).at[0, :len(seq)].set(
        jnp.asarray(seq, jnp.int32))  # causal: the padding is invisible
    p, t = len(sample.prompt_ids), len(sample.output_ids)
    out = np.zeros(t, np.float32)
    for v in np.unique(sample.token_versions):
        logp = np.asarray(_teacher_forced(params_by_version[int(v)], config, padded,
                                          **sampling.as_arrays()))[0, p - 1:p - 1 + t]
        mask = sample.token_versions == v
        out[mask] = logp[mask]
    return out


# Holds a directory's lock the way jaxrl_cache.dir_lock does (flock on .jaxrl_cache.lock, its
# pid inside) without this library: the independent holder of the lock tests.
LOCK_HOLDER = """
import fcntl, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(os.path.join(sys.argv[1], ".jaxrl_cache.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
sys.stdin.readline()
"""


def hold_lock(directory):
    """A process holding `directory`'s lock (started, and holding it, on return); kill it to
    let go, as a crash would."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(directory)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"held\n"
    return proc


def cli_error(argv, capsys) -> str:
    """The one stderr line of a `jaxrl-cache` run refused with status 2 (argparse's
    SystemExit or a returned 2): no traceback, nothing after the line."""
    from jaxrl_cache.app import cli
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err
