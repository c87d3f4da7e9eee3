"""A corpus of real model programs, written by others, run under mpjax and against float32.

The programs keep the code shape of their sources, with only their configurations made tiny:

1. GPT-2, ported from Hugging Face transformers' Flax GPT-2 (``modeling_flax_gpt2.py``):
   ``FlaxConv1D``, ``FlaxGPT2Attention`` with ``_split_heads``/``_merge_heads``, Flax's
   ``make_causal_mask`` and ``combine_masks``, the mask turned into an additive bias by
   ``lax.select`` between 0 and ``jnp.finfo(dtype).min`` (current transformers; early releases
   used -1e4), ``dot_product_attention_weights`` with a dropout rng, ``FlaxGPT2MLP`` with
   ``gelu_new``, LayerNorm epsilon 1e-5, ``wte``/``wpe`` embeddings and the LM head tied to
   ``wte`` (HF's ``lm_head.apply`` with the shared kernel, or Flax's ``wte.attend``). The cache
   and generation code are left out. It is trained as a causal LM with
   ``optax.softmax_cross_entropy_with_integer_labels`` on a batch with left- and right-padded
   rows; the left-padded rows give HF's attention fully masked rows.
2. BERT, ported from Hugging Face transformers' Flax BERT (``modeling_flax_bert.py``): word,
   position and token-type embeddings, LayerNorm epsilon 1e-12, self-attention with HF's
   attention-mask bias (``jnp.finfo(dtype).min``; early releases used -1e10) and the int32
   head mask HF's ``__call__`` always passes, exact GELU, the tanh pooler and
   ``FlaxBertForSequenceClassificationModule``, trained with dropout (``deterministic=False``
   and a dropout rng) and ``optax.softmax_cross_entropy``.
3. Equinox-style code without equinox, after Equinox's idioms and its scan-over-layers
   recipe: modules are frozen dataclasses registered as pytrees (static fields in the
   treedef, activation functions and dropout rates as non-array leaves), written for one
   unbatched example and ``jax.vmap``-ped over the batch; identical blocks are stored as
   stacked arrays, split from the rest by a filter (``partition``/``combine``, as
   ``eqx.partition``/``eqx.combine``) and run with ``jax.lax.scan``. RMSNorm, rotary
   embeddings, dropout with ``jax.random.split`` keys inside the model, a SwiGLU MLP with
   ``jax.nn.silu``, ``jax.nn.softmax(where=mask)`` attention and a ``jax.nn.logsumexp`` loss
   with a ``-inf`` vocabulary mask.

The HF models run through ``mpjax.flax.wrap`` (params stored as the policy says), the
Equinox-style one through ``mpjax.autocast`` (params float32, as written), at O1, O2 and O3 in
float16 and bfloat16, each as a jitted ``jax.value_and_grad`` train step. Each case checks that
the loss, the logits and the hidden states (padding rows included) are finite and close to the
float32 program's, that the gradients are finite and close in direction and norm, and, with
``mpjax.audit``, that every matmul of the step (forward and backward) ran in half and, below
O3, no float32-list op did. GPT-2's gradients at O3 in float16 are not finite (pure-half
LayerNorm): that case is marked ``xfail(strict=True)``, reduced to a few lines at the end of
the file, and run again with ``keep_norm_fp32=True``, which fixes it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import combine_masks, make_causal_mask
from flax.linen.attention import dot_product_attention_weights
from jax import lax

import mpjax
import mpjax.flax

pytestmark = pytest.mark.slow  # about 70 s: `pytest -m slow` (CI runs it)

LEVELS = ["O1", "O2", "O3"]
DTYPES = ["float16", "bfloat16"]
EPS = {"float16": float(jnp.finfo(jnp.float16).eps), "bfloat16": float(jnp.finfo(jnp.bfloat16).eps)}
B, T = 4, 16  # batch and sequence length of every batch below

# transformers' modeling_flax_utils.ACT2FN (the entries these models use).
ACT2FN = {
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "tanh": nn.tanh,
}


# == 1. GPT-2: transformers/models/gpt2/modeling_flax_gpt2.py =====================================


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The fields of transformers' GPT2Config that the Flax modules read (a tiny GPT-2)."""

    vocab_size: int = 128
    n_positions: int = 32
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    tie_via_attend: bool = False  # not HF's: tie with Flax's nn.Embed.attend instead

    # GPT2Config.attribute_map
    hidden_size = property(lambda self: self.n_embd)
    num_attention_heads = property(lambda self: self.n_head)
    max_position_embeddings = property(lambda self: self.n_positions)
    num_hidden_layers = property(lambda self: self.n_layer)


class FlaxConv1D(nn.Module):
    features: int
    use_bias: bool = True
    dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, inputs):
        inputs = jnp.asarray(inputs, self.dtype)
        kernel = self.param(
            "kernel", jax.nn.initializers.normal(stddev=0.02), (self.features, inputs.shape[-1])
        )
        kernel = jnp.asarray(kernel.transpose(), self.dtype)
        y = lax.dot_general(
            inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
        )
        if self.use_bias:
            bias = self.param("bias", jax.nn.initializers.zeros, (self.features,))
            bias = jnp.asarray(bias, self.dtype)
            y = y + bias
        return y


class FlaxGPT2Attention(nn.Module):
    config: GPT2Config
    dtype: jnp.dtype = jnp.float32
    causal: bool = True

    def setup(self):
        config = self.config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads

        self.c_attn = FlaxConv1D(3 * self.embed_dim, dtype=self.dtype)
        self.c_proj = FlaxConv1D(self.embed_dim, dtype=self.dtype)

        self.resid_dropout = nn.Dropout(rate=config.resid_pdrop)

        if self.causal:
            self.causal_mask = make_causal_mask(
                jnp.ones((1, config.max_position_embeddings), dtype="bool"), dtype="bool"
            )

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def __call__(
        self,
        hidden_states,
        attention_mask=None,
        deterministic: bool = True,
        output_attentions: bool = False,
    ):
        batch_size = hidden_states.shape[0]

        qkv_out = self.c_attn(hidden_states)
        query, key, value = jnp.split(qkv_out, 3, axis=2)

        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)

        query_length, key_length = query.shape[1], key.shape[1]

        if self.causal:
            causal_mask = self.causal_mask[:, :, :query_length, :key_length]
            causal_mask = jnp.broadcast_to(causal_mask, (batch_size,) + causal_mask.shape[1:])

        # combine masks if needed
        if attention_mask is not None and self.causal:
            attention_mask = jnp.broadcast_to(
                jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_mask.shape
            )
            attention_mask = combine_masks(attention_mask, causal_mask)
        elif self.causal:
            attention_mask = causal_mask
        elif attention_mask is not None:
            attention_mask = jnp.expand_dims(attention_mask, axis=(-3, -2))

        dropout_rng = None
        if not deterministic and self.config.attn_pdrop > 0.0:
            dropout_rng = self.make_rng("dropout")

        # transform boolean mask into float mask
        if attention_mask is not None:
            attention_bias = lax.select(
                attention_mask > 0,
                jnp.full(attention_mask.shape, 0.0).astype(self.dtype),
                jnp.full(attention_mask.shape, jnp.finfo(self.dtype).min).astype(self.dtype),
            )
        else:
            attention_bias = None

        # usual dot product attention
        attn_weights = dot_product_attention_weights(
            query,
            key,
            bias=attention_bias,
            dropout_rng=dropout_rng,
            dropout_rate=self.config.attn_pdrop,
            deterministic=deterministic,
            dtype=self.dtype,
            precision=None,
        )

        attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value)
        attn_output = self._merge_heads(attn_output)
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output, deterministic=deterministic)

        outputs = (attn_output, attn_weights) if output_attentions else (attn_output,)
        return outputs


