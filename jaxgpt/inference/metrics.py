"""The server's GET /metrics: the engine's state and counters in Prometheus' text format (0.0.4)."""
from __future__ import annotations


def _spec_lines(s: dict, policy) -> list[tuple]:
    """Speculative decoding's counters, and with spec_max_batch='auto' what its rule measured and decided."""
    lines = []
    if "spec_proposed" in s:
        rate = s["spec_accepted"] / max(1, s["spec_proposed"])
        lines += [("jaxgpt_spec_acceptance_rate", "gauge", "accepted / proposed draft tokens", rate),
                  ("jaxgpt_spec_rounds_total", "counter", "steps that ran a speculative round", s["spec_rounds"]),
                  ("jaxgpt_spec_off_steps_total", "counter", "steps whose decoding rows could speculate but "
                   "took plain decode steps (the batch's rule said it loses)", s["spec_off_steps"])]
    if policy is None:
        return lines
    est = policy.estimates()
    per = est["buckets"].items()
    lines += [("jaxgpt_spec_alpha", "gauge", "per-token acceptance estimate of the auto rule", est["alpha"]),
              ("jaxgpt_spec_expected_tokens", "gauge", "tokens a row emits per round at that alpha",
               est["expected_tokens"])]
    for name, key, help_ in (("jaxgpt_spec_round_seconds", "t_spec", "median seconds of a speculative call"),
                             ("jaxgpt_decode_step_seconds", "t_plain", "median seconds of a plain decode call")):
        lines.append((name, "gauge", help_ + " by rows bucket", {f'rows="{b}"': e[key] for b, e in per
                                                                 if e[key] is not None}))
    lines.append(("jaxgpt_spec_on", "gauge", "1 where the auto rule's estimates say speculation wins, by rows "
                  "bucket (it still explores the losing mode now and then)",
                  {f'rows="{b}"': int(e["wins"]) for b, e in per if e["wins"] is not None}))
    return lines


def metrics_text(engine, tokens_per_second: float) -> str:
    """/metrics' body for ``engine``; ``tokens_per_second``: the engine loop's recent output rate."""
    a, s = engine.allocator, engine.stats
    lines = [
        ("jaxgpt_kv_pages_free", "gauge", "KV cache pages on the free list", a.free),
        ("jaxgpt_kv_pages_total", "gauge", "allocatable KV cache pages", a.total),
        ("jaxgpt_requests_running", "gauge", "requests in the running batch", len(engine.running)),
        ("jaxgpt_requests_waiting", "gauge", "requests waiting for admission", len(engine.waiting)),
        ("jaxgpt_prompt_tokens_total", "counter", "prompt tokens received", s["prompt_tokens"]),
        ("jaxgpt_generation_tokens_total", "counter", "output tokens generated", s["generated_tokens"]),
        ("jaxgpt_generation_tokens_per_second", "gauge", "output tokens/s over the last 10 s", tokens_per_second),
        ("jaxgpt_preemptions_total", "counter", "requests preempted (pages freed, recomputed)", s["preemptions"]),
        ("jaxgpt_engine_steps_total", "counter", "engine steps", s["steps"]),
        ("jaxgpt_compiled_shapes", "gauge", "distinct (kind, rows, tokens, pages) shapes run", engine.compilations),
    ]
    lines += _spec_lines(s, engine.spec_policy)
    if "prefix_queries" in s:
        lines += [("jaxgpt_prefix_cache_hit_rate", "gauge", "prompt tokens found in the prefix cache / looked up",
                   s["prefix_hits"] / max(1, s["prefix_queries"])),
                  ("jaxgpt_prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache",
                   s["prefix_hits"])]
    return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n" + ("".join(f"{n}{{{lab}}} {x}\n" for lab, x in v.items())
                                                           if isinstance(v, dict) else f"{n} {v}\n")
                   for n, t, h, v in lines)  # a dict: one sample a label set


__all__ = ["metrics_text"]
