"""The SimpleNet harness for two Flax models: a ResNet-style CNN with BatchNorm and a small
Transformer language model, each wrapped by ``mpjax.flax.wrap`` at every level.

    python benchmarks/models.py --model resnet
    python benchmarks/models.py --model transformer --size medium
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402


class ResBlock(nn.Module):
    width: int
    dtype: Any = None  # None: float32; a half dtype is the hand-written half model

    @nn.compact
    def __call__(self, x, train: bool):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, dtype=self.dtype)
        y = conv(self.width, (3, 3))(x)
        y = nn.relu(norm()(y))
        y = conv(self.width, (3, 3))(y)
        y = norm()(y)
        if x.shape[-1] != self.width:
            x = conv(self.width, (1, 1))(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    widths: tuple[int, ...]
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        if self.dtype is not None:
            x = x.astype(self.dtype)
        for i, w in enumerate(self.widths):
            x = ResBlock(w, self.dtype)(x, train)
            if i < len(self.widths) - 1:
                x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


class BNCNN(nn.Module):
    """A plain CNN with BatchNorm in training mode, tuned for no benchmark: stages of two
    bias-free 3x3 convolutions, each followed by BatchNorm and ReLU, a global mean pool and a
    Dense head."""

    widths: tuple[int, ...]
    classes: int = 100
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        if self.dtype is not None:
            x = x.astype(self.dtype)
        for w in self.widths:
            for _ in range(2):
                x = nn.Conv(w, (3, 3), use_bias=False, dtype=self.dtype)(x)
                x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
                x = nn.relu(x)
        return nn.Dense(self.classes, dtype=self.dtype)(x.mean(axis=(1, 2)))


def cudnn_causal_attention(query, key, value, mask=None, **kwargs):
    """A Flax ``attention_fn``: cuDNN's fused flash attention (``jax.nn.dot_product_attention``
    with ``implementation="cudnn"``), causal. The language models' mask is causal, so it is
    not passed (cuDNN would add it as a bias)."""
    del mask, kwargs
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")


class Block(nn.Module):
    """A pre-norm Transformer block: self-attention, optional cross-attention, an MLP."""

    width: int
    heads: int
    dtype: Any = None
    attention_fn: Any = None  # None: Flax's own (XLA's attention)

    @nn.compact
    def __call__(self, x, mask=None, memory=None, memory_mask=None):
        own = {} if self.attention_fn is None else {"attention_fn": self.attention_fn}
        attention = functools.partial(
            nn.MultiHeadDotProductAttention, num_heads=self.heads, dtype=self.dtype, **own
        )
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + attention()(h, h, mask=mask)
        if memory is not None:
            h = nn.LayerNorm(dtype=self.dtype)(x)
            x = x + attention()(h, memory, mask=memory_mask)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype)(h))
        return x + nn.Dense(self.width, dtype=self.dtype)(h)


class _Transformer(nn.Module):
    """The settings a Transformer of this file takes."""

    vocab: int
    width: int
    depth: int
    heads: int
    dtype: Any = None
    attention_fn: Any = None  # the blocks' (see Block)

    def positions(self, length):
        """The learned position table (a float32 param, cast to ``dtype`` if set)."""
        pos = self.param("pos", nn.initializers.normal(0.02), (length, self.width))
        return pos if self.dtype is None else pos.astype(self.dtype)


class TransformerLM(_Transformer):
    @nn.compact
    def __call__(self, tokens, train: bool = True):
        del train
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        x = x + self.positions(tokens.shape[1])
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(self.width, self.heads, self.dtype, self.attention_fn)(x, mask)
        return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


class EncoderDecoder(_Transformer):
    """A translation Transformer (as Flax's WMT example): the encoder reads the source, the
    decoder the shifted target with causal self-attention and cross-attention to the encoder."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        del train
        source, target = tokens[:, 0], tokens[:, 1]
        embed = nn.Embed(self.vocab, self.width, dtype=self.dtype)  # shared, as in WMT
        pad = nn.make_attention_mask(source > 0, source > 0)
        pos = self.positions(source.shape[1])
        x = embed(source) + pos
        for _ in range(self.depth):
            x = Block(self.width, self.heads, self.dtype)(x, pad)
        memory = nn.LayerNorm(dtype=self.dtype)(x)
        shifted = jnp.pad(target, ((0, 0), (1, 0)))[:, :-1]
        y = embed(shifted) + pos
        causal = nn.make_causal_mask(shifted)
        cross = nn.make_attention_mask(shifted >= 0, source > 0)
        for _ in range(self.depth):
            y = Block(self.width, self.heads, self.dtype)(y, causal, memory, cross)
        return embed.attend(nn.LayerNorm(dtype=self.dtype)(y))


class LSTMTagger(nn.Module):
    """Two stacked LSTM layers (scanned with ``nn.RNN``) tagging every token."""

    vocab: int
    width: int
    tags: int
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        del train
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        for _ in range(2):
            x = nn.RNN(nn.OptimizedLSTMCell(self.width, dtype=self.dtype))(x)
        return nn.Dense(self.tags, dtype=self.dtype)(x)


SIZES = {
    "resnet": {
        "tiny": ((8, 16), 4, 8),
        "small": ((32, 64), 32, 32),
        "medium": ((64, 128, 256), 64, 32),
        "gpu": ((128, 256, 512), 256, 32),
    },
    "transformer": {
        "tiny": (32, 1, 2, 16, 4),
        "small": (256, 4, 4, 64, 16),
        "medium": (512, 6, 8, 128, 32),
        "gpu": (2048, 8, 16, 1024, 8),
    },
}


def build(kind: str, size: str):
    if kind == "resnet":
        widths, batch, hw = SIZES[kind][size]
        model = ResNet(widths)
        x = jax.random.normal(jax.random.key(1), (batch, hw, hw, 3))
        y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
        convs = [(3 if i == 0 else w, w) for i, w in enumerate(widths)]
        flops = 0
        for i, (cin, cout) in enumerate(convs):  # two 3x3 convs per block (+1x1), forward x3
            side = hw // 2**i
            flops += 2 * batch * side * side * 9 * (cin * cout + cout * cout) * 3
        return model, x, y, flops
    width, depth, heads, seq, batch = SIZES[kind][size]
    vocab = 1024
    model = TransformerLM(vocab, width, depth, heads)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    flops = 3 * 2 * batch * seq * (depth * 12 * width * width + vocab * width)
    flops += 3 * 2 * batch * depth * 2 * seq * seq * width  # attention scores and values
    return model, tokens, jnp.roll(tokens, -1, axis=1), flops


HAND_BF16 = "hand-written bfloat16 (dtype=)"
FP8 = "FP8 (O2 bfloat16 base)"
FP8_CURRENT = "FP8 current (O2 bfloat16 base)"
FP8_ROWS = "FP8 current rows (O2 bfloat16 base)"


def loss_and_stats(model, precision, p, stats, x, y):
    """The mean cross-entropy (float32) and the new batch stats."""
    with jax.default_matmul_precision(precision):
        if stats:
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            new_stats = new["batch_stats"]
        else:
            logits, new_stats = model.apply({"params": p}, x), stats
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return loss.mean(), new_stats


def handwritten_step(module, x, y, dtype=jnp.bfloat16):
    """What a Flax user writes by hand: the module with ``dtype=`` (float32 params), Adam."""
    model = module.clone(dtype=dtype)
    variables = model.init(jax.random.key(0), x)
    params, stats = variables["params"], variables.get("batch_stats", {})
    tx = optax.adam(1e-3)

    def step(params, stats, opt_state):
        fn = functools.partial(loss_and_stats, model, "default")
        grads, new_stats = jax.grad(fn, has_aux=True)(params, stats, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state

    return jax.jit(step, donate_argnums=(0, 1, 2)), (params, stats, tx.init(params))


def fp8_step(module, x, y, current=None):
    """The FP8 policy over the float32 module, base O2 bfloat16, Adam: delayed scaling, or
    current scaling at granularity `current` ("tensor" or "row")."""
    import mpjax.fp8

    recipe = None if current is None else mpjax.fp8.CurrentScaling(granularity=current)
    policy = mpjax.fp8.policy("O2", recipe=recipe)
    variables = module.init(jax.random.key(0), x)
    params, stats = variables["params"], variables.get("batch_stats", {})
    fn = functools.partial(loss_and_stats, module, "default")
    fp8_state = mpjax.fp8.init(fn, policy, params, stats, x, y)
    tx = optax.adam(1e-3)
    grad = mpjax.fp8.scaled_value_and_grad(fn, policy, has_aux=True)

    def step(params, stats, opt_state, fp8_state):
        (_, new_stats), grads, fp8_state = grad(fp8_state, params, stats, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, fp8_state

    state = (params, stats, tx.init(params), fp8_state)
    return jax.jit(step, donate_argnums=(0, 1, 2, 3)), state


def make_step(kind: str, module, variant, x, y):
    if variant == HAND_BF16:
        return handwritten_step(module, x, y)
    if variant == FP8:
        return fp8_step(module, x, y)
    if variant in (FP8_CURRENT, FP8_ROWS):
        return fp8_step(module, x, y, current="row" if variant == FP8_ROWS else "tensor")
    if isinstance(variant, str):
        policy, precision = mpjax.Policy.from_level("O0"), variant
    else:
        policy, precision = variant, "default"
    model = mpjax.flax.wrap(module, policy)
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    stats = variables.get("batch_stats", {})
    # float16 params (O3) keep Adam's moments in float16, where the default eps=1e-8 is 0.
    eps = 1e-4 if policy.param_dtype == jnp.float16 else 1e-8
    tx = mpjax.loss_scale(optax.adam(1e-3, eps=eps), scale=policy.loss_scale())

    def step(params, stats, opt_state):
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            loss, new_stats = loss_and_stats(model, precision, p, stats, x, y)
            return scale.scale(loss), new_stats

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state

    return jax.jit(step, donate_argnums=(0, 1, 2)), (params, stats, tx.init(params))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=SIZES, default="resnet")
    parser.add_argument("--size", choices=["tiny", "small", "medium", "gpu"], default="small")
    parser.add_argument(
        "--variants",
        help="comma-separated variant names to run (default: every level, the hand-written "
        "bfloat16 step, and FP8's three recipes on a GPU); O0 default and O2 float16 (no "
        "scaling) always run",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    module, x, y, flops = build(args.model, args.size)
    variants, states, memory = {}, {}, {}
    gpu = jax.default_backend() == "gpu"
    chosen = harness.level_variants() + [(HAND_BF16, HAND_BF16)]
    if gpu:  # on a CPU, FP8 dots are emulated: only a GPU says what they buy
        chosen += [(FP8, FP8), (FP8_CURRENT, FP8_CURRENT), (FP8_ROWS, FP8_ROWS)]
    if args.variants:
        keep = set(args.variants.split(",")) | {"O0 default", "O2 float16", "O2 float16 no scaling"}
        chosen = [(n, v) for n, v in chosen if n in keep]
    for name, variant in chosen:
        step, state = make_step(args.model, module, variant, x, y)
        step, memory[name] = harness.compile_once(step, *state)
        states[name] = step(*state)
        harness.block(states[name])

        def run(name=name, step=step):
            for _ in range(args.steps):
                states[name] = step(*states[name])
            return states[name]

        variants[name] = run
    times = harness.interleave(variants, args.rounds)
    times = {k: [t / args.steps for t in v] for k, v in times.items()}
    peak = harness.matmul_peak_tflops(jnp.bfloat16 if gpu else jnp.float32, 8192 if gpu else 1024)
    label = f"measured {'bf16' if gpu else 'f32'} matmul peak ({peak:.2f} TFLOP/s)"
    rows, text = harness.report(
        f"{args.model} ({args.size})", times, flops, memory, "O0 default", peak, label
    )
    overhead = harness.paired_ratio(times, "O2 float16", "O2 float16 no scaling") - 1
    limit = 0.01 if gpu else 0.03
    targets = [[f"loss-scale overhead <= {100 * limit:.0f}%", "yes" if overhead <= limit else "NO",
                f"{100 * overhead:+.1f}%"]]  # fmt: skip
    if HAND_BF16 in times and "O2 bfloat16" in times:
        r = harness.paired_ratio(times, "O2 bfloat16", HAND_BF16)
        targets.append(["mpjax O2 bf16 within 1.03x of the hand-written bf16 step",
                        "yes" if r <= 1.03 else "NO", f"{r:.3f}"])  # fmt: skip
    if FP8 in times and "O2 bfloat16" in times:
        speed = 1 / harness.paired_ratio(times, FP8, "O2 bfloat16")
        targets.append(["FP8 >= 1.3x faster than O2 bf16", "yes" if speed >= 1.3 else "NO",
                        f"{speed:.2f}x"])  # fmt: skip
    target = harness.table(["target", "met", "measured"], targets)
    info = harness.machine()
    print(f"{info['device']} ({info['backend']}), jax {info['jax']}\n")
    print(text + "\n\n" + target)
    result = {
        "benchmark": args.model,
        "machine": info,
        "config": vars(args),
        "flops_per_step": flops,
        "peak_tflops": peak,
        "rows": rows,
        "loss_scale_overhead": overhead,
        "markdown": text + "\n\n" + target,
    }
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
