"""GGUF file -> Hugging Face-format folder (config.json, model.safetensors, tokenizer files).

The first load of a .gguf writes that folder under the cache dir (resolve.py: the config and the
tokenizer first, the weights dequantized once when a load needs them), atomically, so processes
starting at once never see or write half of it (`staging_dir`); every later start loads it. Tensor names and layouts are
turned back into Hugging Face's:

    llama.cpp                 Hugging Face
    token_embd                model.embed_tokens
    blk.N.attn_q / _k / _v    model.layers.N.self_attn.q_proj / k_proj / v_proj  (llama: rows un-permuted)
    blk.N.ffn_norm            ...post_attention_layernorm (llama) | ...pre_feedforward_layernorm (gemma3)
    blk.N.attn_qkv / ffn_up   ...self_attn.qkv_proj / mlp.gate_up_proj  (phi3: fused in both)
    rope_factors_long/_short  config.json rope_scaling long_factor / short_factor  (phi3 LongRoPE)
    output_norm / output      model.norm / lm_head

What differs by family (config keys, storage conventions of some tensors) is the family's own
`gguf_*` hooks, in its model file.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.models.layers import CausalLM
from convoy.models.phi3 import gguf_rope_factors
from convoy.models.registry import GGUF_FAMILIES, gguf_family

logger = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixture of experts: the router, the experts' 3-D tensors, Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
CONFIG_TENSORS = ("rope_factors_long.", "rope_factors_short.")


class ModelLoadError(RuntimeError):
    """A model file or folder cannot be loaded; the message names the file."""


def read_gguf(path: Path) -> Any:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:  # touch every tensor: a truncated file fails here, not later
            _ = t.data.shape
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct/numpy errors, ...
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
    return reader


GGUF_POOLING = {1: "mean", 3: "last"}  # llama.cpp's {arch}.pooling_type values Convoy pools by


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def open_gguf(path: Path) -> tuple[Any, str, type[CausalLM]]:
    """(reader, architecture, model family) of the GGUF file at `path`; ModelLoadError if the
    architecture is not one Convoy runs."""
    reader = read_gguf(path)
    arch = field(reader, "general.architecture")
    family = gguf_family(arch)
    if family is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(GGUF_FAMILIES)})"
        )
    return reader, arch, family


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A new folder beside `out` to write into, renamed to `out` when the block succeeds.

    The folder is unique to this call, so processes and threads converting the same file at once
    never write into each other's. The rename is atomic: `out` is whole or absent. When another
    writer renamed its folder first, that one (the same conversion) is kept and ours discarded;
    on an error ours is discarded too.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any folder
    try:
        yield tmp
        try:
            tmp.rename(out)  # fails when `out` exists and is not empty
        except OSError:
            if not out.is_dir():
                raise
            logger.info("%s was written by another process meanwhile; using that one", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename


def _config(reader: Any, arch: str, family: type[CausalLM]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    model_type, hf_arch = family.gguf_architectures[arch]
    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF rope_freqs (llama3-style rope scaling) is not supported yet")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(
            get("feed_forward_length", 0) or get("expert_feed_forward_length")
        ),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    pooling = GGUF_POOLING.get(int(get("pooling_type", 0) or 0))
    if pooling is not None:  # an embedding model's (llama.cpp's enum); none / cls / rank: not kept
        cfg["pooling_type"] = pooling
    factors = {t.name: t.data for t in reader.tensors if t.name.startswith(CONFIG_TENSORS)}
    if factors:  # phi3's LongRoPE factor lists: config, not weights
        cfg["rope_scaling"] = gguf_rope_factors(factors)
    family.gguf_config(arch, cfg, get)
    return cfg


def _tensors(
    reader: Any, arch: str, family: type[CausalLM], cfg: dict[str, Any]
) -> dict[str, torch.Tensor]:
    import gguf

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.startswith(CONFIG_TENSORS):
            continue  # in config.json (_config)
        hf_name = hf_tensor_name(t.name, family)
        if hf_name is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file")
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        w = family.gguf_tensor(arch, hf_name, torch.from_numpy(data.copy()), cfg)
        out[hf_name] = w.contiguous()
    return out


def hf_tensor_name(name: str, family: type[CausalLM]) -> str | None:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    layer, piece, kind = parts[1], parts[2], parts[3]
    target = family.gguf_layer_names.get(piece)
    if target is None:
        target = family.gguf_ffn_norm if piece == "ffn_norm" else _LAYER_NAMES.get(piece)
    return None if target is None else f"model.layers.{layer}.{target}.{kind}"


def _save_tokenizer(path: Path, reader: Any, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
