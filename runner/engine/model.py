"""Our forward pass of the Llama family (Llama, Mistral, Qwen2 and Qwen3, Gemma 2 and 3, Phi-3), over
a step's flat batch of tokens; what sets the members apart (Gemma's norms, scales, soft-caps and
local rope, q/k norms, fused projections) is read off the one architecture description.

A step's tokens, from every scheduled sequence, run through each layer together as one
``[tokens, hidden]`` matrix; only attention looks at which sequence a token belongs to, and it
reads keys and values through the sequences' block tables:

- decode rows (a sequence's one new token, or the few a speculative step verifies) attend block by
  block: the blocks of all decoding sequences are gathered into one batch, each scored against
  all of its sequence's queries at once, and a softmax across each sequence's blocks (a segment
  max and sum by scatter) combines them, so sequences of different lengths run together without
  padding to the longest (only a last block is partly empty), and a verify step's rows go through
  the kernels of a decode step's; on CUDA with a float or fp8 cache, one fused Triton kernel
  (kernels/paged_attention.py) reads the blocks where they lie through the block table instead;
- prefill chunks (a prompt's tokens) attend to the sequence's cached keys and to each other in one
  masked attention over the chunks of the step, causal within each sequence.

No Python loop over sequences runs inside a layer. Norms and softmax are computed in float32, the
rest in the weights' dtype, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.architecture import RUNS_IN_ENGINE, Rope
from core.errors import InputError
from core.rope import llama3_bands
from formats.hf import HFCheckpoint
from formats.quantized_checkpoint import QuantizedCheckpoint
from runner.engine.kernels import cpu_norm, decode_kernel
from runner.engine.kv_cache import KVPool
from runner.engine.linear import Linear, fused, make_linear

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class DecodeBatch:
    """The step's decoding sequences, as blocks: sequence ``j`` has ``m`` query rows, step rows
    ``rows[j]``, of which ``valid[j]`` are real (None: all are; a sequence with fewer rows repeats
    its last); block ``i`` (``ids[i]``) belongs to sequence ``owner[i]`` and holds keys at positions
    ``first[i] .. first[i] + block_size - 1``, of which query row ``r`` sees those below
    ``length[owner[i], r]`` (causal within a sequence's rows)."""

    rows: torch.Tensor  # [sequences, m]
    valid: torch.Tensor | None  # [sequences, m]
    ids: torch.Tensor | None  # the blocks (None where the fused kernel reads the table instead)
    owner: torch.Tensor | None
    first: torch.Tensor | None
    length: torch.Tensor  # [sequences, m]: the keys each row sees, its own included
    table: torch.Tensor  # [sequences, blocks]: each sequence's block table (padded), for the fused kernel
    _per_window: dict = field(default_factory=dict, repr=False)

    def scores_bias(self, window: int | None, block_size: int, kv: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """What every layer with this ``window`` adds to its scores, [blocks * kv, m * groups, block_size]:
        0 where the block's key exists for the row and is in its window, -inf elsewhere. Made once a step."""
        if window not in self._per_window:
            pos = (self.first[:, None] + torch.arange(block_size, device=self.ids.device))[:, None, :]
            last = torch.index_select(self.length, 0, self.owner)[..., None] - 1  # [blocks, m, 1]
            hidden = pos > last
            if window is not None:
                hidden |= pos <= last - window
            bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
            m = self.length.shape[1]
            self._per_window[window] = bias[:, None, :, None, :].expand(-1, kv, m, groups, -1).reshape(-1, m * groups, block_size)
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


def inverse_frequencies(rope: Rope) -> torch.Tensor:
    """The rotary frequencies, float32, computed as transformers computes them (default, linear and
    Llama-3 scaling)."""
    dim = rope.dims
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling == "default":
        return inv
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        short, long, smooth = llama3_bands(rope, 2 * math.pi / inv)
        scaled = torch.where(long, inv / rope.factor, inv)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        return torch.where(~short * ~long, smoothed, scaled)
    raise InputError(f"rope type '{rope.scaling}': the engine runs default, linear and llama3 rope")


class DecoderModel:
    """A causal LM's weights, loaded tensor by tensor from a checkpoint, and its forward pass."""

    def __init__(self, ckpt: HFCheckpoint | QuantizedCheckpoint, dtype: torch.dtype, device: torch.device):
        arch = ckpt.arch
        if arch.model_type not in RUNS_IN_ENGINE:
            raise InputError(f"{ckpt.path}: model_type '{arch.model_type}' is not one the engine runs "
                             f"(it runs {', '.join(RUNS_IN_ENGINE)})")
        if arch.activation not in ACTIVATIONS:
            raise InputError(f"{ckpt.path}: activation '{arch.activation}' is not one the engine runs "
                             f"(it runs {', '.join(ACTIVATIONS)})")
        self.arch, self.dtype, self.device = arch, dtype, device
        self.act = ACTIVATIONS[arch.activation]

        def load(name: str) -> torch.Tensor:
            return ckpt.tensor(name).to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            """A norm's weight; Gemma's (offset + weight) kept in float32, where transformers computes it."""
            if arch.norm_offset:
                return ckpt.tensor(name).to(device=device, dtype=torch.float32) + arch.norm_offset
            return load(name)

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
            attn, mlp = ("self_attn.qkv_proj",), ("mlp.gate_up_proj",)
            if not arch.fused_projections:
                attn, mlp = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")
            layer = {
                "attn_norm": norm(p + "input_layernorm.weight"),
                "qkv": linear(*(p + m for m in attn)),
                "o": linear(p + "self_attn.o_proj"),
                "gate_up": linear(*(p + m for m in mlp)),
                "down": linear(p + "mlp.down_proj"),
            }
            if arch.post_norms:  # Gemma's post_attention_layernorm norms the attention's output
                layer.update(attn_post=norm(p + "post_attention_layernorm.weight"),
                             mlp_norm=norm(p + "pre_feedforward_layernorm.weight"),
                             mlp_post=norm(p + "post_feedforward_layernorm.weight"))
            else:
                layer["mlp_norm"] = norm(p + "post_attention_layernorm.weight")
            if arch.qk_norm:
                layer.update(q_norm=norm(p + "self_attn.q_norm.weight"), k_norm=norm(p + "self_attn.k_norm.weight"))
            self.layers.append(layer)
        kv = arch.kv_heads[0]
        self._qkv_sizes = [arch.heads * arch.head_dim, kv * arch.head_dim, kv * arch.value_dim]
        self._gate_up = [arch.intermediate, arch.intermediate]
        self.norm = norm("model.norm.weight")
        # A tied head multiplies by the embedding: on a CPU by a packed copy of it (the embedding's
        # memory twice, for a head product 3x as fast as an unpacked bf16 one), elsewhere by itself.
        head = self.embed if "lm_head.weight" not in ckpt.names else ckpt.payload("lm_head.weight")
        self.lm_head = make_linear(head, None, dtype, device)
        self.inv_freq = {rope: inverse_frequencies(rope).to(device) for rope in {arch.rope_of(i) for i in range(arch.layers)}}
        self.scale = arch.score_scale
        self.embed_scale = torch.tensor(arch.embedding_scale, dtype=dtype, device=device)  # as transformers rounds it
        # Gemma's (offset + weight) norms in float32 stay with torch
        self._fused_norm = device.type == "cpu" and not arch.norm_offset and cpu_norm.available(dtype)

    @torch.inference_mode()
    def forward(self, step: Step, pool: KVPool, logit_rows: int | None = None):
        """Next-token logits, float32, for ``step.sample_rows``; writes the step's keys and values.
        With ``logit_rows``, logits for the first that many of those rows only, and the final
        norm's output for the rest, for ``head`` to turn into logits a slice at a time (a prompt
        scored whole would otherwise make rows x vocabulary floats at once)."""
        a = self.arch
        x = torch.index_select(self.embed, 0, step.tokens)
        if a.embedding_scale != 1.0:
            x = x * self.embed_scale
        rotary = {rope: self._rotary(step.positions, inv) for rope, inv in self.inv_freq.items()}
        d = step.decode
        in_order = step.prefill is None and d.valid is None  # then the decode rows are the step's rows, in order
        kernel = _fused_kernel(pool)
        where = pool.where(step.slots)
        key_rows = pool.where(step.prefill.key_slots.flatten()) if step.prefill is not None else None  # read by every layer
        delta = None  # what the last block adds to x, added by the next norm
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._add_norm(x, delta, layer["attn_norm"]), rotary[a.rope_of(index)])
            pool.write(index, where, k, v)
            q = pool.queries(q)
            window = a.windows[index]
            if in_order:
                out = self._decode_attention(q, pool, index, d, window, kernel)
            else:
                out = torch.empty(q.shape[0], a.heads, a.value_dim, dtype=torch.float32, device=x.device)
                if d is not None:
                    rows = d.rows.flatten()
                    attended = self._decode_attention(torch.index_select(q, 0, rows), pool, index, d, window, kernel)
                    if d.valid is None:
                        out[rows] = attended
                    else:
                        out[d.rows[d.valid]] = attended[d.valid.flatten()]
                if step.prefill is not None:
                    out[step.prefill.rows[step.prefill.valid]] = self._prefill_attention(q, pool, index, step.prefill, window, key_rows)
            attended = layer["o"][0](pool.outputs(out).to(x.dtype).flatten(1))
            delta = self._norm(attended, layer["attn_post"]) if a.post_norms else attended
            gate, up = _outputs(layer["gate_up"], self._add_norm(x, delta, layer["mlp_norm"]), self._gate_up)
            mlp = layer["down"][0](self.act(gate) * up)
            delta = self._norm(mlp, layer["mlp_post"]) if a.post_norms else mlp
        rows = step.sample_rows
        x = self._add_norm(torch.index_select(x, 0, rows), torch.index_select(delta, 0, rows), self.norm)
        if logit_rows is None:
            return self.head(x)
        return self.head(x[:logit_rows]), x[logit_rows:]

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, float32, of rows of the final norm's output."""
        logits = self.lm_head(x).float()
        return _softcap(logits, self.arch.final_softcap) if self.arch.final_softcap else logits

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x`` with ``delta`` added in place (where there is one), normed: in
        one pass by the C kernel on a CPU (kernels/cpu_norm.c says why), else by torch."""
        if self._fused_norm:
            return cpu_norm.add_rms_norm(x, delta, weight, self.arch.norm_eps)
        if delta is not None:
            x.add_(delta)
        return self._norm(x, weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, as transformers' LlamaRMSNorm (torch's fused kernel computes it so);
        Gemma's float32 (offset + weight) scales it before the cast back, as its own RMSNorm does."""
        if self.arch.norm_offset:
            return (torch.rms_norm(x.float(), (x.shape[-1],), eps=self.arch.norm_eps) * weight).to(x.dtype)
        return weight * torch.rms_norm(x, (x.shape[-1],), eps=self.arch.norm_eps)

    def _rotary(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, 1, dim]; sin's first half negated, so that
        ``x * cos + roll(x, dim / 2) * sin`` is transformers' ``x * cos + rotate_half(x) * sin``."""
        freqs = positions[:, None].float() * inv_freq
        sin = freqs.sin()
        return torch.cat((freqs, freqs), -1).cos().to(self.dtype)[:, None], torch.cat((-sin, sin), -1).to(self.dtype)[:, None]

    def _qkv(self, layer: dict, h: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys, normed where the model norms them and rotated, and values,
        [tokens, heads, dim]: with one fused product and equal head sizes, queries and keys are
        rotated together."""
        a, kv, layers = self.arch, self.arch.kv_heads[0], layer["qkv"]
        if len(layers) == 1 and a.value_dim == a.head_dim and not a.qk_norm:
            qkv = layers[0](h).view(h.shape[0], a.heads + 2 * kv, a.head_dim)
            qk = _rotate(qkv[:, : a.heads + kv], *rotary)
            return qk[:, : a.heads], qk[:, a.heads :], qkv[:, a.heads + kv :]
        q, k, v = _outputs(layers, h, self._qkv_sizes)
        q, k = q.view(-1, a.heads, a.head_dim), k.view(-1, kv, a.head_dim)
        if a.qk_norm:
            q, k = self._norm(q, layer["q_norm"]), self._norm(k, layer["k_norm"])
        return _rotate(q, *rotary), _rotate(k, *rotary), v.view(-1, kv, a.value_dim)

    def _decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, d: DecodeBatch, window: int | None,
                          kernel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """The decode rows' outputs, [sequences * m, heads, value_dim], from their queries in ``rows``
        order: by the paged ``kernel`` where there is one, else by torch over the gathered blocks."""
        if kernel is None:
            return self._gathered_attention(q, pool, layer, d, window)
        a, (n, m) = self.arch, d.length.shape
        keys, values = pool.stored(layer)
        out = kernel(q.view(n, m, a.heads, a.head_dim), keys, values, d.table, d.length, self.scale, window,
                     a.attn_softcap or None)
        return out.view(n * m, a.heads, a.value_dim)

    def _gathered_attention(self, q: torch.Tensor, pool: KVPool, layer: int, d: DecodeBatch,
                            window: int | None) -> torch.Tensor:
        """``_decode_attention`` by torch: the step's blocks gathered into one batch and scored
        block by block, a softmax across each sequence's blocks combining them."""
        a, bs = self.arch, pool.block_size
        kv, groups = a.kv_heads[0], a.heads // a.kv_heads[0]
        n, m = d.length.shape
        width = m * groups  # the queries each block is scored against, per key-value head
        keys, values = pool.blocks(layer, d.ids)  # [blocks, kv, bs, dim], as the pool lays them out
        nb = d.ids.numel()
        rows = q.view(n, m, kv, groups, a.head_dim)
        if m > 1:
            rows = rows.transpose(1, 2)  # a sequence's rows side by side under each key-value head
        # rows picked by index_select: at a step's hundreds of blocks, several times as fast as q[owner]
        qb = torch.index_select(rows.reshape(n, kv, width, a.head_dim), 0, d.owner)  # [blocks, kv, m * groups, dim]
        bias = d.scores_bias(window, bs, kv, groups, keys.dtype)
        q_rows, k_rows = qb.view(nb * kv, width, a.head_dim), keys.view(nb * kv, bs, a.head_dim).transpose(1, 2)
        if a.attn_softcap:  # capped before the mask is added
            scores = _softcap(torch.bmm(q_rows, k_rows).float() * self.scale, a.attn_softcap) + bias.float()
        else:
            scores = torch.baddbmm(bias, q_rows, k_rows, alpha=self.scale)
        scores = scores.view(nb, kv, width, bs).float()
        index = d.owner.view(-1, 1, 1).expand(-1, kv, width)
        top = torch.full((n, kv, width), float("-inf"), device=q.device).scatter_reduce_(0, index, scores.amax(-1), "amax")
        weights = torch.exp(scores - torch.index_select(top, 0, d.owner)[..., None])
        total = torch.zeros_like(top).index_add_(0, d.owner, weights.sum(-1))
        weighted = torch.bmm(weights.to(values.dtype).view(nb * kv, width, bs), values.view(nb * kv, bs, a.value_dim))
        out = torch.zeros(n, kv, width, a.value_dim, device=q.device).index_add_(0, d.owner, weighted.view(nb, kv, width, -1).float())
        out = (out / total[..., None]).view(n, kv, m, groups, a.value_dim)
        if m > 1:
            out = out.transpose(1, 2)
        return out.reshape(n * m, a.heads, a.value_dim)

    def _prefill_attention(self, q: torch.Tensor, pool: KVPool, layer: int, p: PrefillBatch, window: int | None,
                           key_rows: torch.Tensor) -> torch.Tensor:
        """The chunks' outputs, [real chunk tokens, heads, value_dim], in ``rows[valid]`` order
        (``key_rows``: ``pool.where`` of the chunks' key slots)."""
        keys, values = pool.slots(layer, key_rows, p.key_slots.shape)  # [chunks, keys, kv, dim]
        mask = p.key_pos[:, None, :] <= p.query_pos[:, :, None]
        if window is not None:
            mask &= p.key_pos[:, None, :] > p.query_pos[:, :, None] - window
        mask |= ~p.valid[:, :, None] & (torch.arange(mask.shape[-1], device=q.device) == 0)  # padding sees key 0
        queries, keys, values = q[p.rows].float().transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2)
        if self.arch.attn_softcap:  # no fused kernel caps scores: the same attention, written out
            groups = self.arch.heads // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            scores = _softcap(queries @ keys.transpose(-1, -2) * self.scale, self.arch.attn_softcap)
            out = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ values
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None], scale=self.scale,
                                                 enable_gqa=True)  # [chunks, heads, tokens, dim]
        return out.transpose(1, 2)[p.valid]


def _fused_kernel(pool: KVPool) -> Callable[..., torch.Tensor] | None:
    """The paged decode-attention kernel for the pool (Triton on CUDA, C on a CPU), else None."""
    return decode_kernel(pool.device, pool.cache, (pool.keys.codes.shape[-1], pool.values.codes.shape[-1]))


def _outputs(layers: list[Linear], x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The outputs of modules that read ``x``: one fused product split, or one product each."""
    if len(layers) == 1:
        return list(layers[0](x).split(sizes, -1))
    return [layer(x) for layer in layers]


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft cap: ``cap * tanh(x / cap)``, near x for small x, never beyond ``cap``."""
    return torch.tanh(x / cap) * cap


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x`` [tokens, heads, dim] with transformers' half-split pairs (``sin``
    as ``_rotary`` makes it)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
