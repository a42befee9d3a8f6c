"""Accuracy: (a) exact match on prompts whose continuation is known, (b) parity of greedy tokens and
their logprobs with a reference computed in-process by plain transformers on the same weights.

A broken engine (wrong positions, a reused cache) changes tokens or logprobs and fails these.
"""

from __future__ import annotations

from pathlib import Path

import httpx

PARITY_TOKENS = 8
LOGPROB_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.05}


def exact_match(url: str, model: str, pairs: list[tuple[str, str]], max_tokens: int = 48) -> dict:
    misses = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for prompt, expected in pairs:
            reply = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0})
            text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else f"<HTTP {reply.status_code}>"
            if text.strip() != expected.strip():
                misses.append({"prompt": prompt, "expected": expected, "got": text})
    score = 1 - len(misses) / len(pairs) if pairs else 0.0
    return {"score": score, "total": len(pairs), "misses": misses[:10]}


def reference(model_dir: Path, prompts: list[str], tokens: int) -> list[list[tuple[str, float]]]:
    """Greedy continuations and their logprobs, step by step with plain transformers (no cache tricks)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            steps = []
            for _ in range(tokens):
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                token = int(torch.argmax(logprobs))
                steps.append((tokenizer.decode([token]), float(logprobs[token])))
                ids.append(token)
            results.append(steps)
    return results


def parity(url: str, model: str, model_dir: Path, prompts: list[str], precision: str = "fp32") -> dict:
    tolerance = LOGPROB_TOLERANCE.get(precision, 0.1)
    expected = reference(model_dir, prompts, PARITY_TOKENS)
    mismatches, worst = [], 0.0
    with httpx.Client(base_url=url, timeout=120) as http:
        for prompt, ref in zip(prompts, expected):
            reply = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": PARITY_TOKENS,
                                                       "temperature": 0, "logprobs": 0, "ignore_eos": True})
            if reply.status_code != 200:
                mismatches.append({"prompt": prompt, "problem": f"HTTP {reply.status_code}"})
                continue
            logprobs = reply.json()["choices"][0]["logprobs"]
            got = list(zip(logprobs["tokens"], logprobs["token_logprobs"]))
            for position, ((want_token, want_lp), (got_token, got_lp)) in enumerate(zip(ref, got)):
                if want_token != got_token:
                    mismatches.append({"prompt": prompt, "position": position,
                                       "problem": f"token {got_token!r} != reference {want_token!r}"})
                    break
                worst = max(worst, abs(want_lp - got_lp))
                if abs(want_lp - got_lp) > tolerance:
                    mismatches.append({"prompt": prompt, "position": position,
                                       "problem": f"logprob {got_lp:.5f} vs reference {want_lp:.5f}"})
                    break
            else:
                if len(got) < len(ref):
                    mismatches.append({"prompt": prompt, "problem": f"{len(got)} tokens, reference {len(ref)}"})
    return {"passed": not mismatches, "prompts": len(prompts), "tolerance": tolerance,
            "max_logprob_diff": worst, "mismatches": mismatches[:10]}