class FlaxGPT2MLP(nn.Module):
    config: GPT2Config
    intermediate_size: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        embed_dim = self.config.hidden_size
        self.c_fc = FlaxConv1D(self.intermediate_size, dtype=self.dtype)
        self.c_proj = FlaxConv1D(embed_dim, dtype=self.dtype)
        self.act = ACT2FN[self.config.activation_function]
        self.dropout = nn.Dropout(rate=self.config.resid_pdrop)

    def __call__(self, hidden_states, deterministic: bool = True):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)
        return hidden_states


class FlaxGPT2Block(nn.Module):
    config: GPT2Config
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        hidden_size = self.config.hidden_size
        inner_dim = self.config.n_inner if self.config.n_inner is not None else 4 * hidden_size

        self.ln_1 = nn.LayerNorm(epsilon=self.config.layer_norm_epsilon, dtype=self.dtype)
        self.attn = FlaxGPT2Attention(self.config, dtype=self.dtype)
        self.ln_2 = nn.LayerNorm(epsilon=self.config.layer_norm_epsilon, dtype=self.dtype)
        self.mlp = FlaxGPT2MLP(self.config, inner_dim, dtype=self.dtype)

    def __call__(
        self,
        hidden_states,
        attention_mask=None,
        deterministic: bool = True,
        output_attentions: bool = False,
    ):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_outputs = self.attn(
            hidden_states,
            attention_mask=attention_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
        )
        # residual connection
        attn_output = attn_outputs[0]  # output_attn: a, (attentions)
        outputs = attn_outputs[1:]
        # residual connection
        hidden_states = attn_output + residual

        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states, deterministic=deterministic)
        # residual connection
        hidden_states = residual + feed_forward_hidden_states

        outputs = (hidden_states,) + outputs

        return outputs


class FlaxGPT2BlockCollection(nn.Module):
    config: GPT2Config
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.blocks = [
            FlaxGPT2Block(self.config, name=str(i), dtype=self.dtype)
            for i in range(self.config.num_hidden_layers)
        ]

    def __call__(
        self,
        hidden_states,
        attention_mask=None,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        all_attentions = () if output_attentions else None
        all_hidden_states = () if output_hidden_states else None

        for block in self.blocks:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)

            layer_outputs = block(
                hidden_states,
                attention_mask,
                deterministic=deterministic,
                output_attentions=output_attentions,
            )
            hidden_states = layer_outputs[0]

            if output_attentions:
                all_attentions += (layer_outputs[1],)

        # this contains possible `None` values - `FlaxGPT2Module` will filter them out
        outputs = (hidden_states, all_hidden_states, all_attentions)

        return outputs


