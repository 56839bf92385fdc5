"""Worker: owns the device, the model, the KV cache tensors, the runner and the sampler."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from convoy import kernels
from convoy.config import ConfigError, EngineConfig
from convoy.kernels.huge_pages import gather_in_huge_pages
from convoy.kernels.linear import QuantLinear, quantize_linears
from convoy.kernels.ops import QUANT_TYPES
from convoy.kernels.packed_linear import linear_packing, onednn_linear_available, pack_linears
from convoy.models.layers import CausalLM
from convoy.models.loader import load_model
from convoy.models.moe import quantize_experts
from convoy.models.resolve import resolve_model
from convoy.worker.batch import ModelRunnerOutput, ScheduledSeq
from convoy.worker.kv_cache import allocate_kv_cache, resolve_kv_dtype
from convoy.worker.memory import plan_memory
from convoy.worker.model_runner import ModelRunner
from convoy.worker.sampler import prompt_logprobs, sample

logger = logging.getLogger(__name__)


def accepted_prefix(sampled: list[int], draft: list[int]) -> int:
    """How many draft tokens the samples reproduce: sampled[i] was drawn at the position after
    draft[i - 1] (after the last sampled token for i = 0), so draft[i] is kept while it equals
    sampled[i]; sampled[kept] is then the step's last token."""
    kept = 0
    while kept < len(draft) and sampled[kept] == draft[kept]:
        kept += 1
    return kept


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    # auto: bf16 where the hardware computes it natively (CUDA; CPUs with AVX512-BF16 run batched
    # steps ~2x faster in bf16). On AVX2-only CPUs bf16 matmuls are emulated and ~7x slower
    # than fp32 (measured: 8 vs 59 GFLOP/s per core at 64x576x3072), so fp32 wins there.
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def resolve_quantization(config: EngineConfig, weights: Path, device: torch.device) -> str | None:
    """Which quantized mode the linears run in: "gguf", "int8", "int4" or None (dequantized).

    The kernels are CPU ones: elsewhere, or without them (no compiler), weights are dequantized
    with one warning when the mode was asked for explicitly.
    """
    mode = config.quantization
    if mode == "auto":
        mode = "gguf" if weights.suffix == ".gguf" and config.dtype == "auto" else "none"
        explicit = False
    else:
        explicit = True
    if mode == "none":
        return None
    if mode == "gguf" and weights.suffix != ".gguf":
        raise ConfigError(f"quantization 'gguf' needs a .gguf model file, not {weights}")
    if device.type != "cpu":
        if explicit:
            logger.warning("quantization %r runs on the CPU only: weights dequantized", mode)
        return None
    if not kernels.available():
        logger.warning("quantized weights need the CPU kernels (see above): weights dequantized")
        return None
    return mode


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        resolved = resolve_model(config.model)
        self.model_name = resolved.name
        self.model_path = resolved.weights_path
        self.model_dir = resolved.model_dir
        self.model_config = resolved.config
        self.device = resolve_device(config.device)
        self.quantization = resolve_quantization(config, self.model_path, self.device)
        # Quantized weights take fp32 activations: "auto" means fp32 around them.
        auto_fp32 = self.quantization is not None and config.dtype == "auto"
        self.dtype = torch.float32 if auto_fp32 else resolve_dtype(config.dtype, self.device)
        # gguf: the linears (and embedding) of these GGUF block types are built from their
        # blocks; their dequantized weights are never materialised.
        quant_types = QUANT_TYPES.keys() if self.quantization == "gguf" else None
        cache = config.cache
        kv_name = cache.kv_cache_dtype
        if kv_name == "auto" and self.quantization is not None:
            kv_name = "float16"  # 16-bit K/V beside quantized weights, as llama.cpp keeps them
        self.kv_dtype = resolve_kv_dtype(kv_name, self.dtype)
        # Sized and checked before anything big is allocated: a model too large for the
        # machine fails here, naming the sizes, not in the kernel's OOM killer mid-load.
        self.memory = plan_memory(
            resolved.config, self.model_path, self.dtype,
            set(quant_types) if quant_types is not None else None, self.kv_dtype,
            cache.block_size, cache.kv_cache_memory, cache.num_kv_blocks,
            check_host=self.device.type == "cpu",
        )  # fmt: skip
        logger.info("memory plan for %s: %s", self.model_name, self.memory.describe())
        self.model = load_model(resolved, self.dtype, self.device, quant_types)
        if self.quantization in ("int8", "int4"):
            bits = 8 if self.quantization == "int8" else 4
            quantize_linears(self.model, bits)
            quantize_experts(self.model, bits)
            gather_in_huge_pages(self.model)
        self.model_family: type[CausalLM] = type(self.model)
        self.quantized_linears = sum(isinstance(m, QuantLinear) for m in self.model.modules())
        self.packed_linears = 0
        packing = linear_packing(self.device, self.dtype) if config.prepack_linears else None
        if packing == "fp32-kernel" and self.quantized_linears and onednn_linear_available(
            self.device, self.dtype
        ):  # a quantized model's few fp32 linears (head, routers) stay on oneDNN as before
            packing = "onednn"
        if packing is not None:
            self.packed_linears = pack_linears(self.model, packing)
        self.num_blocks = self.memory.kv_blocks
        kv = allocate_kv_cache(
            resolved.config, self.num_blocks, cache.block_size, self.kv_dtype, self.device
        )
        self.native_decode = (
            config.cpu_kernels
            and self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and kernels.available()
        )
        self.runner = ModelRunner(self.model, kv, self.device, self.native_decode)
        logger.info(
            "loaded %s (%s) on %s in %s; %d KV blocks of %d tokens; %d linears quantized, "
            "%d prepacked; native decode attention: %s",
            self.model_name, resolved.config.architecture, self.device, self.dtype,
            self.num_blocks, cache.block_size, self.quantized_linears, self.packed_linears,
            self.native_decode,
        )  # fmt: skip

    @torch.inference_mode()
    def execute(
        self, seqs: list[ScheduledSeq], between_layers: Callable[[int, int], None] | None = None
    ) -> ModelRunnerOutput:
        """Run one step: forward the new tokens, sample where a sequence samples, score prompts,
        pool embeddings. `between_layers`: see `CausalLM.forward`."""
        result = ModelRunnerOutput()
        if not seqs:
            return result
        out = self.runner.execute(seqs, between_layers)
        result.pooled = out.pooled
        sampling = [s for s in seqs if s.sampling is not None]
        if sampling:
            rows = [
                row
                for s in sampling
                if s.sampling is not None
                for row in (s.sampling, *s.draft_rows)
            ]
            sampled = sample(out.logits, rows)
            i = 0
            for s in sampling:
                tokens = sampled.token_ids[i : i + len(s.draft) + 1]
                keep = accepted_prefix(tokens, s.draft) + 1
                result.sampled_token_ids[s.req_id] = tokens[:keep]
                lps = sampled.sampled_logprobs[i : i + keep]
                if lps[0] is not None:
                    result.sampled_logprobs[s.req_id] = lps
                entries = sampled.logprobs[i : i + keep]
                if entries[0] is not None:
                    result.logprobs[s.req_id] = [e for e in entries if e is not None]
                i += len(s.draft) + 1
        for s, hidden in zip(seqs, out.prompt_hidden, strict=True):
            if s.scoring is not None and hidden is not None:
                targets = s.scoring.targets  # the chunk's last position may predict no prompt token
                result.prompt_logprobs[s.req_id] = prompt_logprobs(
                    hidden[: len(targets)], targets, s.scoring.k,
                    self.runner.compute_logits, self.model_config.vocab_size,
                )  # fmt: skip
        return result
