"""How well ``type: auto``'s proxy ranks what quantizing one tensor costs, on the bundled model.

For a handful of (tensor, type) pairs it measures the KL divergence that quantizing that tensor
alone (every other tensor kept in float) adds to the float model's next-token distributions on
calibration windows, with our evaluation code (evalsuite/streamed.py, the weights streamed as
recipes score a variant), and sets it against the proxy the search ranks by
(recipes/type_search.py: ``proxy_errors``, the importance-weighted squared rounding error), and
against the second-order estimate from the Fisher diagonals of one forward and backward walk
(calib/output_fisher.py, what ``sensitivity: fisher`` ranks by). The pairs are the 7 projections
at the first, a middle and the last layer, and the token embedding (the head too, tied or not),
in 4 types. Prints every pair and Spearman's rank correlations, over all pairs and within one
type (which tensor hurts most: what trading bytes between tensors needs); docs/formats.md quotes
the result.

    python bench/auto_proxy.py [--model DIR] [--windows 4]

About two minutes on two cores for the bundled model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the pairs: each role at the first, a middle and the last layer, in types from 2 to 6 bits
ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TYPES = ("IQ2_XS", "Q3_K", "IQ4_XS", "Q6_K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "recipes" / "bundled" / "tiny")
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()

    import numpy as np
    from scipy.stats import spearmanr

    from calib.output_fisher import output_fisher
    from calib.text import token_windows
    from evalsuite.reference import ReferenceStore
    from evalsuite.streamed import streamed_scores
    from formats.hf import HFCheckpoint, load_tokenizer
    from formats.variant_weights import VariantWeights
    from quant.ggml import encode
    from recipes.importance import model_imatrix
    from recipes.type_search import proxy_errors

    ckpt = HFCheckpoint.open(args.model)
    windows = token_windows(load_tokenizer(ckpt), REPO / "recipes" / "bundled" / "calib.txt", 512, args.windows)
    imatrix = model_imatrix(ckpt, windows)
    n = ckpt.arch.layers
    names = [f"model.layers.{i}.{role}.weight" for role in ROLES for i in sorted({0, n // 2, n - 1})]
    names += [m for m in ("model.embed_tokens.weight", "lm_head.weight") if m in ckpt.names]
    fisher = output_fisher(ckpt, windows)
    proxies, klds, estimates = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "reference"
        streamed_scores(ckpt, windows, keep=reference)
        store = ReferenceStore(reference, windows)
        for name in names:
            # the embedding and the head have no importance matrix, without which llama.cpp makes no IQ2_XS
            types = TYPES if imatrix.get(name) is not None else tuple("Q2_K" if t == "IQ2_XS" else t for t in TYPES)
            for ggml_type, proxy in zip(types, proxy_errors(ckpt, name, types, imatrix)):
                alone = VariantWeights(Path(tmp) / f"{name}-{ggml_type}", ckpt)
                weight, importance = ckpt.tensor(name), imatrix.get(name)
                encoded = encode(weight, ggml_type, name, importance)
                alone.put(name, encoded)
                kld = streamed_scores(alone, windows, store).kld
                estimate = fisher.kld(name, weight.float() - encoded.dequantize().float(), importance)
                proxies.append(proxy)
                klds.append(kld)
                estimates.append(estimate)
                print(f"{name:40s} {ggml_type:7s} proxy {proxy:11.4e}  Fisher estimate {estimate:.3e}  added KLD {kld:.3e}",
                      flush=True)
    for label, values in (("proxy", proxies), ("Fisher estimate", estimates)):
        print(f"{len(klds)} pairs: Spearman rank correlation of the {label} and the added KL divergence "
              f"{spearmanr(values, klds).statistic:.3f}")
        for k, ggml_type in enumerate(TYPES):  # (the embedding's and head's Q2_K in IQ2_XS's place)
            picked = [i for i in range(len(klds)) if i % len(TYPES) == k]
            within = spearmanr([values[i] for i in picked], [klds[i] for i in picked]).statistic
            print(f"  within {ggml_type} (which tensor hurts most): {within:.3f}")
    ratios = np.array(estimates) / np.array(klds)
    print(f"Fisher estimate / measured: median {np.median(ratios):.2f}, middle half {np.quantile(ratios, 0.25):.2f}-"
          f"{np.quantile(ratios, 0.75):.2f}")


if __name__ == "__main__":
    main()