class FlaxGPT2Module(nn.Module):
    config: GPT2Config
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embed_dim = self.config.hidden_size

        self.wte = nn.Embed(
            self.config.vocab_size,
            self.embed_dim,
            embedding_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
            dtype=self.dtype,
        )
        self.wpe = nn.Embed(
            self.config.max_position_embeddings,
            self.embed_dim,
            embedding_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
            dtype=self.dtype,
        )
        self.dropout = nn.Dropout(rate=self.config.embd_pdrop)
        self.h = FlaxGPT2BlockCollection(self.config, dtype=self.dtype)
        self.ln_f = nn.LayerNorm(epsilon=self.config.layer_norm_epsilon, dtype=self.dtype)

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        deterministic=True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        input_embeds = self.wte(input_ids.astype("i4"))
        position_embeds = self.wpe(position_ids.astype("i4"))

        hidden_states = input_embeds + position_embeds
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)

        outputs = self.h(
            hidden_states,
            attention_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

        hidden_states = outputs[0]
        hidden_states = self.ln_f(hidden_states)

        if output_hidden_states:
            all_hidden_states = outputs[1] + (hidden_states,)
            outputs = (hidden_states, all_hidden_states) + outputs[2:]
        else:
            outputs = (hidden_states,) + outputs[1:]

        return tuple(v for v in outputs if v is not None)


class FlaxGPT2LMHeadModule(nn.Module):
    config: GPT2Config
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.transformer = FlaxGPT2Module(self.config, dtype=self.dtype)
        self.lm_head = nn.Dense(
            self.config.vocab_size,
            use_bias=False,
            dtype=self.dtype,
            kernel_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
        )

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        outputs = self.transformer(
            input_ids,
            attention_mask,
            position_ids,
            deterministic=deterministic,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

        hidden_states = outputs[0]

        if self.config.tie_word_embeddings and self.config.tie_via_attend:
            lm_logits = self.transformer.wte.attend(hidden_states)
        elif self.config.tie_word_embeddings:
            shared_kernel = self.transformer.variables["params"]["wte"]["embedding"].T
            lm_logits = self.lm_head.apply({"params": {"kernel": shared_kernel}}, hidden_states)
        else:
            lm_logits = self.lm_head(hidden_states)

        return (lm_logits,) + outputs[1:]


GPT2_PAD = 127  # GPT-2 has no pad token; HF pads with eos (the last id)
# Each row's padding side and real length. HF pads left for generation and right for training;
# both are here, some rows with many pads. With left padding and the causal mask, the padding
# queries see no key at all: HF's code gives them fully masked rows.
GPT2_ROWS = (("right", 16), ("right", 11), ("left", 6), ("left", 3))


def gpt2_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch, with position ids as HF's ``prepare_inputs_for_generation`` makes them
    from the mask (``cumsum - 1``, clipped at 0 for the left pads)."""
    r = np.random.default_rng(seed)
    pos = np.arange(T)
    mask = np.stack([pos < n if side == "right" else pos >= T - n for side, n in GPT2_ROWS])
    input_ids = np.where(mask, r.integers(0, GPT2_PAD, size=(B, T)), GPT2_PAD)
    position_ids = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return {
        "input_ids": input_ids.astype(np.int32),
        "attention_mask": mask.astype(np.int32),
        "position_ids": position_ids.astype(np.int32),
    }


def gpt2_loss_fn(apply):
    """The causal LM loss over real next tokens of ``apply``'s logits (HF's __call__ casts the
    inputs to i4 and passes ``not train`` as ``deterministic``)."""

    def loss_fn(params, batch, dropout_rng):
        logits, hidden_states = apply(
            {"params": params},
            jnp.array(batch["input_ids"], dtype="i4"),
            jnp.array(batch["attention_mask"], dtype="i4"),
            jnp.array(batch["position_ids"], dtype="i4"),
            False,  # not train
            output_hidden_states=True,
            rngs={"dropout": dropout_rng},
        )
        labels = batch["input_ids"][:, 1:]
        label_mask = batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
        loss = jnp.sum(ce * label_mask) / jnp.sum(label_mask)
        return loss, (logits, hidden_states)

    return loss_fn


# == 2. BERT: transformers/models/bert/modeling_flax_bert.py ======================================


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of transformers' BertConfig that the Flax modules read (a tiny BERT)."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 32
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    classifier_dropout: float | None = None
    num_labels: int = 3


class FlaxBertEmbeddings(nn.Module):
    """Construct the embeddings from word, position and token_type embeddings."""

    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.word_embeddings = nn.Embed(
            self.config.vocab_size,
            self.config.hidden_size,
            embedding_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
            dtype=self.dtype,
        )
        self.position_embeddings = nn.Embed(
            self.config.max_position_embeddings,
            self.config.hidden_size,
            embedding_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
            dtype=self.dtype,
        )
        self.token_type_embeddings = nn.Embed(
            self.config.type_vocab_size,
            self.config.hidden_size,
            embedding_init=jax.nn.initializers.normal(stddev=self.config.initializer_range),
            dtype=self.dtype,
        )
        self.LayerNorm = nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype)
        self.dropout = nn.Dropout(rate=self.config.hidden_dropout_prob)

    def __call__(
        self, input_ids, token_type_ids, position_ids, attention_mask, deterministic: bool = True
    ):
        # Embed
        inputs_embeds = self.word_embeddings(input_ids.astype("i4"))
        position_embeds = self.position_embeddings(position_ids.astype("i4"))
        token_type_embeddings = self.token_type_embeddings(token_type_ids.astype("i4"))

        # Sum all embeddings
        hidden_states = inputs_embeds + token_type_embeddings + position_embeds

        # Layer Norm
        hidden_states = self.LayerNorm(hidden_states)
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)
        return hidden_states


class FlaxBertSelfAttention(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.head_dim = self.config.hidden_size // self.config.num_attention_heads
        if self.config.hidden_size % self.config.num_attention_heads != 0:
            raise ValueError(
                "`config.hidden_size`: {self.config.hidden_size} has to be a multiple of "
                "`config.num_attention_heads`: {self.config.num_attention_heads}"
            )

        self.query = nn.Dense(
            self.config.hidden_size,
            dtype=self.dtype,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
        )
        self.key = nn.Dense(
            self.config.hidden_size,
            dtype=self.dtype,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
        )
        self.value = nn.Dense(
            self.config.hidden_size,
            dtype=self.dtype,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
        )

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(
            hidden_states.shape[:2] + (self.config.num_attention_heads, self.head_dim)
        )

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.config.hidden_size,))

    def __call__(
        self,
        hidden_states,
        attention_mask,
        layer_head_mask,
        deterministic=True,
        output_attentions: bool = False,
    ):
        query_states = self._split_heads(self.query(hidden_states))
        value_states = self._split_heads(self.value(hidden_states))
        key_states = self._split_heads(self.key(hidden_states))

        # Convert the boolean attention mask to an attention bias.
        if attention_mask is not None:
            # attention mask in the form of attention bias
            attention_mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
            attention_bias = lax.select(
                attention_mask > 0,
                jnp.full(attention_mask.shape, 0.0).astype(self.dtype),
                jnp.full(attention_mask.shape, jnp.finfo(self.dtype).min).astype(self.dtype),
            )
        else:
            attention_bias = None

        dropout_rng = None
        if not deterministic and self.config.attention_probs_dropout_prob > 0.0:
            dropout_rng = self.make_rng("dropout")

        attn_weights = dot_product_attention_weights(
            query_states,
            key_states,
            bias=attention_bias,
            dropout_rng=dropout_rng,
            dropout_rate=self.config.attention_probs_dropout_prob,
            broadcast_dropout=True,
            deterministic=deterministic,
            dtype=self.dtype,
            precision=None,
        )

        # Mask heads if we want to
        if layer_head_mask is not None:
            attn_weights = jnp.einsum("...hqk,h->...hqk", attn_weights, layer_head_mask)

        attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        attn_output = attn_output.reshape(attn_output.shape[:2] + (-1,))

        outputs = (attn_output, attn_weights) if output_attentions else (attn_output,)
        return outputs


class FlaxBertSelfOutput(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.dense = nn.Dense(
            self.config.hidden_size,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
            dtype=self.dtype,
        )
        self.LayerNorm = nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype)
        self.dropout = nn.Dropout(rate=self.config.hidden_dropout_prob)

    def __call__(self, hidden_states, input_tensor, deterministic: bool = True):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class FlaxBertAttention(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.self = FlaxBertSelfAttention(self.config, dtype=self.dtype)
        self.output = FlaxBertSelfOutput(self.config, dtype=self.dtype)

    def __call__(
        self,
        hidden_states,
        attention_mask,
        layer_head_mask,
        deterministic=True,
        output_attentions: bool = False,
    ):
        # Attention mask comes in as attention_mask.shape == (*batch_sizes, kv_length)
        # FLAX expects: attention_mask.shape == (*batch_sizes, 1, 1, kv_length) such that it is
        # broadcastable with attn_weights.shape == (*batch_sizes, num_heads, q_length, kv_length)
        attn_outputs = self.self(
            hidden_states,
            attention_mask,
            layer_head_mask=layer_head_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
        )
        attn_output = attn_outputs[0]
        hidden_states = self.output(attn_output, hidden_states, deterministic=deterministic)

        outputs = (hidden_states,)

        if output_attentions:
            outputs += (attn_outputs[1],)

        return outputs


class FlaxBertIntermediate(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.dense = nn.Dense(
            self.config.intermediate_size,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
            dtype=self.dtype,
        )
        self.activation = ACT2FN[self.config.hidden_act]

    def __call__(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.activation(hidden_states)
        return hidden_states


class FlaxBertOutput(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.dense = nn.Dense(
            self.config.hidden_size,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
            dtype=self.dtype,
        )
        self.dropout = nn.Dropout(rate=self.config.hidden_dropout_prob)
        self.LayerNorm = nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype)

    def __call__(self, hidden_states, attention_output, deterministic: bool = True):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)
        hidden_states = self.LayerNorm(hidden_states + attention_output)
        return hidden_states


class FlaxBertLayer(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.attention = FlaxBertAttention(self.config, dtype=self.dtype)
        self.intermediate = FlaxBertIntermediate(self.config, dtype=self.dtype)
        self.output = FlaxBertOutput(self.config, dtype=self.dtype)

    def __call__(
        self,
        hidden_states,
        attention_mask,
        layer_head_mask,
        deterministic: bool = True,
        output_attentions: bool = False,
    ):
        attention_outputs = self.attention(
            hidden_states,
            attention_mask,
            layer_head_mask=layer_head_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
        )
        attention_output = attention_outputs[0]

        hidden_states = self.intermediate(attention_output)
        hidden_states = self.output(hidden_states, attention_output, deterministic=deterministic)

        outputs = (hidden_states,)

        if output_attentions:
            outputs += (attention_outputs[1],)
        return outputs


class FlaxBertLayerCollection(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.layers = [
            FlaxBertLayer(self.config, name=str(i), dtype=self.dtype)
            for i in range(self.config.num_hidden_layers)
        ]

    def __call__(
        self,
        hidden_states,
        attention_mask,
        head_mask,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        all_attentions = () if output_attentions else None
        all_hidden_states = () if output_hidden_states else None

        # Check if head_mask has a correct number of layers specified if desired
        if head_mask is not None:
            if head_mask.shape[0] != (len(self.layers)):
                raise ValueError(
                    f"The head_mask should be specified for {len(self.layers)} layers, but it is "
                    f"for {head_mask.shape[0]}."
                )

        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden_states += (hidden_states,)

            layer_outputs = layer(
                hidden_states,
                attention_mask,
                layer_head_mask=head_mask[i] if head_mask is not None else None,
                deterministic=deterministic,
                output_attentions=output_attentions,
            )

            hidden_states = layer_outputs[0]

            if output_attentions:
                all_attentions += (layer_outputs[1],)

        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        outputs = (hidden_states, all_hidden_states, all_attentions)

        return tuple(v for v in outputs if v is not None)


class FlaxBertEncoder(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.layer = FlaxBertLayerCollection(self.config, dtype=self.dtype)

    def __call__(
        self,
        hidden_states,
        attention_mask,
        head_mask,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        return self.layer(
            hidden_states,
            attention_mask,
            head_mask=head_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )


class FlaxBertPooler(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation

    def setup(self):
        self.dense = nn.Dense(
            self.config.hidden_size,
            kernel_init=jax.nn.initializers.normal(self.config.initializer_range),
            dtype=self.dtype,
        )

    def __call__(self, hidden_states):
        cls_hidden_state = hidden_states[:, 0]
        cls_hidden_state = self.dense(cls_hidden_state)
        return nn.tanh(cls_hidden_state)


class FlaxBertModule(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32  # the dtype of the computation
    add_pooling_layer: bool = True

    def setup(self):
        self.embeddings = FlaxBertEmbeddings(self.config, dtype=self.dtype)
        self.encoder = FlaxBertEncoder(self.config, dtype=self.dtype)
        self.pooler = FlaxBertPooler(self.config, dtype=self.dtype)

    def __call__(
        self,
        input_ids,
        attention_mask,
        token_type_ids=None,
        position_ids=None,
        head_mask=None,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        # make sure `token_type_ids` is correctly initialized when not passed
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)

        # make sure `position_ids` is correctly initialized when not passed
        if position_ids is None:
            position_ids = jnp.broadcast_to(
                jnp.arange(jnp.atleast_2d(input_ids).shape[-1]), input_ids.shape
            )

        hidden_states = self.embeddings(
            input_ids, token_type_ids, position_ids, attention_mask, deterministic=deterministic
        )
        outputs = self.encoder(
            hidden_states,
            attention_mask,
            head_mask=head_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        hidden_states = outputs[0]
        pooled = self.pooler(hidden_states) if self.add_pooling_layer else None

        # if pooled is None, don't return it
        if pooled is None:
            return (hidden_states,) + outputs[1:]
        return (hidden_states, pooled) + outputs[1:]


class FlaxBertForSequenceClassificationModule(nn.Module):
    config: BertConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.bert = FlaxBertModule(config=self.config, dtype=self.dtype)
        classifier_dropout = (
            self.config.classifier_dropout
            if self.config.classifier_dropout is not None
            else self.config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(rate=classifier_dropout)
        self.classifier = nn.Dense(
            self.config.num_labels,
            dtype=self.dtype,
        )

    def __call__(
        self,
        input_ids,
        attention_mask,
        token_type_ids,
        position_ids,
        head_mask,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ):
        # Model
        outputs = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            head_mask,
            deterministic=deterministic,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

        pooled_output = outputs[1]
        pooled_output = self.dropout(pooled_output, deterministic=deterministic)
        logits = self.classifier(pooled_output)

        return (logits,) + outputs[2:]


BERT_PAD = 0  # [PAD]
BERT_LENGTHS = (16, 12, 7, 3)


def bert_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Right-padded sentence pairs with their segment ids, as BertTokenizer pads them."""
    r = np.random.default_rng(seed)
    lengths = np.array(BERT_LENGTHS)[:, None]
    mask = np.arange(T)[None, :] < lengths
    input_ids = np.where(mask, r.integers(1, 128, size=(B, T)), BERT_PAD)
    token_type_ids = np.where(mask & (np.arange(T)[None, :] >= lengths // 2), 1, 0)
    return {
        "input_ids": input_ids.astype(np.int32),
        "attention_mask": mask.astype(np.int32),
        "token_type_ids": token_type_ids.astype(np.int32),
        "labels": r.integers(0, BertConfig.num_labels, size=(B,)).astype(np.int32),
    }


def bert_loss_fn(apply, config: BertConfig):
    """HF's FlaxBertPreTrainedModel.__call__ (train=True: inputs cast to i4, position ids and a
    head mask of ones made for the caller), then softmax cross-entropy on the labels."""

    def loss_fn(params, batch, dropout_rng):
        input_ids = batch["input_ids"]
        position_ids = jnp.broadcast_to(
            jnp.arange(jnp.atleast_2d(input_ids).shape[-1]), input_ids.shape
        )
        head_mask = jnp.ones((config.num_hidden_layers, config.num_attention_heads))
        logits, hidden_states = apply(
            {"params": params},
            jnp.array(input_ids, dtype="i4"),
            jnp.array(batch["attention_mask"], dtype="i4"),
            jnp.array(batch["token_type_ids"], dtype="i4"),
            jnp.array(position_ids, dtype="i4"),
            jnp.array(head_mask, dtype="i4"),
            False,  # not train
            output_hidden_states=True,
            rngs={"dropout": dropout_rng},
        )
        onehot = jax.nn.one_hot(batch["labels"], config.num_labels)
        loss = optax.softmax_cross_entropy(logits, onehot).mean()
        return loss, (logits, hidden_states)

    return loss_fn


# == 3. Equinox-style modules (pytrees, vmap over the batch, scan over stacked layers) ============


def static_field(**kwargs):
    """A field kept in the treedef (equinox's ``eqx.field(static=True)``)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


class Module:
    """Equinox's Module in miniature: each subclass is a frozen dataclass and a pytree whose
    fields are leaves, except the static ones. Non-array leaves (activation functions, Python
    floats) stay leaves, so a filter separates them from the parameters."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        fields = dataclasses.fields(cls)
        jax.tree_util.register_dataclass(
            cls,
            data_fields=[f.name for f in fields if not f.metadata.get("static", False)],
            meta_fields=[f.name for f in fields if f.metadata.get("static", False)],
        )


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def partition(tree: Any, keep: Callable[[Any], bool]) -> tuple[Any, Any]:
    """``eqx.partition``: the leaves `keep` accepts, and the rest, with None in the holes."""
    return (
        jax.tree_util.tree_map(lambda x: x if keep(x) else None, tree),
        jax.tree_util.tree_map(lambda x: None if keep(x) else x, tree),
    )


def combine(*trees: Any) -> Any:
    """``eqx.combine``: the first non-None leaf at each position."""

    def first(*xs):
        return next((x for x in xs if x is not None), None)

    return jax.tree_util.tree_map(first, *trees, is_leaf=lambda x: x is None)


class Linear(Module):
    """``eqx.nn.Linear``: maps one vector; ``jax.vmap`` it over a sequence."""

    weight: jax.Array
    bias: jax.Array | None

    def __call__(self, x):
        y = self.weight @ x
        return y if self.bias is None else y + self.bias


def make_linear(key, in_features, out_features, use_bias=True) -> Linear:
    wkey, bkey = jax.random.split(key)
    lim = 1 / np.sqrt(in_features)
    weight = jax.random.uniform(wkey, (out_features, in_features), minval=-lim, maxval=lim)
    bias = jax.random.uniform(bkey, (out_features,), minval=-lim, maxval=lim) if use_bias else None
    return Linear(weight, bias)


class Embedding(Module):
    weight: jax.Array

    def __call__(self, index):
        return self.weight[index]


class RMSNorm(Module):
    weight: jax.Array
    eps: float = static_field(default=1e-6)

    def __call__(self, x):
        return x * lax.rsqrt(jnp.mean(x**2) + self.eps) * self.weight


class Dropout(Module):
    """``eqx.nn.Dropout``: `p` is a plain (non-array) leaf."""

    p: float = 0.1

    def __call__(self, x, *, key):
        q = 1 - lax.stop_gradient(self.p)
        keep = jax.random.bernoulli(key, q, x.shape)
        return jnp.where(keep, x / q, 0)


def rotary(x, positions):
    """Rotary position embedding of x [T, heads, head_dim] (GPT-NeoX/Llama's rotate-half)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(Module):
    attn_norm: RMSNorm
    qkv: Linear
    out: Linear
    mlp_norm: RMSNorm
    gate: Linear
    up: Linear
    down: Linear
    dropout: Dropout
    activation: Callable  # a non-array leaf, as in eqx.nn.MLP
    num_heads: int = static_field()

    def __call__(self, x, mask, *, key):
        """One example: x [T, D], mask [T, T] (True where a query may attend a key)."""
        seq, dim = x.shape
        attn_key, mlp_key = jax.random.split(key)
        h = jax.vmap(self.attn_norm)(x)
        q, k, v = jnp.split(jax.vmap(self.qkv)(h), 3, axis=-1)
        q, k, v = (a.reshape(seq, self.num_heads, dim // self.num_heads) for a in (q, k, v))
        positions = jnp.arange(seq)
        q, k = rotary(q, positions), rotary(k, positions)
        logits = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
        weights = jax.nn.softmax(logits, axis=-1, where=mask[None])
        weights = self.dropout(weights, key=attn_key)
        attn = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, dim)
        x = x + jax.vmap(self.out)(attn)
        h = jax.vmap(self.mlp_norm)(x)
        h = self.activation(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h)
        return x + self.dropout(jax.vmap(self.down)(h), key=mlp_key)


def make_block(key, dim, num_heads, hidden) -> Block:
    k = jax.random.split(key, 5)
    return Block(
        attn_norm=RMSNorm(jnp.ones(dim)),
        qkv=make_linear(k[0], dim, 3 * dim, use_bias=False),
        out=make_linear(k[1], dim, dim, use_bias=False),
        mlp_norm=RMSNorm(jnp.ones(dim)),
        gate=make_linear(k[2], dim, hidden, use_bias=False),
        up=make_linear(k[3], dim, hidden, use_bias=False),
        down=make_linear(k[4], hidden, dim, use_bias=False),
        dropout=Dropout(0.1),
        activation=jax.nn.silu,
        num_heads=num_heads,
    )


class Transformer(Module):
    embed: Embedding
    blocks: Block  # every array leaf stacked along a leading layer axis
    norm: RMSNorm
    head: Linear

    def __call__(self, ids, pad, *, key):
        """One example: token ids [T] and its padding mask [T] -> logits [T, vocab]."""
        seq = ids.shape[0]
        x = jax.vmap(self.embed)(ids)
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool)) & pad[None, :]
        dynamic, static = partition(self.blocks, is_array)
        num_layers = dynamic.out.weight.shape[0]

        def body(x, layer):
            params, layer_key = layer
            block = combine(params, static)
            return block(x, mask, key=layer_key), None

        x, _ = lax.scan(body, x, (dynamic, jax.random.split(key, num_layers)))
        x = jax.vmap(self.norm)(x)
        return jax.vmap(self.head)(x)


def make_transformer(key, vocab=128, dim=64, num_layers=2, num_heads=4, hidden=128):
    ekey, bkey, hkey = jax.random.split(key, 3)
    block_keys = jax.random.split(bkey, num_layers)
    # eqx.filter_vmap(make_block)(keys): the arrays stacked, the rest taken once.
    stacked = jax.vmap(lambda k: partition(make_block(k, dim, num_heads, hidden), is_array)[0])(
        block_keys
    )
    _, rest = partition(make_block(block_keys[0], dim, num_heads, hidden), is_array)
    return Transformer(
        embed=Embedding(jax.random.normal(ekey, (vocab, dim))),
        blocks=combine(stacked, rest),
        norm=RMSNorm(jnp.ones(dim)),
        head=make_linear(hkey, dim, vocab, use_bias=False),
    )


EQX_PAD = 0
EQX_RESERVED = 120  # ids >= 120 are control tokens the LM may never predict


def eqx_batch(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    pad = np.arange(T)[None, :] < np.array([16, 11, 6, 3])[:, None]  # right-padded
    ids = np.where(pad, r.integers(1, EQX_RESERVED, size=(B, T)), EQX_PAD)
    return {"ids": ids.astype(np.int32), "pad": pad}


def eqx_loss_fn(static):
    """The LM loss of the model ``combine(params, static)``, vmapped over the batch."""

    def example_loss(model, ids, pad, key):
        logits = model(ids, pad, key=key)
        allowed = jnp.arange(logits.shape[-1]) < EQX_RESERVED
        masked = jnp.where(allowed, logits[:-1], -jnp.inf)
        labels = ids[1:]
        nll = (
            jax.nn.logsumexp(masked, axis=-1)
            - jnp.take_along_axis(masked, labels[:, None], axis=-1)[:, 0]
        )
        weight = (pad[1:] & pad[:-1]).astype(jnp.float32)
        return jnp.sum(nll * weight), jnp.sum(weight), logits

    def loss_fn(params, batch, key):
        model = combine(params, static)
        keys = jax.random.split(key, batch["ids"].shape[0])
        nll, weight, logits = jax.vmap(functools.partial(example_loss, model))(
            batch["ids"], batch["pad"], keys
        )
        return jnp.sum(nll) / jnp.sum(weight), (logits, None)

    return loss_fn


# == the checks ====================================================================================


def as64(x):
    return np.asarray(x, np.float64)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(as64(x)) for x in jax.tree_util.tree_leaves(tree)])


def rel_err(a, b) -> float:
    a, b = as64(a), as64(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@dataclasses.dataclass
class Case:
    """One model program: its params and loss in float32 or under a policy."""

    name: str
    init: Callable[[Any], Any]  # policy or None -> params
    loss: Callable[[Any], Callable]  # policy or None -> loss_fn(params, batch, key)
    batch: dict[str, np.ndarray]
    real: np.ndarray  # True at the real (non-padding) entries of the logits' leading axes
    key: Any = dataclasses.field(default_factory=lambda: jax.random.key(42))


def flax_model(module, policy):
    return module if policy is None else mpjax.flax.wrap(module, policy)


def gpt2_case(seed=0, **config) -> Case:
    module = FlaxGPT2LMHeadModule(GPT2Config(**config))
    batch = gpt2_batch(seed)

    def init(policy):  # the wrapper's init stores params as the policy says
        return flax_model(module, policy).init(
            {"params": jax.random.key(seed), "dropout": jax.random.key(1)},
            batch["input_ids"],
            batch["attention_mask"],
            batch["position_ids"],
        )["params"]

    def loss(policy):
        return gpt2_loss_fn(flax_model(module, policy).apply)

    return Case("gpt2", init, loss, batch, batch["attention_mask"] > 0)


def bert_case(seed=0) -> Case:
    cfg = BertConfig()
    module = FlaxBertForSequenceClassificationModule(cfg)
    batch = bert_batch(seed)

    def init(policy):
        ids = batch["input_ids"]
        return flax_model(module, policy).init(
            {"params": jax.random.key(seed), "dropout": jax.random.key(1)},
            ids,
            batch["attention_mask"],
            batch["token_type_ids"],
            np.broadcast_to(np.arange(T), ids.shape),
            np.ones((cfg.num_hidden_layers, cfg.num_attention_heads), np.int32),
        )["params"]

    def loss(policy):
        return bert_loss_fn(flax_model(module, policy).apply, cfg)

    return Case("bert", init, loss, batch, np.ones(B, bool))


def eqx_case(seed=0) -> Case:
    # The program is written for float32 params: autocast takes them as they are, at every
    # level. (Stored in half, the float32 rotary table would promote the scan carry to float32
    # and lax.scan refuses the program before autocast sees it.)
    params, static = partition(make_transformer(jax.random.key(seed)), is_array)
    batch = eqx_batch(seed)

    def loss(policy):
        fn = eqx_loss_fn(static)
        return fn if policy is None else mpjax.autocast(fn, policy)

    return Case("eqx", lambda policy: params, loss, batch, batch["pad"])


# XLA's backend (LLVM) optimization level 0 compiles these steps about 3x faster on CPU. It
# leaves XLA's HLO passes (and so every dtype and cast of the program) as they are.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def run_case(case: Case, policy=None):
    """(loss, logits, hidden, grads) of one jitted value_and_grad step, and the step itself."""
    params = case.init(policy)
    step = jax.jit(
        jax.value_and_grad(case.loss(policy), has_aux=True), compiler_options=FAST_COMPILE
    )
    (loss, (logits, hidden)), grads = step(params, case.batch, case.key)
    return (loss, logits, hidden, grads), (step, params)


# The programs as the tests run them. GPT-2's seed is 3 (the others' 0): at that seed its pad
# token's first LayerNorm input has variance 4.9e-4, well inside the O3 float16 failure below
# (seeds 1-4 fail there; seed 0 happens to pass).
GPT2_SEED = 3
CASES: dict[str, Callable[[], Case]] = {
    "gpt2": lambda: gpt2_case(GPT2_SEED),  # HF's tie: lm_head.apply with wte's embedding
    "gpt2-attend": lambda: gpt2_case(GPT2_SEED, tie_via_attend=True),  # Flax's tie: wte.attend
    "bert": bert_case,
    "eqx": eqx_case,
}


def case_name(model: str, dtype: str) -> str:
    """GPT-2 ties its head with HF's lm_head.apply in the float16 cases and with wte.attend in
    the bfloat16 ones, so both run at every level without compiling the grid twice. Both are
    compared with the float32 program tied HF's way: the same params and the same product."""
    return "gpt2-attend" if model == "gpt2" and dtype == "bfloat16" else model


@functools.cache
def reference(name: str) -> dict[str, Any]:
    """The float32 program's loss, logits and gradients."""
    (loss, logits, _, grads), _ = run_case(CASES[name]())
    return {"loss": float(loss), "logits": as64(logits), "grads": flat(grads)}


@functools.cache
def measured(model: str, level: str, dtype: str, **overrides: Any) -> dict[str, Any]:
    """The program under the policy: its errors against float32 and the step's audit."""
    name = case_name(model, dtype)
    case = CASES[name]()
    ref = reference(model)
    policy = mpjax.Policy.from_level(level, dtype, **overrides)
    (loss, logits, hidden, grads), (step, params) = run_case(case, policy)
    logits, g, g_ref = as64(logits), flat(grads), ref["grads"]
    real = case.real.reshape(case.real.shape + (1,) * (logits.ndim - case.real.ndim))
    real = np.broadcast_to(real, logits.shape)
    return {
        "finite": {
            "loss": bool(np.isfinite(float(loss))),
            "logits": bool(np.all(np.isfinite(logits))),  # padding rows included
            "hidden states": bool(np.all(np.isfinite(flat(hidden)))) if hidden else True,
            "gradients": bool(np.all(np.isfinite(g))),
        },
        "loss": abs(float(loss) - ref["loss"]) / abs(ref["loss"]),
        "logits": rel_err(logits[real], ref["logits"][real]),
        "padding logits": rel_err(logits[~real], ref["logits"][~real]) if (~real).any() else 0.0,
        "1 - cos(grads)": 1.0 - float(g @ g_ref / (np.linalg.norm(g) * np.linalg.norm(g_ref))),
        "grad norm ratio - 1": abs(float(np.linalg.norm(g) / np.linalg.norm(g_ref)) - 1.0),
        "audit": mpjax.audit(step, params, case.batch, case.key, compile=False),
        "param shapes": {tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(params)},
    }


# Bounds in units of the half dtype's machine epsilon (2**-10 for float16, 2**-7 for bfloat16),
# about 3-7x the largest error measured over the 3 models x 2 dtypes x data/init seeds 0-4
# (GPT-2's O3 float16 cases excluded: see its xfail):
#                  O1/O2 measured           O3 measured
#   loss           0.095 (BERT O2 bf16)     0.52  (eqx O3 f16)
#   logits         1.20  (BERT O2 f16)      2.09  (BERT O3 f16)
#   padding logits 0.94  (GPT-2 O2 f16)     1.15  (GPT-2 O3 bf16)
#   1 - cos(grads) 0.004 (GPT-2 O2 bf16)    0.0075 (GPT-2 O3 bf16)
#   |grad norm ratio - 1| 0.37 (BERT O2 bf16)  0.59 (BERT O3 f16)
BOUNDS = {
    "O1/O2": {
        "loss": 0.5,
        "logits": 4.0,
        "padding logits": 4.0,
        "1 - cos(grads)": 0.02,
        "grad norm ratio - 1": 1.5,
    },
    "O3": {
        "loss": 2.0,
        "logits": 6.0,
        "padding logits": 6.0,
        "1 - cos(grads)": 0.05,
        "grad norm ratio - 1": 2.0,
    },
}

MODELS = ["gpt2", "bert", "eqx"]

O3_F16_LAYERNORM = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="O3 is pure half (the levels guide): it runs LayerNorm's rsqrt(var + eps) and its "
    "derivative rsqrt(y) / y in float16, where Flax's own float16 LayerNorm keeps them in "
    "float32; y^-1.5 overflows once y < 6.1e-4, as GPT-2's 0.02-std embeddings reach: inf, "
    "then NaN, in the embedding gradients (keep_norm_fp32=True avoids it, tested below)",
)


def grid(model: str, levels=LEVELS, marks=None):
    marks = marks or {}
    return [
        pytest.param(model, lv, dt, id=f"{model}-{lv}-{dt}", marks=marks.get((lv, dt), ()))
        for lv in levels
        for dt in DTYPES
    ]


@pytest.mark.parametrize(
    "model,level,dtype",
    grid("gpt2", marks={("O3", "float16"): O3_F16_LAYERNORM}) + grid("bert") + grid("eqx"),
)
def test_loss_logits_and_gradients_match_float32(model, level, dtype):
    m = measured(model, level, dtype)
    not_finite = [name for name, ok in m["finite"].items() if not ok]
    assert not not_finite, f"non-finite {not_finite} at {level} {dtype}"
    bounds = BOUNDS["O3" if level == "O3" else "O1/O2"]
    errors = {name: m[name] / EPS[dtype] for name in bounds}
    too_far = {k: f"{v:.3f} eps > {bounds[k]}" for k, v in errors.items() if v > bounds[k]}
    assert not too_far, f"{model} at {level} {dtype} differs from float32: {too_far}"


def test_gpt2_o3_float16_with_keep_norm_fp32_matches_float32():
    # The levels guide's advice for the O3 float16 failure above: LayerNorm's statistics in float32
    # (measured over seeds 0-4: loss 0.38 eps, logits 0.91, padding logits 0.94, 1 - cos 0.001,
    # grad norm ratio 0.14).
    m = measured("gpt2", "O3", "float16", keep_norm_fp32=True)
    assert all(m["finite"].values()), m["finite"]
    for name, bound in BOUNDS["O3"].items():
        assert m[name] / EPS["float16"] <= bound, (name, m[name] / EPS["float16"])
    assert "rsqrt" not in {r.op for r in m["audit"].risks}
    m["audit"].assert_matmuls_in(jnp.float16)


# Forward matmuls of each program (GPT-2: per layer c_attn, q.k, weights.v, c_proj, c_fc,
# c_proj, and the tied head; BERT: per layer query, key, value, q.k, the head mask einsum,
# weights.v, three dense layers, and the pooler and classifier; Equinox-style: one scanned
# block's qkv, q.k, weights.v, out, gate, up, down, and the head). The train step adds one
# matmul per operand that needs a gradient: 39, 58 (BERT's int32 head mask needs none) and 24.
FORWARD_MATMULS = {"gpt2": 13, "bert": 20, "eqx": 8}


@pytest.mark.parametrize("model,level,dtype", grid("gpt2") + grid("bert") + grid("eqx"))
def test_every_matmul_of_the_train_step_runs_in_half(model, level, dtype):
    report = measured(model, level, dtype)["audit"]
    forward = FORWARD_MATMULS[model]
    assert 2 * forward <= len(report.matmuls) <= 3 * forward, str(report)
    report.assert_matmuls_in(jnp.dtype(dtype))
    assert report.half_flop_share == 1.0
    assert report.untouched == (), report.untouched


@pytest.mark.parametrize(
    "model,level,dtype",
    grid("gpt2", ["O1", "O2"]) + grid("bert", ["O1", "O2"]) + grid("eqx", ["O1", "O2"]),
)
def test_no_float32_list_op_runs_in_half_below_O3(model, level, dtype):
    got = measured(model, level, dtype)
    # A param's gradient sum (a bias's over the batch) runs in the policy's reduce dtype: half
    # by default, as the hand-written half step. Nothing else of the float32 list runs in half.
    risks = [
        r
        for r in got["audit"].risks
        if not (r.op == "reduce_sum" and r.dtype == dtype and r.shape in got["param shapes"])
    ]
    assert risks == [], [f"{r.op} {r.dtype}{list(r.shape)} at {r.name}" for r in risks]


def test_gpt2_batch_has_padding_on_both_sides_and_fully_masked_rows():
    batch = gpt2_batch(GPT2_SEED)
    mask = batch["attention_mask"]
    causal = make_causal_mask(jnp.ones((1, T), dtype="bool"), dtype="bool")
    combined = np.asarray(combine_masks(mask[:, None, None, :] > 0, causal))
    fully_masked = ~combined.any(axis=-1)[:, 0]  # [B, T]: queries that see no key
    assert fully_masked[2:].sum(axis=1).tolist() == [10, 13]  # the left-padded rows' pads
    assert not fully_masked[:2].any()
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 0).any()


# == the O3 float16 failure above, reduced =========================================================


def layernorm_input_gradient(module, x):
    cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    variables = nn.LayerNorm(epsilon=1e-5).init(jax.random.key(0), x)
    return jax.grad(lambda x: jnp.sum(module.apply(variables, x).astype(jnp.float32) * cot))(x)


SMALL_ACTIVATIONS = np.random.default_rng(0).normal(size=64).astype(np.float32) * 0.015


def test_reduced_flax_float16_layernorm_gradient_of_small_activations_is_finite():
    # Flax's own float16 LayerNorm computes its statistics and rsqrt in float32.
    g = layernorm_input_gradient(nn.LayerNorm(epsilon=1e-5, dtype=jnp.float16), SMALL_ACTIVATIONS)
    assert np.all(np.isfinite(g))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=O3_F16_LAYERNORM.kwargs["reason"])
