"""llama.cpp's own quantizer (ggml_quantize_chunk in the libggml-base that llama-cpp-python ships),
called on numpy arrays: the byte-for-byte reference our ggml encoders are tested against."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  (raises ImportError when the interop extra is missing)

    libdir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    return lib


def available() -> bool:
    try:
        _lib()
    except (ImportError, OSError):
        return False
    return True


def ggml_quantize(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize float32 rows ``x [rows, n_per_row]`` with ggml; returns uint8 ``[rows, row_bytes]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    t = GGMLQuantizationType[qtype]
    block, block_bytes = GGML_QUANT_SIZES[t]
    out = np.zeros((rows, n // block * block_bytes), dtype=np.uint8)
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert qw.shape == (n,)
    written = _lib().ggml_quantize_chunk(
        int(t), x.ctypes.data, out.ctypes.data, 0, rows, n, None if qw is None else qw.ctypes.data
    )
    assert written == out.nbytes, (written, out.nbytes)
    return out


def llama_quantize_file(src: Path, dst: Path, ftype: int, imatrix: dict[str, np.ndarray] | None = None,
                        nthread: int = 2) -> None:
    """Run llama.cpp's own file quantizer (what `llama-quantize` does) on a GGUF file.

    ``imatrix`` maps GGUF tensor names to per-column importance (llama.cpp's imatrix entries).
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = nthread
    params.ftype = ftype
    keep = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            values = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(values)
            entries[i].name = name.encode()
            entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = values.size
        entries[len(imatrix)].name = None
        params.imatrix = entries
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) on {src}")
