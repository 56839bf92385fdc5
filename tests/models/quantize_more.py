"""Plain quantizers for the GGUF types the gguf package cannot quantize (IQ4_NL, IQ4_XS, Q2_K,
Q3_K): nearest-value rounding with per-block scales, in llama.cpp's block layouts (ggml-common.h).
Not llama.cpp's search for the best scales: a test model only needs real weights in these blocks,
and the exact mode dequantizes the same blocks (with the gguf package) to compare against."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
TYPES = (T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K)


def quantize_more(w: np.ndarray, qtype: T) -> np.ndarray:
    """(rows, K) float -> (rows, K / block * bytes) uint8 blocks of `qtype`."""
    w = np.asarray(w, np.float32)
    rows = w.shape[0]
    if qtype == T.IQ4_NL:
        return _iq4_nl(w.reshape(-1, 32)).reshape(rows, -1)
    if qtype == T.IQ4_XS:
        return _iq4_xs(w.reshape(-1, 256)).reshape(rows, -1)
    if qtype == T.Q2_K:
        return _q2_k(w.reshape(-1, 256)).reshape(rows, -1)
    if qtype == T.Q3_K:
        return _q3_k(w.reshape(-1, 256)).reshape(rows, -1)
    raise NotImplementedError(qtype)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _nibbles(idx: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes: weight j in the low nibble of byte j, j + 16 high."""
    return (idx[:, :16] | (idx[:, 16:] << 4)).astype(np.uint8)


def _codebook_index(x: np.ndarray) -> np.ndarray:
    return np.abs(x[..., None] - IQ4_VALUES).argmin(-1)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Per row the value of largest magnitude, sign kept (llama.cpp's max for IQ4's scale)."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    d = (_signed_max(x) / -127).astype(np.float16).astype(np.float32)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    idx = _codebook_index(x * inv[:, None])
    return np.concatenate([_f16(d), _nibbles(idx)], 1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    s = _signed_max(sub) / -127  # (n, 8) each sub-block's own scale
    d = (np.abs(s).max(-1) / 31).astype(np.float16).astype(np.float32)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    ls = np.clip(np.rint(s * inv[:, None]), -32, 31).astype(np.int64)  # (n, 8)
    dl = d[:, None] * ls
    inv_l = np.divide(1, dl, out=np.zeros_like(dl), where=dl != 0)
    idx = _codebook_index(sub * inv_l[..., None]).reshape(n * 8, 32)
    u = ls + 32
    scales_h = np.zeros(n, np.uint16)
    for ib in range(8):
        scales_h |= ((u[:, ib] >> 4) & 3).astype(np.uint16) << (2 * ib)
    scales_l = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)  # (n, 4)
    qs = _nibbles(idx).reshape(n, 128)
    return np.concatenate([_f16(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], 1)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 -> (n, 64) bytes: element 128 h + 32 j + l in qs[32 h + l] bits 2j."""
    n = q.shape[0]
    q = q.reshape(n, 2, 4, 32).astype(np.uint8)
    out = np.zeros((n, 2, 32), np.uint8)
    for j in range(4):
        out |= q[:, :, j] << (2 * j)
    return out.reshape(n, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    lo = np.minimum(sub.min(-1), 0)
    s = (sub.max(-1) - lo) / 3
    d = (s.max(-1) / 15).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 15).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), 0, 15).astype(np.int64)
    mq = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 15).astype(np.int64)
    step = d[:, None] * sc
    inv = np.divide(1, step, out=np.zeros_like(step), where=step != 0)
    q = np.clip(np.rint((sub + (dmin[:, None] * mq)[..., None]) * inv[..., None]), 0, 3)
    scales = (sc | (mq << 4)).astype(np.uint8)
    return np.concatenate(
        [scales, _pack_2bit(q.reshape(n, 256).astype(np.int64)), _f16(d), _f16(dmin)], 1
    )


def _q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(-1) / 4
    d = (s.max(-1) / 31).astype(np.float16).astype(np.float32)
    ls = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -32, 31).astype(np.int64)
    step = d[:, None] * ls
    inv = np.divide(1, step, out=np.zeros_like(step), where=step != 0)
    u = (np.clip(np.rint(sub * inv[..., None]), -4, 3) + 4).astype(np.int64).reshape(n, 256)
    qs = _pack_2bit(u & 3)
    hmask = np.zeros((n, 32), np.uint8)
    hi = (u >> 2).reshape(n, 2, 4, 32).astype(np.uint8)
    for h in range(2):
        for j in range(4):
            hmask |= hi[:, h, j] << (4 * h + j)
    sc = ls + 32  # (n, 16) 6-bit
    packed = np.zeros((n, 12), np.uint8)
    for i in range(16):
        low, high = sc[:, i] & 15, (sc[:, i] >> 4) & 3
        if i < 8:
            packed[:, i] |= low.astype(np.uint8)
        else:
            packed[:, i - 8] |= (low << 4).astype(np.uint8)
        packed[:, 8 + i % 4] |= (high << (2 * (i // 4))).astype(np.uint8)
    return np.concatenate([hmask, qs, packed, _f16(d)], 1)
