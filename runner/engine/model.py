"""Our forward pass of the Llama family (Llama, Mistral, Qwen2), over a step's flat batch of tokens.

A step's tokens, from every scheduled sequence, run through each layer together as one
``[tokens, hidden]`` matrix; only attention looks at which sequence a token belongs to, and it
reads keys and values through the sequences' block tables:

- decode tokens (one new token of a sequence) attend block by block: the blocks of all decoding
  sequences are gathered into one batch, scored against their sequence's query, and a softmax
  across each sequence's blocks (a segment max and sum by scatter) combines them, so sequences of
  different lengths run together without padding to the longest (only a last block is partly
  empty);
- prefill chunks (several new tokens of a sequence) attend to the sequence's cached keys and to
  each other in one masked attention over the chunks of the step, causal within each sequence.

No Python loop over sequences runs inside a layer. Norms and softmax are computed in float32, the
rest in the weights' dtype, as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from formats.hf import HFCheckpoint
from formats.quantized_checkpoint import QuantizedCheckpoint
from quant.types import Architecture, InputError
from runner.engine.kv_cache import KVPool
from runner.engine.linear import Linear, fused, make_linear

RUNNABLE = ("llama", "mistral", "qwen2")


@dataclass
class DecodeBatch:
    """The step's decoding sequences, as blocks: ``rows`` are their tokens' rows in the step;
    block ``i`` (``ids[i]``) belongs to decoding sequence ``owner[i]`` and holds keys at positions
    ``first[i] .. first[i] + block_size - 1``, of which those below ``length[owner[i]]`` exist."""

    rows: torch.Tensor
    ids: torch.Tensor
    owner: torch.Tensor
    first: torch.Tensor
    length: torch.Tensor  # per decoding sequence: its keys, the new one included
    _per_window: dict = field(default_factory=dict, repr=False)

    def scores_bias(self, window: int | None, block_size: int, kv: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """What every layer with this ``window`` adds to its scores, [blocks * kv, groups, block_size]:
        0 where the block's key exists and is in the window, -inf elsewhere. Made once a step."""
        if window not in self._per_window:
            pos = self.first[:, None] + torch.arange(block_size, device=self.ids.device)
            last = self.length[self.owner][:, None] - 1
            hidden = pos > last
            if window is not None:
                hidden |= pos <= last - window
            bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
            self._per_window[window] = bias[:, None, None, :].expand(-1, kv, groups, -1).reshape(-1, groups, block_size)
        return self._per_window[window]


@dataclass
class PrefillBatch:
    """The step's prefill chunks, one row each, padded to the longest chunk and the longest key
    list: ``rows[b, i]`` is the step row of chunk ``b``'s token ``i``; ``key_slots[b, j]`` the
    cache slot of its sequence's key ``j`` (cached prefix, then the chunk itself); ``mask[b, i, j]``
    whether token ``i`` sees key ``j`` (causal, within any sliding window, never padding: a padded
    token sees key 0 only, its output unused); ``valid[b, i]`` which tokens are real."""

    rows: torch.Tensor
    key_slots: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    valid: torch.Tensor


