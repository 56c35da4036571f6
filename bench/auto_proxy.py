"""How well ``type: auto``'s proxy ranks what quantizing one tensor costs, on the bundled model.

For a handful of (tensor, type) pairs it measures the KL divergence that quantizing that tensor
alone (every other tensor kept in float) adds to the float model's next-token distributions on
calibration windows, with our evaluation code (evalsuite/streamed.py, the weights streamed as
recipes score a variant), and sets it against the proxy the search ranks by
(recipes/type_search.py: ``proxy_errors``, the importance-weighted squared rounding error).
Prints every pair and Spearman's rank correlation; docs/formats.md quotes the result.

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

    from scipy.stats import spearmanr

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
    proxies, klds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "reference"
        streamed_scores(ckpt, windows, keep=reference)
        store = ReferenceStore(reference, windows)
        for name in names:
            for ggml_type, proxy in zip(TYPES, proxy_errors(ckpt, name, TYPES, imatrix)):
                alone = VariantWeights(Path(tmp) / f"{name}-{ggml_type}", ckpt)
                alone.put(name, encode(ckpt.tensor(name), ggml_type, name, imatrix.get(name)))
                kld = streamed_scores(alone, windows, store).kld
                proxies.append(proxy)
                klds.append(kld)
                print(f"{name:40s} {ggml_type:7s} proxy {proxy:11.4e}  added KLD {kld:.3e}", flush=True)
    rho = spearmanr(proxies, klds).statistic
    print(f"{len(klds)} pairs: Spearman rank correlation of proxy and added KL divergence {rho:.3f}")
    for ggml_type in TYPES:
        picked = [i for i in range(len(klds)) if i % len(TYPES) == TYPES.index(ggml_type)]
        within = spearmanr([proxies[i] for i in picked], [klds[i] for i in picked]).statistic
        print(f"  within {ggml_type} (which tensor hurts most): {within:.3f}")


if __name__ == "__main__":
    main()
