"""Accuracy: (a) exact match on prompts whose continuation is known, (b) parity of greedy tokens and
their logprobs with a reference computed in-process by plain transformers on the same weights,
(c) optionally, token-for-token parity of greedy outputs with another server on the same weights
(another engine's image), which catches what differs between engines rather than from a reference.

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


def served_profile(url: str) -> str | None:
    """The id of the profile a NIM-contract server selected (/v1/metadata); None from other servers."""
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            return str(http.get("/v1/metadata").json()["selectedModelProfileId"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def served_precision(url: str) -> str | None:
    """The precision of the profile a NIM-contract server selected (/v1/manifest lists its tags); None
    for a server that publishes neither."""
    import yaml

    if (selected := served_profile(url)) is None:
        return None
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            manifest = yaml.safe_load(http.get("/v1/manifest").json()["manifest_file"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return next((p["tags"]["precision"] for p in manifest.get("profiles", []) if p.get("id") == selected), None)


def parity(url: str, model: str, model_dir: Path, prompts: list[str], precision: str = "fp32") -> dict:
    """Logprobs within the precision's tolerance of an fp32 reference (an unknown precision gets bf16's)."""
    tolerance = LOGPROB_TOLERANCE.get(precision, LOGPROB_TOLERANCE["bf16"])
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


def greedy_tokens(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> list[str] | str:
    """The greedy continuation's tokens, or the problem when the server does not answer."""
    reply = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "logprobs": 0})
    if reply.status_code != 200:
        return f"HTTP {reply.status_code}"
    return reply.json()["choices"][0]["logprobs"]["tokens"]


def engine_parity(url: str, reference_url: str, model: str, prompts: list[str], max_tokens: int = 48) -> dict:
    """Greedy outputs of `url` and `reference_url` must be identical, token for token."""
    mismatches = []
    with httpx.Client(base_url=url, timeout=120) as http, httpx.Client(base_url=reference_url, timeout=120) as ref:
        for prompt in prompts:
            got, want = greedy_tokens(http, model, prompt, max_tokens), greedy_tokens(ref, model, prompt, max_tokens)
            if isinstance(got, str) or isinstance(want, str):
                mismatches.append({"prompt": prompt, "problem": got if isinstance(got, str) else f"reference {want}"})
            elif got != want:
                position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                mismatches.append({"prompt": prompt, "position": position,
                                   "problem": f"{got[position:position + 3]} != reference {want[position:position + 3]}"})
    return {"passed": not mismatches, "prompts": len(prompts), "reference": reference_url,
            "mismatches": mismatches[:10]}