def test_reduced_o3_float16_layernorm_gradient_of_small_activations_is_finite():
    wrapped = mpjax.flax.wrap(nn.LayerNorm(epsilon=1e-5), mpjax.Policy.from_level("O3", "float16"))
    assert np.all(np.isfinite(layernorm_input_gradient(wrapped, SMALL_ACTIVATIONS)))


# == FP8: every program that runs at O1/O2 runs with its dots in FP8 ==============================

# FP8's bounds against float32, relative (the FP8 guide states them, and
# tests/test_fp8_models.py holds its own models to them): E4M3 keeps 3 mantissa bits and E5M2
# 2. Measured on the second step (the first sets the scales) at O1 and O2, the largest of the
# three programs: loss 0.00065 (eqx O2), logits 0.064 (GPT-2 O2), 1 - cos(grads) 0.0046
# (GPT-2 O1), grad norm ratio 0.010 (eqx O2).
FP8_BOUNDS = {"loss": 0.03, "logits": 0.15, "1 - cos(grads)": 0.03, "grad norm ratio - 1": 0.06}


# Each program's FP8 sites: its forward matmuls whose sizes are multiples of 16 and that have
# no batch dimensions (attention's q.k and weights.v stay bfloat16 by default: FP8Policy's
# batched_dots). GPT-2: c_attn, c_proj, c_fc, c_proj per layer and the head (9); BERT: query,
# key, value and three dense per layer (12; not the pooler and the classifier, whose 4 rows
# and 2 labels are not multiples of 16); the Equinox-style one: qkv, out, gate, up, down and
# the head (6).
FP8_SITES = {"gpt2": 9, "bert": 12, "eqx": 6}


