"""The engine's front door, shared by the server's AsyncEngine and the offline LLM.

    prompt ids + SamplingParams --InputProcessor.process--> EngineRequest (validated once)
    EngineRequest --EngineFrontend.add--> ParentRequest --n / best_of child Requests--> EngineCore
    EngineCore.step() --SeqDeltas--> their ParentRequest --RequestOutput--> emit callback

Every check that can fail runs in `process`, before anything is queued, so a caller with many
prompts (one API request) can check them all first and queue all or none.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from convoy.engine.core import EngineCore
from convoy.engine.errors import EngineStepError
from convoy.engine.output_processor import SeqDelta
from convoy.engine.parent_request import ParentRequest
from convoy.engine.request import EngineRequest, Priority
from convoy.outputs import RequestOutput
from convoy.sampling_params import SamplingParams, SamplingParamsError
from convoy.structured.compiler import GrammarCompiler


class InputProcessor:
    """Validation against the model: token ids inside the embedding, prompts inside the context;
    and a constraint compiled (in the calling thread: the engine thread never compiles)."""

    def __init__(self, vocab_size: int, max_model_len: int, grammars: GrammarCompiler) -> None:
        self.vocab_size = vocab_size  # rows of the model's embedding: the bound for token ids
        self.max_model_len = max_model_len
        self.grammars = grammars

    def process(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        group_id: str | None = None,
        *,
        param: str = "prompt",
        max_tokens_must_fit: bool = False,
        priority: Priority = Priority.INTERACTIVE,
    ) -> EngineRequest:
        """Raise SamplingParamsError naming the offending field (`param` for the prompt), or
        StructuredOutputsError when params.structured_outputs does not compile (cached per spec).

        With max_tokens_must_fit (the API's rule) a prompt whose max_tokens would run past the
        context is rejected; otherwise generation just stops at the context length.
        """
        self.check_token_ids(prompt_token_ids, param)
        num_tokens = len(prompt_token_ids)
        # a prompt leaves one position to generate into; an embedding's may fill the context
        pooling = params.pooling is not None
        if num_tokens >= self.max_model_len + pooling:
            raise SamplingParamsError(self._too_long(num_tokens, 0, pooling), param)
        max_tokens = params.max_tokens or 0
        if max_tokens_must_fit and num_tokens + max_tokens > self.max_model_len:
            raise SamplingParamsError(self._too_long(num_tokens, max_tokens), "max_tokens")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids", allow_empty=True)
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias", allow_empty=True)
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammars.compile(spec)
        return EngineRequest(
            request_id, prompt, list(prompt_token_ids), params, group_id or request_id,
            time.monotonic(), priority, grammar,
        )  # fmt: skip

    def check_token_ids(self, token_ids: list[int], param: str, allow_empty: bool = False) -> None:
        if not token_ids and not allow_empty:
            raise SamplingParamsError(f"{param} must contain at least one token", param)
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise SamplingParamsError(
                f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param
            )

    def _too_long(self, num_prompt_tokens: int, max_tokens: int, pooling: bool = False) -> str:
        head = f"this model's maximum context length is {self.max_model_len} tokens; the"
        if pooling:  # nothing is generated after an embedding's input
            return f"{head} input has {num_prompt_tokens} tokens"
        return (
            f"{head} request has {num_prompt_tokens} prompt tokens and asks for {max_tokens}"
            " completion tokens" + ("" if max_tokens else " (at least one must be left to generate)")
        )


class EngineFrontend:
    """The core plus the parent requests in flight. Not thread-safe: one thread drives it."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inputs = InputProcessor(core.vocab_size, core.max_model_len, core.grammars)
        self.parents: dict[str, ParentRequest] = {}

    def has_work(self) -> bool:
        return self.core.has_work()

    def add(self, request: EngineRequest, emit: Callable[[RequestOutput], object]) -> None:
        parent = ParentRequest(request, emit)
        self.parents[request.request_id] = parent
        for child in parent.make_children(self.core.eos_token_ids):
            self.core.add_request(child)

    def abort(self, request_id: str, emit: bool = True) -> None:
        """End a prompt's sequences now (finish reason `abort`) and free their blocks."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        deltas = self.core.abort_requests([c.req_id for c in parent.children])
        if emit and deltas:
            parent.update(deltas)

    def abort_all(self, emit: bool = True) -> None:
        for request_id in list(self.parents):
            self.abort(request_id, emit)

    def step(self) -> None:
        """One engine step; every parent with news emits, finished parents are dropped.

        A failed step ends the prompts it ran (their blocks freed, nothing emitted) and raises
        EngineStepError naming them, for the caller to tell their clients; the rest go on.
        So does a sequence whose constraint failed (its matcher hit a limit): its prompt ends
        (every child), the error (StructuredOutputsError) in EngineStepError.errors.
        """
        self._run(self.core.step)

    def side_step(self) -> None:
        """A side step (EngineCore.side_step), inside a step in flight; errors as `step`'s,
        naming only the side step's prompts."""
        self._run(self.core.side_step)

    def _run(self, run: Callable[[], list[SeqDelta]]) -> None:
        try:
            deltas = run()
        except EngineStepError as e:
            for request_id in e.request_ids:
                self.abort(request_id, emit=False)
            raise
        failed = self._route(deltas)
        if failed:
            for request_id in failed:
                self.abort(request_id, emit=False)
            first = next(iter(failed.values()))
            raise EngineStepError(str(first), frozenset(failed), errors=failed)

    def _route(self, deltas: list[SeqDelta]) -> dict[str, Exception]:
        """Hand deltas to their parents; returns the prompts a failed constraint ends, each
        with its error (nothing of theirs is emitted)."""
        by_parent: dict[str, list[SeqDelta]] = {}
        failed: dict[str, Exception] = {}
        for d in deltas:
            by_parent.setdefault(d.req.parent_id, []).append(d)
            if d.req.error is not None:
                failed.setdefault(d.req.parent_id, d.req.error)
        for request_id, group in by_parent.items():
            if request_id in failed:
                continue
            parent = self.parents[request_id]
            parent.update(group)
            if parent.finished:
                del self.parents[request_id]
        return failed