@dataclass
class Step:
    """One forward pass: the tokens, their positions and cache slots, the two attention batches,
    and the rows whose next-token logits are wanted."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    sample_rows: torch.Tensor


def inverse_frequencies(arch: Architecture) -> torch.Tensor:
    """The rotary frequencies, float32, computed as transformers computes them (default, linear and
    Llama-3 scaling)."""
    rope, dim = arch.rope, arch.rope.dims
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling == "default":
        return inv
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        low_wavelen, high_wavelen = rope.original_context / rope.low_freq_factor, rope.original_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise InputError(f"rope type '{rope.scaling}': the engine runs default, linear and llama3 rope")


class DecoderModel:
    """A causal LM's weights, loaded tensor by tensor from a checkpoint, and its forward pass."""

    def __init__(self, ckpt: HFCheckpoint | QuantizedCheckpoint, dtype: torch.dtype, device: torch.device):
        arch = ckpt.arch
        if arch.model_type not in RUNNABLE:
            raise InputError(f"{ckpt.path}: model_type '{arch.model_type}' is not one the engine runs "
                             f"(it runs {', '.join(RUNNABLE)})")
        self.arch, self.dtype, self.device = arch, dtype, device

        def load(name: str) -> torch.Tensor:
            return ckpt.tensor(name).to(device=device, dtype=dtype)

        def linear(*modules: str) -> list[Linear]:
            """One layer for the modules (fused where they stack), called once; the outputs split."""
            weights = [ckpt.payload(f"{m}.weight") for m in modules]
            biases = [ckpt.tensor(f"{m}.bias") if f"{m}.bias" in ckpt.names else None for m in modules]
            stacked = fused(weights, biases) if len(modules) > 1 else (weights[0], biases[0])
            if stacked is None:
                return [make_linear(w, b, dtype, device) for w, b in zip(weights, biases)]
            return [make_linear(*stacked, dtype, device)]

        self.embed = load("model.embed_tokens.weight")
        self.layers = []
        for i in range(arch.layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "attn_norm": load(p + "input_layernorm.weight"), "mlp_norm": load(p + "post_attention_layernorm.weight"),
                "qkv": linear(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                "o": linear(p + "self_attn.o_proj"),
                "gate_up": linear(p + "mlp.gate_proj", p + "mlp.up_proj"),
                "down": linear(p + "mlp.down_proj"),
            })
        kv = arch.kv_heads[0]
        self._qkv_sizes = [arch.heads * arch.head_dim, kv * arch.head_dim, kv * arch.value_dim]
        self._gate_up = [arch.intermediate, arch.intermediate]
        self.norm = load("model.norm.weight")
        # A tied head multiplies by the embedding itself (a packed copy would double its memory).
        self.lm_head = Linear(self.embed, None) if "lm_head.weight" not in ckpt.names else \
            make_linear(ckpt.payload("lm_head.weight"), None, dtype, device)
        self.inv_freq = inverse_frequencies(arch).to(device)
        self.scale = arch.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, step: Step, pool: KVPool) -> torch.Tensor:
        """Next-token logits, float32, for ``step.sample_rows``; writes the step's keys and values."""
        a = self.arch
        x = torch.index_select(self.embed, 0, step.tokens)
        rotary = self._rotary(step.positions)
        only_decode = step.prefill is None  # then the decode rows are the step's rows, in order
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer["qkv"], self._norm(x, layer["attn_norm"]), rotary)
            pool.write(index, step.slots, k, v)
            q = pool.queries(q)
            window = a.windows[index]
            if only_decode:
                out = self._decode_attention(q, pool, index, step.decode, window)
            else:
                out = torch.empty(q.shape[0], a.heads, a.value_dim, dtype=torch.float32, device=x.device)
                if step.decode is not None:
                    out[step.decode.rows] = self._decode_attention(q[step.decode.rows], pool, index, step.decode, window)
                out[step.prefill.rows[step.prefill.valid]] = self._prefill_attention(q, pool, index, step.prefill, window)
            x = x + layer["o"][0](pool.outputs(out).to(x.dtype).flatten(1))
            gate, up = _outputs(layer["gate_up"], self._norm(x, layer["mlp_norm"]), self._gate_up)
            x = x + layer["down"][0](F.silu(gate) * up)
        x = self._norm(torch.index_select(x, 0, step.sample_rows), self.norm)
        return self.lm_head(x).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, as transformers' LlamaRMSNorm (torch's fused kernel computes it so)."""
        return weight * torch.rms_norm(x, (x.shape[-1],), eps=self.arch.norm_eps)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, 1, dim]; sin's first half negated, so that
        ``x * cos + roll(x, dim / 2) * sin`` is transformers' ``x * cos + rotate_half(x) * sin``."""
        freqs = positions[:, None].float() * self.inv_freq
        sin = freqs.sin()
        return torch.cat((freqs, freqs), -1).cos().to(self.dtype)[:, None], torch.cat((-sin, sin), -1).to(self.dtype)[:, None]

    def _qkv(self, layers: list[Linear], h: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys, rotated, and values, [tokens, heads, dim]: with one fused product and
        equal head sizes, queries and keys are rotated together."""
        a, kv = self.arch, self.arch.kv_heads[0]
        if len(layers) == 1 and a.value_dim == a.head_dim:
            qkv = layers[0](h).view(h.shape[0], a.heads + 2 * kv, a.head_dim)
            qk = _rotate(qkv[:, : a.heads + kv], *rotary)
            return qk[:, : a.heads], qk[:, a.heads :], qkv[:, a.heads + kv :]
        q, k, v = _outputs(layers, h, self._qkv_sizes)
        q, k = q.view(-1, a.heads, a.head_dim), k.view(-1, kv, a.head_dim)
        return _rotate(q, *rotary), _rotate(k, *rotary), v.view(-1, kv, a.value_dim)

    def _decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, d: DecodeBatch, window: int | None) -> torch.Tensor:
        a, bs = self.arch, pool.block_size
        kv, groups = a.kv_heads[0], a.heads // a.kv_heads[0]
        keys, values = pool.blocks(layer, d.ids)  # [blocks, kv, bs, dim], as the pool lays them out
        nb, n = d.ids.numel(), d.length.numel()
        # rows picked by index_select: at a step's hundreds of blocks, several times as fast as q[owner]
        qb = torch.index_select(q.view(-1, kv, groups, a.head_dim), 0, d.owner)  # [blocks, kv, groups, dim]
        bias = d.scores_bias(window, bs, kv, groups, keys.dtype)
        scores = torch.baddbmm(bias, qb.view(nb * kv, groups, a.head_dim), keys.view(nb * kv, bs, a.head_dim).transpose(1, 2),
                               alpha=self.scale).view(nb, kv, groups, bs).float()
        index = d.owner.view(-1, 1, 1).expand(-1, kv, groups)
        top = torch.full((n, kv, groups), float("-inf"), device=q.device).scatter_reduce_(0, index, scores.amax(-1), "amax")
        weights = torch.exp(scores - torch.index_select(top, 0, d.owner)[..., None])
        total = torch.zeros_like(top).index_add_(0, d.owner, weights.sum(-1))
        weighted = torch.bmm(weights.to(values.dtype).view(nb * kv, groups, bs), values.view(nb * kv, bs, a.value_dim))
        out = torch.zeros(n, kv, groups, a.value_dim, device=q.device).index_add_(0, d.owner, weighted.view(nb, kv, groups, -1).float())
        return (out / total[..., None]).view(n, a.heads, a.value_dim)

    def _prefill_attention(self, q: torch.Tensor, pool: KVPool, layer: int, p: PrefillBatch, window: int | None) -> torch.Tensor:
        """The chunks' outputs, [real chunk tokens, heads, value_dim], in ``rows[valid]`` order."""
        keys, values = pool.slots(layer, p.key_slots)  # [chunks, keys, kv, dim]
        mask = p.key_pos[:, None, :] <= p.query_pos[:, :, None]
        if window is not None:
            mask &= p.key_pos[:, None, :] > p.query_pos[:, :, None] - window
        mask |= ~p.valid[:, :, None] & (torch.arange(mask.shape[-1], device=q.device) == 0)  # padding sees key 0
        out = F.scaled_dot_product_attention(
            q[p.rows].float().transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2),
            attn_mask=mask[:, None], scale=self.scale, enable_gqa=True,
        )  # [chunks, heads, tokens, dim]
        return out.transpose(1, 2)[p.valid]


def _outputs(layers: list[Linear], x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The outputs of modules that read ``x``: one fused product split, or one product each."""
    if len(layers) == 1:
        return list(layers[0](x).split(sizes, -1))
    return [layer(x) for layer in layers]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x`` [tokens, heads, dim] with transformers' half-split pairs (``sin``
    as ``_rotary`` makes it)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
