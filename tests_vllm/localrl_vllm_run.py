"""Run by ``test_localrl_vllm.py`` under the vLLM environment's python: one LocalRL step with
``engine="vllm"`` on a tiny model, then a validation served by the updated weights.

    python tests_vllm/localrl_vllm_run.py RUN_PARENT [lora|heads16]

With ``lora``, a LoRA adapter trains and vLLM serves the merged weights. With ``heads16``,
the model has heads of 16, which vLLM's CPU attention cannot run: the run must fail saying so.

Prints one JSON line: the run directory and the vLLM engine's counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openai import AsyncOpenAI

import voltrl as vl
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer


@vl.rollout
async def say_the_letter(task: dict, llm: vl.LLM) -> float:
    """One chat call; reward 1 when the reply contains the task's letter."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say {task['letter']}."}],
        **llm.sampling_parameters,
    )
    return float(task["letter"] in (reply.choices[0].message.content or ""))


def main(parent: Path, mode: str) -> None:
    tok = build_tiny_tokenizer()
    heads, kv_heads = (4, 2) if mode == "heads16" else (2, 1)
    model = build_tiny_model(tok, hidden=64, layers=2, heads=heads, kv_heads=kv_heads, seed=0)
    lora = mode == "lora"
    algo = vl.LocalRL(
        model,
        tokenizer=tok,
        schedule={"steps": 1, "tasks_per_step": 4, "group_size": 8},
        validation={"every": 1, "sampling": {"max_tokens": 8}},
        serving={"engine": "vllm", "engine_args": {"enforce_eager": True, "max_model_len": 512}},
        checkpoints={"every": 0},
        sampling={"temperature": 1.0, "max_tokens": 8},
        update={"lr": 0.05, "micro_batch_size": 8, "use_lora": lora, "lora_r": 8},
    )
    rows = [{"letter": c} for c in "abcdefgh"]
    name = "vllm-lora" if lora else "vllm"
    trainer = vl.Trainer(algo, run_dir=parent, name=name, progress=False)
    result = trainer.fit(say_the_letter, rows[:4], val_dataset=rows[4:])
    print(json.dumps({"run_dir": str(result.run_dir), "history": algo.history}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), mode=(sys.argv[2:] or ["full"])[0])
