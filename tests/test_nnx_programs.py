"""NNX programs written the way Flax's examples and guides write them, each run under
``mpjax.flax.wrap`` against its float32 program: state that changes during a call (a Variable
created in ``__call__`` and popped by the loss, as the NNX VAE example does), intermediates
sown into an ``nnx.List`` of layers and collected with ``nnx.capture`` (Gemma's train step),
decoding with a KV cache (Gemma's sampler), and PRNG keys closed over by a function under
``mpjax.autocast``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err
from flax import nnx

import mpjax
import mpjax.flax

O2 = mpjax.Policy.from_level("O2", "bfloat16")


# -- a Variable created during the call, popped by the loss (flax/examples/nnx_toy_examples) --


class Loss(nnx.Variable):
    pass


class VAE(nnx.Module):
    """Encoder, reparameterised latent, decoder; the KL term is stored as a Variable made in
    ``__call__``, as the NNX VAE example does, for the loss to ``nnx.pop``."""

    def __init__(self, rngs):
        self.encoder = nnx.Linear(16, 2 * 4, rngs=rngs)
        self.decoder = nnx.Linear(4, 16, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        mean, logvar = jnp.split(self.encoder(x), 2, axis=-1)
        std = jnp.exp(0.5 * logvar)
        z = mean + std * jax.random.normal(self.rngs.noise(), mean.shape)
        self.kl_loss = Loss(jnp.mean(0.5 * (mean**2 + std**2 - 1.0 - logvar)))
        return self.decoder(z)


def _vae_step(model, optimizer, x):
    def loss_fn(model):
        y = model(x)
        (kl,) = jax.tree.leaves(nnx.pop(model, Loss))
        return jnp.mean((y.astype(jnp.float32) - x) ** 2) + 0.1 * kl

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_variable_made_during_the_call_comes_back_and_is_popped(jit):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    losses = {}
    for name in ("float32", "O2"):
        model = VAE(nnx.Rngs(0, noise=1))
        if name == "O2":
            model = mpjax.flax.wrap(model, O2)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = nnx.jit(_vae_step) if jit else _vae_step
        losses[name] = [float(step(model, optimizer, x)) for _ in range(3)]
        # The loss popped it: the model holds no Loss between steps, as without mpjax.
        assert not jax.tree.leaves(nnx.state(model, Loss))
    assert np.allclose(losses["O2"], losses["float32"], rtol=0.03), losses
    assert losses["O2"][-1] < losses["O2"][0]


class Cache(nnx.Variable):
    pass


class Replacing(nnx.Module):
    """Replaces one Variable with a new shape and removes another during the call."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.cache = Cache(jnp.zeros((1, 4)))
        self.scratch = Cache(jnp.zeros(()))

    def __call__(self, x):
        y = self.lin(x)
        self.cache = Cache(jnp.concatenate([self.cache[...], y.astype(jnp.float32)]))
        del self.scratch
        return y


def test_variables_replaced_and_removed_during_the_call():
    model = mpjax.flax.wrap(Replacing(nnx.Rngs(0)), O2)
    plain = Replacing(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    model(x)
    plain(x)
    assert model.inner.cache[...].shape == plain.cache[...].shape == (3, 4)
    assert model.inner.cache[...].dtype == jnp.float32
    assert not hasattr(model.inner, "scratch") and not hasattr(plain, "scratch")
    assert rel_err(model.inner.cache[...], plain.cache[...]) < 0.02


# -- sown intermediates in an nnx.List of layers, collected with nnx.capture (Gemma) ----------


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(16, rngs=rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = self.mlp(self.norm(x))
        self.sow(nnx.Intermediate, "activations", h)
        return x + nnx.gelu(h)


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(3)])
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.skipif(not hasattr(nnx, "capture"), reason="nnx.capture is Flax >= 0.12")
def test_capture_of_sown_intermediates_in_an_nnx_list():
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 32)
    plain = Decoder(nnx.Rngs(0))
    model = mpjax.flax.wrap(Decoder(nnx.Rngs(0)), O2)
    ref_out, ref = nnx.capture(plain, nnx.Intermediate)(tokens)
    out, got = nnx.capture(model, nnx.Intermediate)(tokens)
    ref_leaves = jax.tree.leaves(ref)
    got_leaves = jax.tree.leaves(got)
    assert len(got_leaves) == len(ref_leaves) == 3
    for g, r in zip(got_leaves, ref_leaves):
        assert g.shape == r.shape
        assert rel_err(g.astype(jnp.float32), r) < 0.03
    assert rel_err(out.astype(jnp.float32), ref_out) < 0.03