@functools.cache
def measured_fp8(model: str, level: str) -> dict[str, Any]:
    """The program with its dots in FP8 (mpjax.fp8, bfloat16 base): the HF models through
    mpjax.flax.wrap with the FP8 policy, the Equinox-style one as its float32 function."""
    import mpjax.fp8

    case = CASES[case_name(model, "bfloat16")]()
    ref = reference(model)
    pol = mpjax.fp8.policy(level, "bfloat16")
    wrapped = model != "eqx"
    params = case.init(pol if wrapped else None)
    loss = case.loss(pol if wrapped else None)
    state = mpjax.fp8.init(loss, pol, params, case.batch, case.key)
    grad_fn = mpjax.fp8.scaled_value_and_grad(loss, pol, has_aux=True)
    step = jax.jit(grad_fn, compiler_options=FAST_COMPILE)
    for _ in range(2):  # the first step sets the scales from its amaxes, the second runs at them
        (loss_value, (logits, _)), grads, state = step(state, params, case.batch, case.key)
    logits, g, g_ref = as64(logits), flat(grads), ref["grads"]
    real = case.real.reshape(case.real.shape + (1,) * (logits.ndim - case.real.ndim))
    real = np.broadcast_to(real, logits.shape)
    return {
        "sites": state.num_sites,
        "finite": bool(np.isfinite(float(loss_value)) and np.all(np.isfinite(g))),
        "loss": abs(float(loss_value) - ref["loss"]) / abs(ref["loss"]),
        "logits": rel_err(logits[real], ref["logits"][real]),
        "1 - cos(grads)": 1.0 - float(g @ g_ref / (np.linalg.norm(g) * np.linalg.norm(g_ref))),
        "grad norm ratio - 1": abs(float(np.linalg.norm(g) / np.linalg.norm(g_ref)) - 1.0),
        "audit": mpjax.audit(step, state, params, case.batch, case.key, compile=False),
    }


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp8_runs_the_corpus_as_float32_does(model, level):
    m = measured_fp8(model, level)
    assert m["sites"] == FP8_SITES[model], m["sites"]
    assert m["finite"]
    too_far = {k: f"{m[k]:.4f} > {b}" for k, b in FP8_BOUNDS.items() if m[k] > b}
    assert not too_far, f"{model} FP8 at {level} differs from float32: {too_far}"
    assert len(m["audit"].fp8_matmuls) >= m["sites"]
