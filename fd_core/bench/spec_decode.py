"""Speculative decoding's figures for ``fd bench serve``: the server's ``spec_decode`` counters
(vLLM's names, ``fd:`` or ``vllm:`` prefix) read from ``GET /metrics`` before and after the
timed requests, and their difference — the acceptance rate and length the load saw. A server
that does not speculate, or has no ``/metrics``, gives none."""

from __future__ import annotations

from typing import Any

COUNTERS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "draft_tokens",
            "spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def parse(text: str) -> dict[str, Any] | None:
    """The counters in a Prometheus exposition, summed over labels; None without any."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name.split(":", 1)[-1].removesuffix("_total")
            if name == PER_POSITION:
                position = int(sample.labels.get("position", 0))
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
            elif name in COUNTERS:
                out[COUNTERS[name]] = out.get(COUNTERS[name], 0.0) + sample.value
    if not out:
        return None
    out["per_position"] = [per_pos[p] for p in sorted(per_pos)]
    return out


async def scrape(client: Any) -> dict[str, Any] | None:
    try:
        response = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - a server without /metrics reports nothing here
        return None
    return parse(response.text) if response.status_code == 200 else None


def difference(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the run added, as vLLM's ``bench serve`` reports it: acceptance rate (accepted over
    draft tokens), acceptance length (tokens a verifying step emits, one plus accepted over
    drafts), and each position's acceptance rate (accepted there over drafts)."""
    if after is None:
        return None
    before = before or {"num_drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_position": []}
    drafts = after["num_drafts"] - before["num_drafts"]
    tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    old = before["per_position"] + [0.0] * (len(after["per_position"]) - len(before["per_position"]))
    return {
        "num_drafts": int(drafts), "draft_tokens": int(tokens), "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / tokens if tokens else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance_rate": [(a - b) / drafts if drafts else None
                                         for a, b in zip(after["per_position"], old)],
    }


def table_rows(spec: dict[str, Any] | None) -> list[tuple[str, str]]:
    if spec is None:
        return []
    rate, length = spec["acceptance_rate"], spec["acceptance_length"]
    per = ", ".join("-" if r is None else f"{r:.0%}" for r in spec["per_position_acceptance_rate"])
    return [("speculative: drafts / tokens", f"{spec['num_drafts']} / {spec['draft_tokens']}"),
            ("acceptance rate", "-" if rate is None else f"{rate:.1%} ({spec['accepted_tokens']} accepted)"),
            ("acceptance length", "-" if length is None else f"{length:.2f} tokens a step"),
            ("accepted by position", per or "-")]