# -- a Gemma-style decoder sampling with a KV cache (flax/examples/gemma's sampler) -----------


class DecoderBlock(nnx.Module):
    def __init__(self, width, heads, rngs):
        self.pre_attention = nnx.RMSNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=True, rngs=rngs)
        self.pre_mlp = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.pre_attention(x))
        return x + self.down(nnx.gelu(self.up(self.pre_mlp(x))))


class CachedDecoder(nnx.Module):
    """Embedding scaled by sqrt(width), RMSNorm blocks with cached attention, tied logits."""

    def __init__(self, rngs, vocab=64, width=32, heads=4, depth=2):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        layers = [DecoderBlock(width, heads, rngs) for _ in range(depth)]
        self.layers = nnx.List(layers) if hasattr(nnx, "List") else layers  # Flax 0.11: a list
        self.norm = nnx.RMSNorm(width, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) * jnp.sqrt(jnp.float32(self.embed.features))
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.norm(x))

    def init_cache(self, batch, length):
        for layer in self.layers:
            layer.attention.init_cache((batch, length, self.embed.features))


def test_decoding_with_a_kv_cache_matches_float32_and_traces_once():
    """Greedy decoding, a token per call: each step's logits are the float32 model's to
    bfloat16's rounding, the cache (keys, values, index) advances as it does without mpjax
    and stays in the model's float32, and the steps after the first reuse its trace."""
    model_calls = []

    class Counted(CachedDecoder):  # counts the traces (NNX copies a list attribute)
        def __call__(self, tokens):
            model_calls.append(None)
            return super().__call__(tokens)

    plain = CachedDecoder(nnx.Rngs(0))
    plain.init_cache(2, 8)
    inner = Counted(nnx.Rngs(0))
    inner.init_cache(2, 8)
    model = mpjax.flax.wrap(inner, O2)
    token = jnp.array([[1], [2]])
    for _ in range(6):
        ref, out = plain(token), model(token)
        assert out.dtype == jnp.float32
        assert rel_err(out, ref) < 0.03
        token = jnp.argmax(ref[:, -1:], axis=-1)
    assert len(model_calls) == 1
    for got, want in zip(model.inner.layers, plain.layers):
        a, b = got.attention, want.attention
        assert int(a.cache_index[...]) == int(b.cache_index[...]) == 6
        assert a.cached_key[...].dtype == b.cached_key[...].dtype == jnp.float32
        assert rel_err(a.cached_value[...], b.cached_value[...]) < 0.03


# -- PRNG keys: constants, arguments and closed-over values are left alone ---------------------

KEY = jax.random.key(0)
RAW_KEY = jax.random.PRNGKey(0)
SAMPLERS = {
    "closed typed key": lambda x: jax.random.normal(KEY, (64,)) + 0 * x.sum(),
    "closed raw key": lambda x: jax.random.normal(RAW_KEY, (64,)) + 0 * x.sum(),
    "split": lambda x: jax.random.uniform(jax.random.split(KEY)[1], (64,)) + 0 * x.sum(),
    "fold_in": lambda x: jax.random.normal(jax.random.fold_in(KEY, 7), (64,)) + 0 * x.sum(),
    "key made inside": lambda x: jax.random.normal(jax.random.key(3), (64,)) + 0 * x.sum(),
    "jit inside": lambda x: jax.jit(lambda k: jax.random.normal(k, (64,)))(KEY) + 0 * x.sum(),
    "scan carry": lambda x: (
        jax.lax.scan(
            lambda k, _: (jax.random.split(k)[0], jax.random.uniform(k)), KEY, None, length=64
        )[1]
        + 0 * x.sum()
    ),
    "dropout mask": lambda x: jnp.where(jax.random.bernoulli(KEY, 0.5, (64,)), x.sum(), 0.0),
}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_keys_closed_over_give_the_same_random_numbers(name, level):
    f = SAMPLERS[name]
    x = jnp.ones(4)
    policy = mpjax.Policy.from_level(level, "bfloat16")
    expected = f(x)
    np.testing.assert_array_equal(np.asarray(mpjax.autocast(f, policy)(x)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(mpjax.autocast(f, policy))(x)), expected)


def test_keys_as_arguments_pass_through():
    f = lambda k, x: (k, jax.random.normal(k, x.shape) + 0 * x.sum())  # noqa: E731
    for key in (KEY, RAW_KEY):
        k, y = mpjax.autocast(f, O2)(key, jnp.ones(8))
        np.testing.assert_array_equal(np.asarray(y), f(key, jnp.ones(8))[1])
        assert k.dtype == key.dtype
