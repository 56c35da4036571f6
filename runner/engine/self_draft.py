"""Self-speculation's draft: the loaded model itself, its decoder layers' Linear weights rounded to a
few bits in memory (``--speculative self=int4``).

The draft needs no second checkpoint and no tokenizer check: it is the target's own network, so it
shares the tokenizer by construction, and it agrees with the target wherever rounding its weights
does not change the argmax, which at 4 bits is most tokens. It runs on the engine's low-bit kernels
(int4 groups on torch's packed kernels), so a draft step reads about a quarter of a target step's
weight bytes. It computes in bf16 whatever the target's dtype: the kernels are fast there (torch's
CPU int4 kernel in fp32 runs several times slower than in bf16), and every guess is checked by the
target, so the draft's precision changes how many are kept, never the output. The embedding table,
the output head and the final norm are not rounded: a bf16 target's draft uses the target's own
tensors, with no copy; an fp32 target's holds bf16 copies (half their size).
"""

from __future__ import annotations

import re

import torch

from core.schemes import QuantSpec
from core.tensors import TensorPayload, dequantized
from quant.rtn import quantize_rtn

LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
GROUP_SIZES = (128, 64, 32)  # the widest that divides a weight's inputs, within the int4 kernels' groups


class LowBitView:
    """A checkpoint as the draft sees it: every decoder layer's Linear weight rounded to ``bits``
    (asymmetric; 8 bits per output channel, as the int8 kernel takes them; fewer by groups of 128
    inputs, or 64 or 32 where 128 does not divide them, per channel where none does), everything
    else as stored."""

    def __init__(self, ckpt, bits: int):
        self._ckpt, self.bits = ckpt, bits

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def payload(self, name: str) -> TensorPayload:
        stored = self._ckpt.payload(name)
        if not LAYER_LINEAR.fullmatch(name):
            return stored
        weight = dequantized(stored).float()
        group = None if self.bits == 8 else next((g for g in GROUP_SIZES if weight.shape[1] % g == 0), None)
        spec = QuantSpec(self.bits, symmetric=False, granularity="group" if group else "channel", group_size=group)
        return quantize_rtn(weight, spec, name)


DRAFT_DTYPE = torch.bfloat16


def share_unrounded(draft, target) -> None:
    """Point the draft's embedding table, output head and final norm at the target's tensors where
    both compute in the same dtype, so that self-speculation holds one copy of them."""
    if draft.dtype == target.dtype:
        draft.embed, draft.lm_head, draft.norm = target.embed, target.lm_head, target.norm

