"""Helpers that run the same weights through fd and through Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def fd_greedy_logits(llm, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy-generate ``steps`` tokens with fd and record the logits of every sampled row:
    the prefill's last position, then each decode step. Returns (tokens, logits [steps, V])."""
    from fd_core import SamplingParams

    model = llm.engine.runner.model
    memory = llm.engine.memory
    seen: list[np.ndarray] = []
    original = model.compute_logits

    def recording(hidden, rows):
        logits = original(hidden, rows)
        seen.append(memory.to_numpy(logits))
        return logits

    model.compute_logits = recording
    try:
        out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)
    finally:
        model.compute_logits = original
    return out[0].outputs[0].token_ids, np.concatenate(seen, axis=0)


def hf_logits(model_dir: Path, token_ids: list[int], **load_kwargs) -> np.ndarray:
    """transformers' float32 logits for every position of ``token_ids`` on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **load_kwargs)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: one number per comparison, scale-free."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def teacher_forced_ties(hf, prompts: list[list[int]], outputs: list[list[int]], steps: int = 64,
                        tie: float = 1e-4) -> int:
    """fd's greedy ``outputs`` against a transformers model ``hf`` (on a GPU) given fd's own
    prefixes (one forward per prompt, so one near-tie cannot cascade into a different
    continuation): a token that is not transformers' argmax must be within ``tie`` of it (float32
    noise between kernel mixes). Returns how many such near-ties there were."""
    import torch

    ties = 0
    for prompt, tokens in zip(prompts, outputs):
        assert len(tokens) == steps
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        best = rows.argmax(-1)
        for step, token in enumerate(tokens):
            if token != int(best[step]):
                gap = float(rows[step, best[step]] - rows[step, token])
                assert gap < tie, f"step {step}: fd chose {token}, transformers {int(best[step])} by {gap}"
                ties += 1
    return ties
