"""One step's scheduled sequences -> flat tensors (ids, positions, slot mapping, block tables) -> logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from convoy.kernels.linear import QuantLinear
from convoy.models.attention import Attention, AttentionMetadata, PrefillSeq
from convoy.models.layers import CausalLM
from convoy.sampling_params import Pooling
from convoy.worker.batch import ScheduledSeq
from convoy.worker.kv_cache import KVCache


@dataclass(slots=True)
class RunnerOutput:
    # (N, vocab) fp32: one row per sequence with need_logits, in order; with a quantized head, a
    # view of the runner's buffer, valid until its next execute
    logits: torch.Tensor
    # per scheduled seq: (k, hidden) final hidden states of the positions that score prompt
    # tokens, or None; their logits are computed by `ModelRunner.compute_logits` in slices
    prompt_hidden: list[torch.Tensor | None]
    # per sequence with `pooling`: its chunk's final hidden states reduced (fp64, on the CPU)
    pooled: dict[str, npt.NDArray[np.float64]]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        native_decode: bool = False,
    ) -> None:
        self.model = model
        # the csrc kernels (CPU): decode attention, and norms / rotary + cache writes / gated
        # activations in the model
        self.native_decode = native_decode
        if isinstance(model, CausalLM):
            model.use_native_kernels(native_decode)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        # the sampling rows' logits, reused step after step (a quantized head writes into it):
        # Gemma 3's are 67 MB at 64 rows, and a fresh tensor that size costs ~30 ms of page faults
        self._logits = torch.empty(0)
        self.device = device
        for module in model.modules():
            if isinstance(module, Attention):
                module.bind_cache(*kv_cache.layer(module.layer_idx))

    @torch.inference_mode()
    def execute(
        self, seqs: list[ScheduledSeq], between_layers: Callable[[int, int], None] | None = None
    ) -> RunnerOutput:
        """`between_layers`: see `CausalLM.forward` (a step run there must not pass one)."""
        input_ids, positions, meta = self.prepare(seqs)
        if between_layers is None:
            hidden = self.model(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, between_layers)
        rows: list[int] = []
        prompt_spans: list[tuple[int, int] | None] = []
        pooled: dict[str, npt.NDArray[np.float64]] = {}
        offset = 0
        for s in seqs:
            n = len(s.token_ids)
            if s.pooling is not None:
                pooled[s.req_id] = _pool(hidden[offset : offset + n], s.pooling)
            if s.prompt_logits_from is not None and s.prompt_logits_from < n:
                prompt_spans.append((offset + s.prompt_logits_from, offset + n))
            else:
                prompt_spans.append(None)
            if s.need_logits:  # the last position, and each draft token's
                rows.extend(range(offset + n - 1 - len(s.draft), offset + n))
            offset += n
        sampling = hidden if len(rows) == offset else hidden[rows]  # all decode: every row
        prompt_hidden = [
            None if span is None else hidden[span[0] : span[1]] for span in prompt_spans
        ]
        # a step of embedding chunks only computes no logits (no head read)
        logits = self._sampling_logits(sampling) if rows else hidden.new_empty(0, 0)
        return RunnerOutput(logits, prompt_hidden, pooled)

    def _sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        model = self.model
        if not (isinstance(model, CausalLM) and isinstance(model.lm_head, QuantLinear)):
            return self.compute_logits(hidden)
        n, vocab = hidden.shape[0], model.lm_head.out_features
        if self._logits.shape[0] < n or self._logits.shape[-1] != vocab:
            self._logits = torch.empty(n, vocab, device=hidden.device)
        return model.compute_logits(hidden, out=self._logits[:n])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) final hidden states -> (N, vocab) fp32 logits."""
        logits: torch.Tensor = self.model.compute_logits(hidden)  # type: ignore[operator]
        return logits

    def prepare(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_map: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prompt_lens: list[int] = []
        for s in seqs:
            start, n, table = s.start_pos, len(s.token_ids), s.block_table
            flat = len(ids)
            ids.extend(s.token_ids)
            prompt_lens.extend([s.prompt_len or start + n] * n)
            pos.extend(range(start, start + n))
            slot_map.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1 or s.draft:
                # a decode token; or a draft's verification, each position a decode row of its
                # own (the kernels of a decode step, so its bits; the fused layer when all are)
                decode_idx.extend(range(flat, flat + n))
                decode_tables.extend([table] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                ctx = start + n
                # the native path reads every chunk's keys from the cache, a fresh one's too
                blocks = (
                    self._blocks([table], self._num_blocks(ctx))
                    if start > 0 or self.native_decode
                    else torch.empty(0, dtype=torch.long, device=self.device)
                )
                prefills.append(PrefillSeq(flat, flat + n, ctx, blocks))
        dev = self.device
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slot_map, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            prefills=prefills,
            decode_idx=None,
            decode_blocks=None,
            decode_len_max=0,
            decode_lens=None,
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.long, device=dev),
        )
        meta.native_decode = self.native_decode
        if decode_idx:
            meta.decode_idx = torch.tensor(decode_idx, dtype=torch.long, device=dev)
            num_blocks = self._num_blocks(max(decode_lens))
            meta.decode_len_max = num_blocks * bs
            meta.decode_blocks = self._blocks(decode_tables, num_blocks)
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            meta.all_decode = not prefills
        return torch.tensor(ids, dtype=torch.long, device=dev), meta.positions, meta

    def _num_blocks(self, length: int) -> int:
        return (length + self.block_size - 1) // self.block_size

    def _blocks(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """(B * num_blocks,) the first num_blocks blocks of each table, 0-padded."""
        padded: list[int] = []
        for t in tables:
            head = t[:num_blocks]
            padded.extend(head)
            padded.extend([0] * (num_blocks - len(head)))
        return torch.tensor(padded, dtype=torch.long, device=self.device)


def _pool(rows: torch.Tensor, pooling: Pooling) -> npt.NDArray[np.float64]:
    """One chunk's (n, hidden) final hidden states -> their fp64 sum (mean pooling) or last row;
    the sum runs over this sequence's rows only, in order, so it never depends on the step."""
    if pooling is Pooling.MEAN:
        return rows.double().sum(0).cpu().numpy()
    return rows[-1].double().cpu().numpy()
