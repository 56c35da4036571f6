"""A model's next-token distributions in a form that fits on disk: per position, the ``k`` most
likely tokens' log-probabilities and the log of the probability left to all the others, as
llama.cpp's KL-divergence base file keeps the original's. With ``k`` equal to the vocabulary the
form is exact.

The KL divergence from such a distribution is taken over those ``k + 1`` outcomes. It never exceeds
the full divergence (merging outcomes loses information) and equals it where the reference's tail
beyond the top ``k`` is spread as the other model spreads it; the top-1 token is exact at any ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopK:
    """``[..., k]`` token ids (int32) and their log-probabilities, and ``[...]`` log(1 - Σ p)."""

    ids: torch.Tensor
    logp: torch.Tensor
    rest: torch.Tensor

    @classmethod
    def of(cls, logp: torch.Tensor, k: int) -> "TopK":
        """The top ``k`` of full log-probabilities ``[..., vocab]``."""
        top = logp.topk(min(k, logp.shape[-1]), -1)
        return cls(top.indices.to(torch.int32), top.values, log_rest(top.values))

    @classmethod
    def cat(cls, parts: list["TopK"]) -> "TopK":
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logp", "rest")))

    def __getitem__(self, index) -> "TopK":
        """The positions (or windows) ``index`` selects, as ``tensor[index]`` would."""
        return TopK(self.ids[index], self.logp[index], self.rest[index])

    def to(self, device: torch.device | str) -> "TopK":
        return TopK(self.ids.to(device), self.logp.to(device), self.rest.to(device))

    def kl(self, logq: torch.Tensor) -> torch.Tensor:
        """``[...]`` KL(self ‖ q) per position, for another model's full log-probabilities ``logq``."""
        q = logq.gather(-1, self.ids.long())
        return (self.logp.exp() * (self.logp - q)).sum(-1) + self.rest.exp() * (self.rest - log_rest(q))

    def top1(self) -> torch.Tensor:
        return self.ids[..., 0].long()

    def tensors(self) -> dict[str, torch.Tensor]:
        """As a safetensors file holds it."""
        return {"ids": self.ids, "logp": self.logp, "rest": self.rest}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "TopK":
        return cls(tensors["ids"], tensors["logp"], tensors["rest"])


def log_rest(top_logp: torch.Tensor) -> torch.Tensor:
    """log(1 - Σ p) over the top-k, kept finite where the top-k hold all the mass."""
    return torch.log1p(-torch.logsumexp(top_logp, -1).exp().clamp(max=1 - 1e-6))
