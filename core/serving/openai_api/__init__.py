"""An OpenAI-compatible server on top of the LocalRL :class:`~..engine.Engine`, vLLM-flavoured.

``/v1/chat/completions`` (chat template with ``tools``; tool calls parsed from the decoded
text into OpenAI ``tool_calls`` by the model's parser, ``tool_parser``: Hermes tags, JSON,
pythonic or ``auto``, :mod:`voltrl.models.toolcalls`), ``/v1/completions``, ``/v1/models``
and ``/health``. Responses carry what the gateway records, under vLLM's field names: with
``return_token_ids`` the prompt's ids (``prompt_token_ids``: top level for chat, per choice for
completions) and each choice's sampled ``token_ids``, on every streamed chunk too;
``logprobs`` as OpenAI shapes them. Logprobs are the raw model logprobs at temperature 1
unless the app is built with ``logprobs_mode="processed"`` (see :mod:`.sampling`).

Any ``model`` name is accepted (the gateway forces its own); ``/v1/models`` reports the served
name. An engine serving LoRA adapters serves each under its own name, as vLLM's multi-LoRA
does: a request whose ``model`` names an adapter is generated with it (and its response says
that name), any other with the base model; ``/v1/models`` lists the adapters too.

Unsupported or malformed parameters get a 400 with an OpenAI-shaped error. There is no
guided decoding: ``tool_choice`` ``"required"`` or a named function is treated as ``"auto"``
(the model's output is parsed for calls); ``"none"`` turns parsing off.

A request whose client disconnects, streaming or not, is aborted: its sequences leave the
engine's batch at the next step.

The parts: :mod:`.app` (the routes and serving), :mod:`.handlers` (each route's answer),
:mod:`.params` (a request body's sampling parameters and prompt), :mod:`.logprobs`.
"""

from voltrl.serving.openai_api.app import (
    create_app,
    serve_engine,
    serve_engine_in_thread,
)
from voltrl.serving.openai_api.handlers import LogprobsMode

__all__ = ["LogprobsMode", "create_app", "serve_engine", "serve_engine_in_thread"]
